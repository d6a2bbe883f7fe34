"""Fuzz targets for the parsers that run in the fuzzing process itself.

Each target takes one input (bytes from libFuzzer, read through atheris's
FuzzedDataProvider so that the mutations keep a structure) and returns nothing when
the code under test behaved: it accepted the input or refused it with the one error
it documents. Anything else is raised as `Finding` (a bug), with a one-line
description that never holds the input's bytes.

- codec:   replica_agent.codec.decode_block (BlockFormatError only; a tensor only for a
           well-formed block of the spec, equal to its payload bytes)
- sealing: policy.sealing.BlockSealer.open (SealError only; never opens a changed
           block) and Keyring.parse_toml (ConfigError only)
- config:  cacheserver.config.load_config on TOML built from the real keys with
           values of every type (ConfigError only)
- journal: cacheserver.store.journal.replay of a real ring with bytes flipped anywhere and
           any recorded position (yields only records that were committed, as
           committed; never raises)
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import atheris


class Finding(Exception):
    """The code under test did something it must not (a bug)."""


Target = Callable[[bytes], None]


def describe(error: BaseException) -> str:
    """Where an exception came from: type and innermost project frame (no values)."""
    frame = ""
    tb = error.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if "/site-packages/" not in path and "/lib/python" not in path:
            frame = f"{Path(path).name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return f"{type(error).__name__} at {frame or 'library code'}"


# -- codec ---------------------------------------------------------------------------


def codec_target() -> Target:
    import torch

    from replica_agent.codec import HEADER_BYTES, BlockFormatError, decode_block, encode_header
    from replica_agent.spec import ModelSpec

    spec = ModelSpec("fuzz/model", "r1", 2, 2, 8, "float16", block_tokens=4)
    header = encode_header(spec)
    size = HEADER_BYTES + spec.block_payload_bytes

    def one(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        if fdp.ConsumeBool():  # a real header, then bytes flipped and the length changed
            block = bytearray(header + fdp.ConsumeBytes(spec.block_payload_bytes))
            for _ in range(fdp.ConsumeIntInRange(0, 4)):
                if block:
                    block[fdp.ConsumeIntInRange(0, len(block) - 1)] ^= fdp.ConsumeIntInRange(1, 255)
            raw = bytes(block[: fdp.ConsumeIntInRange(0, len(block) + 8)])
        else:
            raw = fdp.ConsumeBytes(fdp.remaining_bytes())
        try:
            tensor = decode_block(spec, raw)
        except BlockFormatError:
            return
        if len(raw) != size or raw[:HEADER_BYTES] != header:
            raise Finding("decode_block returned a tensor for a block that is not of the spec")
        if tensor.view(-1).view(torch.uint8).numpy().tobytes() != raw[HEADER_BYTES:]:
            raise Finding("decode_block returned other bytes than the payload")

    return one


# -- sealing -------------------------------------------------------------------------


def sealing_target() -> Target:
    from kvcommon.errors import ConfigError
    from policy.sealing import BlockSealer, Keyring, SealError, new_key_entry

    keyring = Keyring.parse_toml(new_key_entry("t", 1) + new_key_entry("t", 2), "fuzz")
    sealer = BlockSealer(keyring)
    digest = bytes(32)
    sealed = sealer.seal("t", "m", digest, b"plaintext of a block" * 4)

    def one(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        mode = fdp.ConsumeIntInRange(0, 2)
        if mode == 2:  # a keyring file
            with contextlib.suppress(ConfigError):
                Keyring.parse_toml(fdp.ConsumeUnicodeNoSurrogates(fdp.remaining_bytes()), "fuzz")
            return
        if mode == 0:
            blob = bytearray(sealed)
            for _ in range(fdp.ConsumeIntInRange(0, 3)):
                blob[fdp.ConsumeIntInRange(0, len(blob) - 1)] ^= fdp.ConsumeIntInRange(0, 255)
            blob = blob[: fdp.ConsumeIntInRange(0, len(blob))] + fdp.ConsumeBytes(8)
            raw = bytes(blob)
        else:
            raw = fdp.ConsumeBytes(fdp.remaining_bytes())
        try:
            sealer.open("t", "m", digest, raw)
        except SealError:
            return
        if raw != sealed:
            raise Finding("BlockSealer.open opened a block that was changed")

    return one


# -- config --------------------------------------------------------------------------


@functools.cache
def _keys() -> dict[str, list[str]]:
    """Every key the parser reads, table by table, from the specs themselves: a key
    added later is fuzzed too."""
    from cacheserver.config.specs import (
        BULK_SPECS,
        LIMITS_SPECS,
        STORAGE_SPECS,
        TELEMETRY_SPECS,
        TLS_SPECS,
        TOP_SPECS,
    )
    from cacheserver.tiers.cluster.config import REDIS_CLUSTER_SPECS
    from policy.config import PRINCIPAL_KEYS, TENANT_KEYS

    tables = {
        "": TOP_SPECS,
        "storage": STORAGE_SPECS,
        "limits": LIMITS_SPECS,
        "tls": TLS_SPECS,
        "telemetry": TELEMETRY_SPECS,
        "bulk": BULK_SPECS,
        "redis_cluster": REDIS_CLUSTER_SPECS,
    }
    keys = {table: sorted(specs) for table, specs in tables.items()}
    return {**keys, "tenants": sorted(TENANT_KEYS), "principals": sorted(PRINCIPAL_KEYS)}


VALUES = [
    "0",
    "-1",
    "1",
    "9223372036854775807",
    "4611686018427387904",
    '"127.0.0.1:99999"',
    "18446744073709551616",
    "true",
    '"x"',
    '""',
    '"alpha"',
    '"' + "a" * 64 + '"',
    "[]",
    '["alpha"]',
    '["read", "write"]',
    "{}",
    "1.5",
    "nan",
    "1979-05-27",
    '"' + "0" * 64 + '"',
    '"uri:spiffe://x/y"',
    '"127.0.0.1:0"',
]


def _config_text(fdp: atheris.FuzzedDataProvider) -> str:
    if fdp.ConsumeIntInRange(0, 7) == 0:
        return str(fdp.ConsumeUnicodeNoSurrogates(fdp.remaining_bytes()))
    lines = []
    keys_of = _keys()
    tables = list(keys_of)
    for _ in range(fdp.ConsumeIntInRange(1, 8)):
        table = tables[fdp.ConsumeIntInRange(0, len(tables) - 1)]
        if table in ("tenants", "principals"):
            lines.append(f"[[{table}]]")
        elif table:
            lines.append(f"[{table}]")
        keys = keys_of[table]
        for _ in range(fdp.ConsumeIntInRange(0, 4)):
            key = keys[fdp.ConsumeIntInRange(0, len(keys) - 1)]
            if fdp.ConsumeIntInRange(0, 3) == 0:
                value = fdp.ConsumeUnicodeNoSurrogates(12).replace("\n", " ")
            else:
                value = VALUES[fdp.ConsumeIntInRange(0, len(VALUES) - 1)]
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


def config_target() -> Target:
    from cacheserver.config import load_config
    from kvcommon.errors import ConfigError

    directory = Path(tempfile.mkdtemp(prefix="kvshare-fuzz-config-"))
    path = directory / "kvshare.toml"

    def one(data: bytes) -> None:
        text = _config_text(atheris.FuzzedDataProvider(data))
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        with contextlib.suppress(ConfigError):
            load_config(path)

    return one


# -- journal replay --------------------------------------------------------------------


def journal_target() -> Target:
    from cacheserver.store.journal import DATA_START, Journal, record_bytes, replay
    from cacheserver.tiers import Position
    from policy.types import ModelTag, StorageKey, TenantId

    directory = Path(tempfile.mkdtemp(prefix="kvshare-fuzz-journal-"))
    directory.chmod(0o700)
    path = directory / "ring.journal"
    journal = Journal(path, 16 << 20)
    committed: dict[int, tuple[Any, ...]] = {}
    end = DATA_START
    for i in range(8):
        payload = bytes([i]) * (100 + 300 * i)
        end += record_bytes(len(payload))
        key, tenant, tag = StorageKey(bytes([i]) * 32), TenantId(f"t{i % 3}"), ModelTag(bytes(16))
        if i == 5:  # one record left RESERVED, as a crash mid-receive leaves it
            journal.reserve(key, tenant, 0, tag, len(payload))
            continue
        record = journal.reserve(key, tenant, i, tag, len(payload))
        record.view[:] = payload  # as a put receives its bytes into the record
        journal.commit(record)
        committed[record.seq] = (key, tenant, i, tag, payload)
    start = journal.start
    journal_id = journal.journal_id
    fd = os.open(path, os.O_RDWR)

    def one(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        changes = []
        for _ in range(fdp.ConsumeIntInRange(0, 8)):
            hot = fdp.ConsumeBool()  # mostly inside the records, sometimes anywhere
            at = fdp.ConsumeIntInRange(0, end - 1) if hot else fdp.ConsumeIntInRange(0, 16 << 20)
            old = os.pread(fd, 1, at)
            if old:
                changes.append((at, old))
                os.pwrite(fd, bytes([old[0] ^ fdp.ConsumeIntInRange(1, 255)]), at)
        position = start
        if fdp.ConsumeIntInRange(0, 3) == 0:  # the position LMDB recorded, corrupted too
            position = Position(
                journal_id if fdp.ConsumeBool() else fdp.ConsumeBytes(16),
                fdp.ConsumeIntInRange(0, 2**64 - 1),
                fdp.ConsumeIntInRange(0, 2**64 - 1) if fdp.ConsumeBool() else DATA_START,
            )
        try:
            for record in replay(path, position):
                fields = (record.key, record.tenant, record.epoch, record.model_tag)
                if committed.get(record.seq) != (*fields, record.payload):
                    raise Finding("replay yielded a record that was never committed as such")
        finally:
            for at, old in reversed(changes):
                os.pwrite(fd, old, at)

    return one


TARGETS: dict[str, Callable[[], Target]] = {
    "codec": codec_target,
    "sealing": sealing_target,
    "config": config_target,
    "journal": journal_target,
}
