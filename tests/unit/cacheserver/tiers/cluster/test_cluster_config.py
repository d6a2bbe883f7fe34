"""`[redis_cluster]` (docs/design.md §6): the contract keys, defaults, errors that name the key
and line, and the owner-only password file."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheserver.config import ServerConfig, load_config
from cacheserver.tiers.cluster.config import DEFAULT_KEY_PREFIX
from cacheserver.tiers.cluster.credentials import read_password
from kvcommon.errors import ConfigError
from tests.support.configs import MINIMAL

# The [redis_cluster] example of docs/design.md §6.
DESIGN_EXAMPLE = """
[redis_cluster]
nodes = ["10.0.0.7:7000", "10.0.0.8:7000"]   # seed nodes
username = ""            # Redis ACL user (optional)
password_file = ""       # owner-only file (optional)
tls = false              # TLS to Redis, with tls_ca = "..." (optional)
key_prefix = "kvshare:"
"""


def load(tmp_path: Path, table: str) -> ServerConfig:
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL + table)
    return load_config(path)


def test_the_design_example_parses_with_its_defaults(tmp_path: Path) -> None:
    config = load(tmp_path, DESIGN_EXAMPLE).redis_cluster
    assert config is not None
    assert [str(n) for n in config.nodes] == ["10.0.0.7:7000", "10.0.0.8:7000"]
    assert (config.username, config.password_file, config.tls, config.tls_ca) == (
        "",
        None,
        False,
        None,
    )
    assert config.key_prefix == DEFAULT_KEY_PREFIX
    assert config.local_copies is True
    assert load(tmp_path, "").redis_cluster is None  # no table: no cluster


def test_tls_and_credentials(tmp_path: Path) -> None:
    table = DESIGN_EXAMPLE.replace("tls = false", 'tls = true\ntls_ca = "/etc/ca.pem"')
    table = table.replace('username = ""', 'username = "kvshare"')
    table = table.replace('password_file = ""', 'password_file = "/etc/kvshare/redis.pw"')
    config = load(tmp_path, table).redis_cluster
    assert config is not None and config.tls and config.tls_ca == Path("/etc/ca.pem")
    assert config.username == "kvshare" and config.password_file == Path("/etc/kvshare/redis.pw")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("key_prefix", "key_prefx"), "redis_cluster.key_prefx: unknown key"),
        (
            ('nodes = ["10.0.0.7:7000", "10.0.0.8:7000"]', "nodes = []"),
            "redis_cluster.nodes: must be",
        ),
        (('"10.0.0.8:7000"', '"10.0.0.8"'), "redis_cluster.nodes"),
        (('"10.0.0.8:7000"', '"0.0.0.0:7000"'), "name a node's real address"),
        (('key_prefix = "kvshare:"', 'key_prefix = "{kv}:"'), "no braces"),
        (("tls = false", 'tls = false\ntls_ca = "/ca.pem"'), "set tls = true as well"),
        (("tls = false", 'tls = "yes"'), "redis_cluster.tls: must be bool"),
        (
            ('key_prefix = "kvshare:"', "timeout_ms = 0"),
            "redis_cluster.timeout_ms: 0 is out of range; use an integer from 1 to",
        ),
    ],
)
def test_errors_name_the_key_and_line(tmp_path: Path, edit: tuple[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("{", r"\{")) as raised:
        load(tmp_path, DESIGN_EXAMPLE.replace(*edit))
    assert "c.toml:" in str(raised.value)


def test_nodes_are_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"redis_cluster\.nodes: name at least one seed node"):
        load(tmp_path, '[redis_cluster]\nkey_prefix = "kv:"\n')


def test_the_password_file_must_be_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "redis.pw"
    path.write_text("s3cret\n")
    path.chmod(0o640)
    table = DESIGN_EXAMPLE.replace('password_file = ""', f'password_file = "{path}"')
    config = load(tmp_path, table).redis_cluster
    assert config is not None
    with pytest.raises(ConfigError, match="readable by group or others; chmod 600"):
        read_password(config)
    path.chmod(0o600)
    assert read_password(config) == "s3cret"  # positive control
    path.unlink()
    with pytest.raises(ConfigError, match="cannot read it"):
        read_password(config)
