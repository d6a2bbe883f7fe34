"""Config parsing: the contract keys, defaults, and errors that name key and line."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path

import pytest

from cacheserver.config import (
    SECTION_SPECS,
    TlsFiles,
    load_config,
)
from cacheserver.config.specs import (
    BULK_SPECS,
    LIMITS_SPECS,
    STORAGE_SPECS,
    TELEMETRY_SPECS,
    TLS_SPECS,
)
from cacheserver.tiers.cluster.config import REDIS_CLUSTER_SPECS, RedisClusterConfig
from kvcommon.errors import ConfigError
from policy.config import (
    PRINCIPAL_KEYS,
    PUBLIC_SPECS,
    REQUESTS_PER_S,
    TENANT_KEYS,
    TENANT_NUMBERS,
    PublicConfig,
)
from policy.config_text import (
    IntIn,
    Refused,
    key_line,
)
from policy.identity import Action
from tests.support.configs import MINIMAL


def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return load_config(path)


def test_the_design_example_is_a_complete_config(tmp_path: Path) -> None:
    """MINIMAL is the complete config of docs/design.md §8: everything else defaults."""
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
    """With a shared token the last principal used to win silently: refused at load."""
    second = MINIMAL.split("[[principals]]")[1].replace('"replica-a"', '"replica-b"')
    with pytest.raises(ConfigError, match=r"principals\[1\].token_sha256.*its own token"):
        load(tmp_path, MINIMAL + "\n[[principals]]" + second)
    other_token = second.replace(hashlib.sha256(b"t").hexdigest(), hashlib.sha256(b"u").hexdigest())
    load(tmp_path, MINIMAL + "\n[[principals]]" + other_token)  # positive control


# -- every key has a spec, and every spec's bounds hold -------------------------------


def int_specs() -> list[tuple[str, IntIn]]:
    tables: dict[str, Mapping[str, object]] = {
        "storage": STORAGE_SPECS,
        "limits": LIMITS_SPECS,
        "bulk": BULK_SPECS,
        "telemetry": TELEMETRY_SPECS,
        "redis_cluster": REDIS_CLUSTER_SPECS,
        "tenants": TENANT_NUMBERS,
        "principals": {"requests_per_s": REQUESTS_PER_S},
    }
    return [
        (f"{table}.{key}", spec)
        for table, specs in tables.items()
        for key, spec in specs.items()
        if isinstance(spec, IntIn)
    ]


def test_every_field_of_every_table_has_a_spec() -> None:
    for cls, specs in SECTION_SPECS.items():
        assert {f.name for f in fields(cls)} == set(specs), cls.__name__
    assert {f.name for f in fields(RedisClusterConfig)} == set(REDIS_CLUSTER_SPECS)
    assert {f.name for f in fields(TlsFiles)} == {"cert_chain", "private_key", "client_ca"}
    assert set(TLS_SPECS) == {"cert", "key", "client_ca"}
    assert set(TENANT_NUMBERS) | {"id", "read_public", "require_sealed"} == TENANT_KEYS
    assert {f.name for f in fields(PublicConfig)} == set(PUBLIC_SPECS)
    assert "requests_per_s" in PRINCIPAL_KEYS
    # Each default is within its own spec.
    for cls, specs in SECTION_SPECS.items():
        for key, spec in specs.items():
            assert spec.check(getattr(cls(), key)) == getattr(cls(), key), key


@pytest.mark.parametrize(("name", "spec"), int_specs(), ids=[n for n, _ in int_specs()])
def test_each_bound_is_allowed_and_one_past_it_is_not(name: str, spec: IntIn) -> None:
    assert spec.check(spec.lo) == spec.lo and spec.check(spec.hi) == spec.hi
    for outside in (spec.lo - 1, spec.hi + 1):
        if outside == 0 and spec.zero:
            assert spec.check(0) == 0  # 0 means something else, and is allowed
            continue
        with pytest.raises(Refused, match=f"{outside} is out of range; use an integer from"):
            spec.check(outside)
    with pytest.raises(Refused, match="must be int"):
        spec.check(True)


def test_the_bounds_taken_from_elsewhere_still_agree() -> None:
    """config cannot import these modules (they import it): the copies are checked here."""
    from cacheserver.config.specs import GRPC_MAX_MESSAGE, GRPC_SLACK_BYTES, JOURNAL_MIN_BYTES
    from cacheserver.store.journal.ring import MIN_CAPACITY
    from cacheserver.transport.grpc.service import FRAME_SLACK_BYTES

    assert JOURNAL_MIN_BYTES == MIN_CAPACITY
    largest = LIMITS_SPECS["max_message_bytes"]
    assert isinstance(largest, IntIn)
    assert largest.hi + GRPC_SLACK_BYTES <= GRPC_MAX_MESSAGE  # what server.py sizes gRPC to
    assert largest.lo > FRAME_SLACK_BYTES  # a frame has room for payload


def test_key_line_finds_keys_headers_and_array_entries() -> None:
    text = (
        'listen = "x"\n'  # 1
        "[[tenants]]\n"  # 2
        'id = "a"\n'  # 3
        "[[tenants]]\n"  # 4
        "quota_bytes = 4\n"  # 5
        's = """\n'  # 6
        "[storage]\n"  # 7: inside a multi-line string, not a header
        '"""\n'  # 8
        "[storage]\n"  # 9
        "a.b = 1\n"  # 10
        "[telemetri]\n"  # 11
    )
    assert key_line(text, ("listen",)) == 1
    assert key_line(text, ("tenants", 1, "quota_bytes")) == 5
    assert key_line(text, ("tenants", 0, "quota_bytes")) == 2  # not written: its table
    assert key_line(text, ("storage",)) == 9
    assert key_line(text, ("storage", "a")) == 10
    assert key_line(text, ("telemetri",)) == 11
    assert key_line(text, ("nowhere",)) == 0


def test_a_config_that_never_ends_is_refused_after_16_mib() -> None:
    with pytest.raises(ConfigError, match=r"/dev/zero: over 16777216 bytes; is this the config"):
        load_config(Path("/dev/zero"))
