"""Credential files a replica re-reads when they change (replica_agent/credentials.py):
when a change is taken, and that a file that cannot be used never is."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from kvcommon.errors import ConfigError
from policy.sealing import BlockSealer, Keyring, SealError, new_key_entry
from replica_agent.credentials import KeyringFileSealer, TokenFile
from tests.support.credential_files import write_secret

MODEL, DIGEST = "m@r;fp32;L1;H1;D1;B1;tp0/1", bytes(32)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def token_file(path: Path, clock: Clock, *, settle_s: float = 0.0) -> TokenFile:
    return TokenFile(path, check_interval_s=1.0, settle_s=settle_s, clock=clock)


def test_a_renamed_token_is_taken_at_the_next_check_not_before(tmp_path: Path) -> None:
    path, clock = tmp_path / "token", Clock()
    write_secret(path, "first\n")
    tokens = token_file(path, clock)
    assert tokens() == "first"
    write_secret(path, "second\n")
    clock.now = 0.5
    assert tokens() == "first"  # no stat between checks
    clock.now = 1.0
    assert tokens() == "second" and tokens.generation == 2


def test_a_file_written_in_place_is_taken_only_once_left_alone(tmp_path: Path) -> None:
    path, clock = tmp_path / "token", Clock()
    write_secret(path, "complete-token")
    tokens = token_file(path, clock, settle_s=3600.0)
    with path.open("w", encoding="utf-8") as f:  # in place, and (so far) half of it
        f.write("compl")
    clock.now = 1.0
    assert tokens() == "complete-token"  # just written: maybe not finished
    an_hour_ago = time.time() - 3601
    os.utime(path, (an_hour_ago, an_hour_ago))
    clock.now = 2.0
    assert tokens() == "compl"  # left alone long enough: the writer is done


@pytest.mark.parametrize(
    ("content", "mode"),
    [("", 0o600), ("   \n", 0o600), ("good-token", 0o644)],
    ids=["empty", "blank", "readable-by-others"],
)
def test_a_token_file_that_cannot_be_used_keeps_the_token_in_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, mode: int
) -> None:
    path, clock = tmp_path / "token", Clock()
    write_secret(path, "in-use")
    tokens = token_file(path, clock)
    write_secret(path, content, mode=mode)
    with caplog.at_level(logging.WARNING, logger="replica_agent.credentials"):
        for step in range(1, 4):
            clock.now = float(step)
            assert tokens() == "in-use"
    assert len(caplog.records) == 1  # one line per version of the file, not per check
    assert "previous version stays in use" in caplog.records[0].getMessage()
    assert "in-use" not in caplog.text and "good-token" not in caplog.text
    write_secret(path, "fixed")
    clock.now = 9.0
    assert tokens() == "fixed"  # positive control: a usable file is taken


def test_a_removed_token_file_keeps_the_token_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, clock = tmp_path / "token", Clock()
    write_secret(path, "in-use")
    tokens = token_file(path, clock)
    path.unlink()
    with caplog.at_level(logging.WARNING, logger="replica_agent.credentials"):
        for step in range(1, 4):
            clock.now = float(step)
            assert tokens() == "in-use"
    assert len(caplog.records) == 1


def test_an_unusable_token_file_at_start_up_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token_file: cannot read"):
        TokenFile(tmp_path / "absent")
    write_secret(tmp_path / "open", "t", mode=0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        TokenFile(tmp_path / "open")


def keyring_text(*versions: int, tenant: str = "alpha") -> str:
    return "".join(new_key_entry(tenant, v) for v in versions)


def test_the_keyring_file_rotates_seal_and_open(tmp_path: Path) -> None:
    path, clock = tmp_path / "keyring.toml", Clock()
    write_secret(path, keyring_text(1))
    v1 = Keyring.from_file(path)
    sealer = KeyringFileSealer(path, check_interval_s=1.0, settle_s=0.0, clock=clock)
    old = sealer.seal("alpha", MODEL, DIGEST, b"old block")
    # v1 kept, v2 added: v2 seals new blocks, v1 still opens the old ones.
    write_secret(path, path.read_text() + keyring_text(2))
    clock.now = 1.0
    new = sealer.seal("alpha", MODEL, DIGEST, b"new block")
    assert int.from_bytes(new[5:9], "big") == 2
    assert sealer.open("alpha", MODEL, DIGEST, old) == b"old block"
    assert sealer.open("alpha", MODEL, DIGEST, new) == b"new block"
    # v1 removed: what it sealed opens no more; v2's still does (positive control).
    v2_only = "".join(path.read_text().split("[[keys]]")[2:])
    write_secret(path, "[[keys]]" + v2_only)
    clock.now = 2.0
    with pytest.raises(SealError):
        sealer.open("alpha", MODEL, DIGEST, old)
    assert sealer.open("alpha", MODEL, DIGEST, new) == b"new block"
    assert BlockSealer(v1).open("alpha", MODEL, DIGEST, old) == b"old block"  # the key was right
    assert sealer.generation == 3


def test_a_broken_keyring_file_keeps_the_keyring_in_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, clock = tmp_path / "keyring.toml", Clock()
    write_secret(path, keyring_text(1))
    sealer = KeyringFileSealer(path, check_interval_s=1.0, settle_s=0.0, clock=clock)
    sealed = sealer.seal("alpha", MODEL, DIGEST, b"block")
    good = path.read_text()
    write_secret(path, good[: len(good) // 2])  # cut in the middle of the key
    with caplog.at_level(logging.WARNING, logger="replica_agent.credentials"):
        clock.now = 1.0
        assert sealer.open("alpha", MODEL, DIGEST, sealed) == b"block"
        clock.now = 2.0
        assert sealer.keyring.tenants() == ["alpha"]
    assert len(caplog.records) == 1 and "keyring_file" in caplog.records[0].getMessage()
    key = good.split('key = "')[1].split('"')[0]
    assert key not in caplog.text


def test_the_sealers_keyring_cannot_be_replaced_behind_the_files_back(tmp_path: Path) -> None:
    path = tmp_path / "keyring.toml"
    write_secret(path, keyring_text(1))
    sealer = KeyringFileSealer(path)
    with pytest.raises(AttributeError, match="rewrite the file"):
        sealer.keyring = Keyring({})
