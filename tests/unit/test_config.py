"""Config parsing: the contract keys, defaults, and errors that name key and line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from cacheserver.config import load_config
from kvcommon.errors import ConfigError
from policy.identity import Action

MINIMAL = f"""listen = "127.0.0.1:50051"
data_dir = "./kvshare-data"

[[tenants]]
id = "acme"
quota_bytes = 1073741824

[[principals]]
name = "replica-a"
token_sha256 = "{hashlib.sha256(b"t").hexdigest()}"
tenants = ["acme"]
actions = ["read", "write"]
"""


def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return load_config(path)


def test_the_design_example_is_a_complete_config(tmp_path: Path) -> None:
    config = load(tmp_path, MINIMAL)
    assert config.listen == "127.0.0.1:50051"  # type: ignore[attr-defined]
    access = config.access  # type: ignore[attr-defined]
    assert access.tenants[0].quota_bytes == 1 << 30
    principal = access.credentials[0].principal
    assert principal.tenants == {"acme"} and principal.actions == {Action.READ, Action.WRITE}
    assert config.storage.sync_writes is False  # type: ignore[attr-defined]
    assert config.storage.sync_interval_ms == 1000  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("quota_bytes = 1073741824", "quota_bytez = 1"),
            "c.toml:6: tenants[0].quota_bytez: unknown key",
        ),
        (('id = "acme"', 'id = "Acme!"'), "c.toml:5: tenants[0].id: must match"),
        (
            ('tenants = ["acme"]', 'tenants = ["other"]'),
            "c.toml:11: principals[0].tenants: names tenant 'other'",
        ),
        (('"read", "write"', '"read", "delete"'), "principals[0].actions: unknown action 'delete'"),
        (('token_sha256 = "', 'token_sha256 = "zz'), "principals[0].token_sha256: must be 64"),
        (("listen =", "lissen ="), "c.toml:1: lissen: unknown key"),
    ],
)
def test_errors_name_the_key_and_line(tmp_path: Path, edit: tuple[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load(tmp_path, MINIMAL.replace(*edit))


def test_storage_and_limits_tables(tmp_path: Path) -> None:
    config = load(
        tmp_path, MINIMAL + "[storage]\nmemory_budget_bytes = 5\n[limits]\nmax_block_bytes = 7\n"
    )
    assert config.storage.memory_budget_bytes == 5  # type: ignore[attr-defined]
    assert config.limits.max_block_bytes == 7  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"storage\.sync_writes: must be bool"):
        load(tmp_path, MINIMAL + "[storage]\nsync_writes = 1\n")


def test_the_bulk_table(tmp_path: Path) -> None:
    config = load(tmp_path, MINIMAL)
    assert config.bulk.same_host is True  # type: ignore[attr-defined]
    config = load(tmp_path, MINIMAL + "[bulk]\nsame_host = false\narena_bytes = 2097152\n")
    assert config.bulk.same_host is False  # type: ignore[attr-defined]
    assert config.bulk.arena_bytes == 2 << 20  # type: ignore[attr-defined]
    out_of_range = r"c\.toml:\d+: bulk\.arena_bytes: 4096 is out of range; use an integer from"
    with pytest.raises(ConfigError, match=out_of_range):
        load(tmp_path, MINIMAL + "[bulk]\narena_bytes = 4096\n")
    unknown = r"bulk\.arenas: unknown key; allowed: advertise, arena_bytes"
    with pytest.raises(ConfigError, match=unknown):
        load(tmp_path, MINIMAL + "[bulk]\narenas = 4\n")


def test_two_principals_with_one_token_are_refused(tmp_path: Path) -> None:
    """Issue 15 F11: with a shared token the last principal silently won."""
    second = MINIMAL.split("[[principals]]")[1].replace('"replica-a"', '"replica-b"')
    with pytest.raises(ConfigError, match=r"principals\[1\].token_sha256.*its own token"):
        load(tmp_path, MINIMAL + "\n[[principals]]" + second)
    other_token = second.replace(hashlib.sha256(b"t").hexdigest(), hashlib.sha256(b"u").hexdigest())
    load(tmp_path, MINIMAL + "\n[[principals]]" + other_token)  # positive control
