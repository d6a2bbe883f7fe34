"""What each configuration key may hold: one spec per key the parser reads, and the
flags that override them (the spec types are `policy.config_text`'s)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cacheserver.config.bulk import BULK_ADDRESSES
from kvcommon.errors import ConfigError
from policy.config import (
    REQUESTS_PER_S,
)
from policy.config_text import (
    DAY_MS,
    MAX_BUDGET_BYTES,
    Address,
    Choice,
    Flag,
    GiB,
    KiB,
    MiB,
    PathText,
    Refused,
    Spec,
    Text,
    TiB,
    int_in,
    shown,
)

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_DATA_DIR = "./kvshare-data"
LOG_FORMATS = ("text", "json")
# Bounds that come from elsewhere in the server (config cannot import those modules:
# they import this one). tests/unit/cacheserver/config/test_config.py checks that they
# still agree.
JOURNAL_MIN_BYTES = 16 * MiB  # the put journal's smallest ring (store/journal/ring.py)
GRPC_SLACK_BYTES = 1 * MiB  # protobuf framing the server (server.py) adds to max_message_bytes
GRPC_MAX_MESSAGE = (1 << 31) - 1  # gRPC's message sizes are signed 32-bit integers
MAX_CONFIG_BYTES = 16 * MiB
LMDB_MAX_VALUE = (1 << 32) - 1  # LMDB's largest value: a block is one value
MAX_MAP_BYTES = 96 * TiB  # an LMDB map that leaves room in 128 TiB of address space


# -- what each key may hold -------------------------------------------------------------
# One spec per key the parser reads (tests/unit/cacheserver/config/test_config.py checks
# that every field of each table has one). Upper bounds keep a value from overflowing
# what it feeds: a 32-bit gRPC size, a thread's wait (Python refuses waits past about
# 292 years, and an fsync thread given one dies), LMDB's largest value, the LMDB map
# (mapped whole into a 64-bit process's 128 TiB of address space: budgets stop at
# MAX_BUDGET_BYTES, whose derived map still fits; a file system may allow less, e.g.
# ext4's 16 TiB files, which the server reports at start). Intervals stop at a day, past
# anything a deployment means. Where 0 means something else (off, derived, unlimited)
# the spec says so, and the error message repeats it.

STORAGE_SPECS: dict[str, Spec] = {
    "memory_budget_bytes": int_in(0, MAX_BUDGET_BYTES, "bytes"),
    "disk_budget_bytes": int_in(1, MAX_BUDGET_BYTES, "bytes"),
    "lmdb_map_bytes": int_in(MiB, MAX_MAP_BYTES, "bytes", zero="derived from disk_budget_bytes"),
    "journal_bytes": int_in(
        JOURNAL_MIN_BYTES, TiB, "bytes", zero="no journal: a put is acknowledged after LMDB"
    ),
    "journal_dir": PathText(empty="the shared-memory tmpfs when it is writable, else none"),
    "drain_idle_ms": int_in(0, DAY_MS, "ms"),
    "sync_writes": Flag(),
    "sync_interval_ms": int_in(1, DAY_MS, "ms", zero="no periodic fsync"),
    "max_pending_write_bytes": int_in(1, TiB, "bytes"),
    "max_pending_write_bytes_per_tenant": int_in(
        1, TiB, "bytes", zero="half of max_pending_write_bytes"
    ),
}
LIMITS_SPECS: dict[str, Spec] = {
    "max_digests_per_call": int_in(1, 1_000_000),
    "max_block_bytes": int_in(1, LMDB_MAX_VALUE, "bytes"),
    # At least 1 MiB: a frame carries its protobuf framing besides payload bytes.
    "max_message_bytes": int_in(MiB, GRPC_MAX_MESSAGE - GRPC_SLACK_BYTES, "bytes"),
    "get_frame_bytes": int_in(1, GRPC_MAX_MESSAGE - GRPC_SLACK_BYTES, "bytes"),
    "requests_per_s": REQUESTS_PER_S,
    "request_burst_s": int_in(1, 3600),
}
MAX_BULK_WORKERS = 64  # processes; more than a host's cores only adds switching
AUTO_MAX_WORKERS = 8  # `[bulk] workers = 0` never picks more (BulkConfig.processes)
BULK_SPECS: dict[str, Spec] = {
    **BULK_ADDRESSES,
    "same_host": Flag(),
    "arena_bytes": int_in(MiB, 4 * GiB, "bytes"),
    "max_arenas": int_in(1, 4096, zero="no same-host arenas: TCP only"),
    "max_arenas_per_principal": int_in(1, 4096),
    # Transfer deadlines divide by it: 0 would fail every bulk transfer.
    "min_transfer_bytes_per_s": int_in(KiB, TiB, "bytes"),
    "workers": int_in(
        0,
        MAX_BULK_WORKERS,
        zero="what suits the host: 1 on 1-2 cores, else half the cores, at most 8",
    ),
}
TLS_SPECS: dict[str, Spec] = {
    "cert": PathText(),
    "key": PathText(),
    "client_ca": PathText(),
}


@dataclass(frozen=True)
class MetricsAddress:
    """`metrics_listen`: [HOST:]PORT (a bare port is loopback), or "" (off)."""

    def allowed(self) -> str:
        return '[HOST:]PORT with a port from 0 to 65535, or "" (off)'

    def check(self, value: Any) -> str:
        if not isinstance(value, str):
            raise Refused(f"must be str, not {shown(value)}; give {self.allowed()}")
        port = value.rpartition(":")[2]
        if value and not (port.isdigit() and int(port) <= 65535):
            raise Refused(
                f"metrics_listen {shown(value)} is not [HOST:]PORT; give {self.allowed()}"
            )
        if value and not value.isdigit():
            Address("metrics_listen").check(value)
        return value


@dataclass(frozen=True)
class OtlpUrl:
    def allowed(self) -> str:
        return 'the collector\'s OTLP/HTTP base URL, e.g. http://127.0.0.1:4318, or "" (off)'

    def check(self, value: Any) -> str:
        Text(0, 2048).check(value)
        if value and not value.startswith(("http://", "https://")):
            raise Refused(f"otlp_endpoint {shown(value)}; give {self.allowed()}")
        return str(value)


TELEMETRY_SPECS: dict[str, Spec] = {
    "metrics_listen": MetricsAddress(),
    "otlp_endpoint": OtlpUrl(),
    "per_tenant_labels": Flag(),
    "log_format": Choice("log_format", LOG_FORMATS),
    "health_interval_ms": int_in(1, DAY_MS, "ms"),
}
# The top level's own values; its tables are parsed by the functions below.
TOP_SPECS: dict[str, Spec] = {
    "listen": Address("listen", 0),
    "data_dir": PathText(),
    "allow_insecure_listen": Flag(),
    "audit_log": PathText(empty="<data_dir>/audit.log"),
    "secret_file": PathText(empty="<data_dir>/server.secret"),
}
TOP_KEYS = frozenset(TOP_SPECS) | {
    "tenants",
    "principals",
    "public",
    "storage",
    "limits",
    "tls",
    "telemetry",
    "bulk",
    "redis_cluster",
}
# Command-line flags that set the same values, checked by the same specs.
FLAG_SPECS: dict[str, Spec] = {
    "--listen": TOP_SPECS["listen"],
    "--data-dir": TOP_SPECS["data_dir"],
    "--bulk-listen": BULK_SPECS["listen"],
    "--bulk-advertise": BULK_SPECS["advertise"],
    "--bulk-workers": BULK_SPECS["workers"],
    "--memory-budget-bytes": STORAGE_SPECS["memory_budget_bytes"],
    "--disk-budget-bytes": STORAGE_SPECS["disk_budget_bytes"],
    "--tls-cert": TLS_SPECS["cert"],
    "--tls-key": TLS_SPECS["key"],
    "--tls-client-ca": TLS_SPECS["client_ca"],
    "--metrics-listen": TELEMETRY_SPECS["metrics_listen"],
    "--otlp-endpoint": TELEMETRY_SPECS["otlp_endpoint"],
    "--log-format": TELEMETRY_SPECS["log_format"],
}


def check_flag(flag: str, value: object) -> None:
    """A command-line value, checked by the spec of the key it overrides."""
    if value is None:
        return
    try:
        FLAG_SPECS[flag].check(str(value) if isinstance(value, Path) else value)
    except Refused as refused:
        raise ConfigError(f"{flag}: {refused}") from None
