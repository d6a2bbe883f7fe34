"""Scanning everything the server wrote finds no client digest, token or plaintext.

Positive controls in the same test: the scanner finds the sealed ciphertext (the data
is really on disk) and finds a block deliberately stored unsealed (the scanner can
see plaintext when it is there).
"""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path

import pytest
import torch

from kvcommon.errors import PermissionDenied, Unauthenticated
from policy.sealing import BlockSealer, Keyring, TenantKeys
from replica_agent import codec
from replica_agent.client import BlockClient
from replica_agent.spec import ModelSpec
from tests.support.datafiles import read_allocated
from tests.support.isolation import isolation_config, serve

SPEC = ModelSpec(
    "iso/secret-model",
    "r1",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
    block_tokens=4,
)
MODEL = SPEC.wire_model()


def everything_written(data_dir: Path) -> bytes:
    return b"".join(read_allocated(p) for p in sorted(data_dir.rglob("*")) if p.is_file())


def forms(secret: bytes) -> list[bytes]:
    """The ways a digest or token could leak: raw, hex, base64."""
    return [secret, secret.hex().encode(), base64.b64encode(secret)]


def windows(plaintext: bytes, size: int = 24) -> list[bytes]:
    return [plaintext[i : i + size] for i in range(64, len(plaintext) - size, 97)]


def test_data_files_hold_no_digest_token_or_plaintext(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    tenancy = isolation_config(tmp_path)
    sealer = BlockSealer(Keyring({"alpha": TenantKeys({1: os.urandom(32)})}))
    generator = torch.Generator().manual_seed(5)
    plaintexts = [
        codec.encode_block(SPEC, torch.randn(SPEC.block_shape, generator=generator))
        for _ in range(32)
    ]
    digests = [os.urandom(32) for _ in plaintexts]
    sealed = [sealer.seal("alpha", MODEL, d, p) for d, p in zip(digests, plaintexts, strict=True)]
    control_digest, control_plain = os.urandom(32), os.urandom(4096)
    running = serve(tenancy)
    try:
        with running.client("a") as a, running.client("b") as b:
            a.put("alpha", MODEL, digests, sealed)
            assert a.get("alpha", MODEL, digests) == sealed
            b.put("beta", MODEL, [control_digest], [control_plain])  # unsealed, on purpose
            near_miss = tenancy.tokens["a"][:-2] + "xx"  # would show if tokens were logged
            with BlockClient(running.address, near_miss) as wrong, pytest.raises(Unauthenticated):
                wrong.lookup("alpha", MODEL, digests[:1])
            with pytest.raises(PermissionDenied):  # audited as a denial
                b.get("alpha", MODEL, digests)
            a.delete("alpha", MODEL, digests[:2])
    finally:
        running.stop()
    written = everything_written(tenancy.path.parent / "data")
    # Positive controls: the ciphertext is there, and unsealed bytes would be seen.
    assert all(s[40:80] in written for s in sealed[2:])
    assert control_plain[1000:1024] in written
    secrets = [*digests, control_digest]
    secrets += [t.encode() for t in (*tenancy.tokens.values(), near_miss)]
    for secret in secrets:
        assert not any(form in written for form in forms(secret))
    assert codec.MAGIC not in written  # no plaintext block header anywhere
    assert not any(w in written for p in plaintexts for w in windows(p))
    assert MODEL.encode() not in written  # names are keyed: not even the model leaks
    logged = caplog.text.encode()
    assert not any(form in logged for s in secrets for form in forms(s))


def test_every_file_and_dir_the_server_writes_is_owner_only(tmp_path: Path) -> None:
    """Under umask 022 the data dir and lmdb/ were once 0755 and data.mdb, lock.mdb
    and server.lock 0644: any local user could read a tenant's unsealed payloads
    and tenant ids, while the server ran and after it stopped."""
    os.umask(old := os.umask(0o022))  # the test process's umask is what a library sees
    try:
        (tmp_path / "data").mkdir(mode=0o755)  # an existing, open data dir is tightened
        running = serve(isolation_config(tmp_path))
        with running.client("a") as client:
            client.put("alpha", MODEL, [os.urandom(32)], [b"unsealed payload" * 64])
        written = [running.data_dir, *running.data_dir.rglob("*")]
        names = {p.name for p in written}
        assert {"lmdb", "data.mdb", "lock.mdb", "server.lock", "server.secret"} <= names
        opened = [p for p in written if p.stat().st_mode & 0o077]
        assert opened == [], [f"{p.name}: {p.stat().st_mode & 0o777:o}" for p in opened]
        if os.getuid() == 0:  # as root (CI), show it as another user would see it
            assert not _readable_by_nobody(running.data_dir / "lmdb" / "data.mdb")
        running.stop()
    finally:
        os.umask(old)


def _readable_by_nobody(path: Path) -> bool:
    """Whether uid `nobody` can open `path` (a child process drops to it)."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            with open(path, "rb") as f:
                f.read(1)
            os._exit(0)
        except OSError:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0
