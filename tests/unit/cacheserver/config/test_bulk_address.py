"""The bulk listener's address: `[bulk] listen`/`advertise`, their flags, and the
client's rule for a wildcard announcement (kvcommon.hostport)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cacheserver import cli as serve_cli
from cacheserver.config import BulkConfig, ServerConfig, load_config
from cacheserver.config.bulk import (
    bulk_announced_address,
    bulk_listen_address,
    check_bulk_plaintext,
)
from kvcommon.errors import ConfigError
from kvcommon.hostport import HostPort, bulk_dial_address, dialed_host, parse_host_port

MINIMAL = 'listen = "127.0.0.1:50051"\n'


def load(tmp_path: Path, text: str) -> ServerConfig:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return load_config(path)


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.0.0.0:50052", HostPort("0.0.0.0", 50052)),
        ("[::]:7", HostPort("::", 7)),
        ("[::1]:0", HostPort("::1", 0)),
        (":50052", HostPort("", 50052)),
        ("store.example:443", HostPort("store.example", 443)),
    ],
)
def test_host_port_round_trips(text: str, expected: HostPort) -> None:
    assert parse_host_port(text) == expected
    assert str(expected) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("50052", "is not HOST:PORT"),
        ("host:http", "port must be a number"),
        ("host:70000", "port must be a number"),
        ("::1:5", "IPv6 address in brackets"),
        ("[::1:5", "unclosed"),
        ("a b:5", "space"),
    ],
)
def test_bad_addresses_say_what_to_write(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_host_port(text)


@pytest.mark.parametrize(
    ("announced", "target", "dialed"),
    [
        ("0.0.0.0:50052", "198.18.0.1:50051", "198.18.0.1:50052"),  # wildcard: gRPC's host
        ("[::]:50052", "store.example:50051", "store.example:50052"),
        (":50052", "dns:///store.example:50051", "store.example:50052"),
        ("0.0.0.0:50052", "[fd00::1]:50051", "[fd00::1]:50052"),
        ("0.0.0.0:50052", "ipv4:10.0.0.7:50051", "10.0.0.7:50052"),
        ("0.0.0.0:50052", "unix:/run/kvshare.sock", "localhost:50052"),
        ("10.0.0.9:6000", "198.18.0.1:50051", "10.0.0.9:6000"),  # a real host is kept
        ("bulk.example:443", "198.18.0.1:50051", "bulk.example:443"),
        ("garbage", "198.18.0.1:50051", "garbage"),  # the connect fails: gRPC fallback
    ],
)
def test_the_client_dials_the_grpc_host_for_a_wildcard(
    announced: str, target: str, dialed: str
) -> None:
    assert bulk_dial_address(announced, target) == dialed


def test_dialed_host_of_a_bare_name() -> None:
    assert dialed_host("store.example") == "store.example"


def test_default_is_the_grpc_host_at_port_plus_one(tmp_path: Path) -> None:
    config = load(tmp_path, MINIMAL)
    assert config.bulk.listen == "" and config.bulk.advertise == ""
    assert bulk_listen_address(config) == HostPort("127.0.0.1", 50052)
    assert bulk_listen_address(ServerConfig(listen="[::]:9000")) == HostPort("::", 9001)
    assert bulk_listen_address(ServerConfig(listen="127.0.0.1:0")) == HostPort("127.0.0.1", 0)
    with pytest.raises(ConfigError, match=r"gRPC port \+ 1\) does not exist; set \[bulk\] listen"):
        bulk_listen_address(ServerConfig(listen="127.0.0.1:65535"))


def test_the_bulk_table_sets_listen_and_advertise(tmp_path: Path) -> None:
    config = load(
        tmp_path, MINIMAL + '[bulk]\nlisten = "0.0.0.0:6000"\nadvertise = "store.example:6000"\n'
    )
    assert bulk_listen_address(config) == HostPort("0.0.0.0", 6000)
    assert bulk_announced_address(config, "0.0.0.0:6000") == "store.example:6000"
    assert bulk_announced_address(load(tmp_path, MINIMAL), "127.0.0.1:50052") == "127.0.0.1:50052"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('listen = "6000"', r"c\.toml:3: bulk\.listen: listen '6000' is not HOST:PORT"),
        ('advertise = "store:0"', r"c\.toml:3: bulk\.advertise: .*port 0 is not a port"),
        ('listen = "h:99999"', r"bulk\.listen: .*port must be a number"),
        ("listen = 6000", r"bulk\.listen: must be str"),
    ],
)
def test_bad_bulk_addresses_name_the_key_and_line(tmp_path: Path, table: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, MINIMAL + "[bulk]\n" + table + "\n")


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL + '[bulk]\nlisten = "127.0.0.1:6000"\nadvertise = "a.example:6000"\n')
    config = serve_cli._config_from(flags("--config", str(path)))
    assert config.bulk == BulkConfig(listen="127.0.0.1:6000", advertise="a.example:6000")
    config = serve_cli._config_from(
        flags("--config", str(path), "--bulk-listen", "127.0.0.1:7000",
              "--bulk-advertise", "b.example:7000")
    )  # fmt: skip
    assert (config.bulk.listen, config.bulk.advertise) == ("127.0.0.1:7000", "b.example:7000")
    with pytest.raises(ConfigError, match=r"--bulk-listen: listen 'nope' is not HOST:PORT"):
        serve_cli._config_from(flags("--bulk-listen", "nope"))
    with pytest.raises(ConfigError, match=r"--bulk-advertise: .*port 0 is not a port"):
        serve_cli._config_from(flags("--bulk-advertise", "h:0"))


def test_a_plaintext_bulk_listener_off_loopback_is_refused() -> None:
    exposed = ServerConfig(listen="127.0.0.1:0", bulk=BulkConfig(listen="0.0.0.0:6000"))
    with pytest.raises(ConfigError, match=r"non-loopback 0\.0\.0\.0:6000 for the bulk channel"):
        check_bulk_plaintext(exposed, has_tls=False)
    check_bulk_plaintext(exposed, has_tls=True)  # TLS covers the bulk listener too
    check_bulk_plaintext(ServerConfig(bulk=BulkConfig(listen="127.0.0.1:6000")), has_tls=False)
    allowed = ServerConfig(allow_insecure_listen=True, bulk=BulkConfig(listen="0.0.0.0:6000"))
    check_bulk_plaintext(allowed, has_tls=False)
