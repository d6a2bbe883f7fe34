"""The replicas' keyring: file permissions, versions, and its repr never shows keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcommon.errors import ConfigError
from policy.sealing import Keyring, new_key_entry


def test_a_keyring_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keyring.toml"
    path.write_text(new_key_entry("acme", 1) + new_key_entry("acme", 2))
    path.chmod(0o600)
    keyring = Keyring.from_file(path)  # positive control
    assert keyring.primary("acme")[0] == 2 and keyring.key("acme", 1) is not None
    assert "key" not in repr(keyring).replace("Keyring", "")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        Keyring.from_file(path)


def test_a_duplicate_version_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="version 1 twice"):
        Keyring.parse_toml(new_key_entry("acme", 1) + new_key_entry("acme", 1), "k")
