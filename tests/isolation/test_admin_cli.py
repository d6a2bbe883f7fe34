"""`kvshare admin`: stanzas that parse back, a token shown once and stored as a hash."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from cacheserver.config import load_config
from cacheserver.embedded import EmbeddedServer
from kvshare.cli import main
from policy.sealing import BlockSealer, Keyring
from replica_agent.client import BlockClient
from tests.support.isolation import MODEL


def admin(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["admin", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_printed_stanzas_make_a_working_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, tenant, _ = admin(capsys, "tenant", "--id", "acme", "--quota-bytes", "1048576")
    _, principal, err = admin(
        capsys, "token", "--name", "replica-a", "--tenant", "acme", "--actions", "read,write"
    )
    token = err.strip().splitlines()[-1]
    assert token not in principal  # stdout holds only the hash
    assert hashlib.sha256(token.encode()).hexdigest() in principal
    assert "shown once" in err
    _, cert, _ = admin(
        capsys, "cert", "--name", "replica-b", "--identity", "uri:spiffe://x/b", "--tenant", "acme"
    )
    head = f'listen = "127.0.0.1:0"\ndata_dir = "{tmp_path / "data"}"\n\n{tenant}\n{principal}'
    config_path = tmp_path / "kvshare.toml"
    config_path.write_text(head + "\n" + cert)
    config = load_config(config_path)
    assert config.access is not None
    assert config.access.tenants[0].quota_bytes == 1 << 20
    assert config.access.cert_credentials[0].identity == "uri:spiffe://x/b"
    config_path.write_text(head)  # no cert principal: runs without mTLS
    with (
        EmbeddedServer(load_config(config_path)) as server,
        BlockClient(server.address, token) as client,
    ):
        assert client.put("acme", MODEL, [b"d" * 32], [b"x"]) == [True]
        assert client.lookup("acme", MODEL, [b"d" * 32]) == 1


def test_token_file_and_keyring(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token_file = tmp_path / "replica.token"
    code, stanza, err = admin(
        capsys, "token", "--name", "r", "--tenant", "acme", "--token-file", str(token_file)
    )
    token = token_file.read_text().strip()
    assert code == 0 and token not in err and token not in stanza
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert admin(capsys, "token", "--name", "r", "--tenant", "acme", "--token-file",
                 str(token_file))[0] == 2  # never overwrites a token  # fmt: skip
    _, key_stanza, key_err = admin(capsys, "keyring", "--tenant", "acme", "--version", "3")
    assert "never see it" in key_err
    sealer = BlockSealer(Keyring.parse_toml(key_stanza, "stdout"))
    digest = os.urandom(32)
    assert sealer.open("acme", "m", digest, sealer.seal("acme", "m", digest, b"kv")) == b"kv"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tenant", "--id", "Bad!"], "must match"),
        (["token", "--name", "r", "--tenant", "acme", "--actions", "read,fly"], "unknown action"),
        (["cert", "--name", "r", "--identity", "spiffe://x", "--tenant", "acme"], "'uri:...'"),
        (["keyring", "--tenant", "acme", "--version", "0"], "--version"),
    ],
)
def test_bad_input_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = admin(capsys, *args)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1
