"""Dependencies are ranges with both ends, and the lock fits them (scripts/constraints.py).

A `>=`-only dependency let a fresh install resolve whatever was newest (redis-py 8 broke
the cluster tier that way), and nothing recorded which versions the suite ran against.
.ci/run runs the cluster, bulk and crypto tests at both ends of every range."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support.repo import REPO

# Pinned exactly, on purpose: torch (a looser pin pulls a multi-GB CUDA build), and the
# generator and its typing plugin, so that `gen_proto.py --check` compares like with like.
EXACT = {"torch", "grpcio-tools", "mypy-protobuf"}


def project() -> dict[str, object]:
    loaded: dict[str, object] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return loaded


def requirements() -> list[Requirement]:
    data = project()
    texts = list(data["dependencies"])  # type: ignore[call-overload]
    for extra in data["optional-dependencies"].values():  # type: ignore[attr-defined]
        texts += extra
    return [Requirement(t) for t in texts if not t.startswith("kvshare[")]


def script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "scripts/constraints.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_dependency_is_a_range_up_to_its_next_major_or_an_exact_pin() -> None:
    for requirement in requirements():
        operators = {spec.operator: Version(spec.version) for spec in requirement.specifier}
        if canonicalize_name(requirement.name) in EXACT:
            assert set(operators) == {"=="}, requirement
            continue
        assert set(operators) == {">=", "<"}, f"{requirement}: give it both ends"
        low, high = operators[">="], operators["<"]
        assert high.release[1:] in ((), (0,), (0, 0)), f"{requirement}: end at a major"
        assert low.major < high.major, requirement


def test_the_server_installs_without_torch() -> None:
    names = {canonicalize_name(Requirement(t).name) for t in project()["dependencies"]}  # type: ignore[attr-defined]
    assert "torch" not in names and "transformers" not in names
    assert "grpcio" in names  # positive control: the server's own dependencies


def test_the_lock_fits_the_ranges_and_names_every_dependency() -> None:
    result = script("check")
    assert result.returncode == 0, result.stderr
    pinned = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pinned[name] = Version(version)
    assert pinned["torch"] == Version("2.13.0")
    assert pinned["redis"].major >= 5 and "packaging" in pinned  # transitive ones too


def test_the_check_finds_a_version_outside_its_range(tmp_path: Path) -> None:
    """The check is not vacuous: the lock's own rule applied to a broken lock."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import constraints  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    lock = (REPO / "constraints.txt").read_text().replace("\nredis==", "\nredis==99.0.0\n#")
    broken = tmp_path / "constraints.txt"
    broken.write_text(lock)
    assert constraints.check(broken) == ["redis==99.0.0 is outside redis<9,>=7.2"] * 2


def test_lowest_pins_each_declared_package_once_at_its_lower_bound() -> None:
    result = script("lowest")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    pins = dict(line.split("==") for line in lines)
    assert len(pins) == len(lines)  # redis is in two extras: pinned once
    for requirement in requirements():
        bound = next(s.version for s in requirement.specifier if s.operator in (">=", "=="))
        assert pins[canonicalize_name(requirement.name)] == bound
