"""The fuzz campaign's command lines: libFuzzer keeps its artifacts (crash-*, slow-unit-*,
...) in the campaign's directory, never in the working directory (a checkout's root)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.fuzz import child_command, libfuzzer_flags


def test_libfuzzer_gets_an_artifact_prefix_inside_the_given_directory(tmp_path: Path) -> None:
    flags = libfuzzer_flags(runs=100, seed=7, artifacts=tmp_path / "artifacts" / "grpc")
    prefixes = [f for f in flags if f.startswith("-artifact_prefix=")]
    assert prefixes == [f"-artifact_prefix={tmp_path / 'artifacts' / 'grpc'}/"]
    assert "-runs=100" in flags
    assert "-seed=7" in flags


def test_seed_zero_lets_libfuzzer_pick_one(tmp_path: Path) -> None:
    assert not any(f.startswith("-seed=") for f in libfuzzer_flags(10, 0, tmp_path))


def test_the_child_is_told_to_keep_artifacts_in_the_campaign_directory(tmp_path: Path) -> None:
    command = child_command("codec", 10, 1, tmp_path, "", "", tmp_path / "journal")
    assert f"--artifacts={tmp_path / 'artifacts' / 'codec'}" in command
    assert f"--work={tmp_path}" in command
