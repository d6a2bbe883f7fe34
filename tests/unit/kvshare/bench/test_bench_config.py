"""Command-line parsing of `kvshare bench` (kvshare.bench.config, kvshare.bench.cli)."""

from __future__ import annotations

import argparse

import pytest

from kvshare.bench import cli
from kvshare.bench.config import (
    DEFAULT_SIZES,
    KIB,
    MIB,
    QUICK_SIZES,
    format_size,
    parse_size,
    parse_systems,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64KiB", 64 * KIB),
        ("2MiB", 2 * MIB),
        ("512k", 512 * KIB),
        ("4096", 4096),
        ("8 mb", 8 * MIB),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "2TiB", "-1", "0", "lots"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size_round_trips_binary_units() -> None:
    assert [format_size(s) for s in DEFAULT_SIZES] == ["64 KiB", "512 KiB", "2 MiB", "8 MiB"]
    assert format_size(1000) == "1000 B"


def test_unknown_system_is_named() -> None:
    with pytest.raises(ValueError, match="memcached"):
        parse_systems("tcp,memcached")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_match_the_issue() -> None:
    config = cli.config_from_args(_args())
    assert config.sizes == DEFAULT_SIZES
    assert config.client_counts == (1, 4)
    assert config.systems[:5] == ("tcp", "redis", "redis-unix", "lmcache", "kvshare")
    assert config.batch_blocks == 64
    assert not config.is_json


def test_quick_shrinks_but_explicit_flags_win() -> None:
    config = cli.config_from_args(_args("--quick", "--sizes", "16KiB", "--rounds", "2", "--json"))
    assert config.sizes == (16 * KIB,)
    assert config.rounds == 2
    assert config.client_counts == (1,)
    assert config.is_json
    assert cli.config_from_args(_args("--quick")).sizes == QUICK_SIZES


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError):
        cli.config_from_args(_args("--rounds", "0"))
    with pytest.raises(ValueError):
        cli.config_from_args(_args("--clients", "0"))


def test_cli_module_imports_nothing_heavy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvshare.bench.cli; "
        "heavy = {'redis', 'grpc', 'torch', 'lmdb'} & set(sys.modules); "
        "sys.exit(sorted(heavy) or 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_sixteen_clients_are_accepted_and_past_the_bulk_cap_refused() -> None:
    assert cli.config_from_args(_args("--clients", "1,4,16")).client_counts == (1, 4, 16)
    with pytest.raises(ValueError, match="bulk listener"):
        cli.config_from_args(_args("--clients", "65"))
    with pytest.raises(ValueError, match="write integers"):
        cli.config_from_args(_args("--clients", "1,many"))


def test_lookup_blocks_default_and_bounds() -> None:
    assert cli.config_from_args(_args()).lookup_blocks == 64
    assert cli.config_from_args(_args("--lookup-blocks", "0")).lookup_blocks == 0
    with pytest.raises(ValueError, match="--lookup-blocks"):
        cli.config_from_args(_args("--lookup-blocks", "5000"))
