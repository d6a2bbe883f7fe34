"""Server configuration, parsed once at start-up into frozen dataclasses.

The TOML keys `listen`, `data_dir`, `[[tenants]]` and `[[principals]]` are a contract
(DESIGN §8); `[storage]`, `[limits]`, `[tls]`, `[telemetry]`, `[bulk]` and `audit_log` are optional
with the defaults below; `[redis_cluster]` (DESIGN §6) is parsed by
`cacheserver.tiers.cluster.config`.
Command-line flags override the file. Unknown keys anywhere are errors naming the key
and its line.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cacheserver.config.bulk import check_bulk_address
from cacheserver.tiers.cluster.config import RedisClusterConfig, parse_redis_cluster
from kvcommon.errors import ConfigError, InvalidArgument
from policy.audit import AUDIT_FILE
from policy.config import AccessConfig, line_of, parse_access
from policy.naming import SECRET_FILE
from policy.ratelimit import DEFAULT_BURST_S, DEFAULT_REQUESTS_PER_S

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_DATA_DIR = "./kvshare-data"
TOP_KEYS = frozenset(
    {
        "listen",
        "data_dir",
        "allow_insecure_listen",
        "tenants",
        "principals",
        "storage",
        "limits",
        "tls",
        "telemetry",
        "bulk",
        "audit_log",
        "secret_file",
        "redis_cluster",
    }
)
TLS_KEYS = frozenset({"cert", "key", "client_ca"})
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class StorageConfig:
    memory_budget_bytes: int = 1 * GiB
    disk_budget_bytes: int = 8 * GiB
    # 0: derived from the disk budget with room for LMDB's page overhead and free lists.
    lmdb_map_bytes: int = 0
    # An acknowledged block always survives a crash of the server process (kill -9).
    # By default a put is acknowledged once it is written to the put journal, a ring
    # file on tmpfs (cacheserver/store/journal/), and moved into LMDB behind the ack; a
    # crash replays what LMDB lacks. A host reboot clears tmpfs and so may lose what
    # was not yet in LMDB (at most journal_bytes; only cache entries, which replicas
    # recompute). journal_bytes = 0 acknowledges a put after its LMDB commit instead.
    journal_bytes: int = 2 * GiB
    # Where the journal lives: empty means /dev/shm when it is a writable tmpfs, else
    # no journal. A directory on a disk-backed file system works but gains nothing.
    journal_dir: str = ""
    # Journaled puts move into LMDB once requests pause this long (or at once when half
    # the journal is undrained, a delete waits, or the server stops), so the disk work
    # does not compete with serving for the CPU.
    drain_idle_ms: int = 100
    # With sync_writes, no journal: each LMDB commit is fsynced before the ack
    # (survives power loss; group commit shares the fsync). Without, a background
    # fsync every sync_interval_ms bounds what a power loss can take from LMDB.
    sync_writes: bool = False
    sync_interval_ms: int = 1000
    # Payload bytes that may wait for the disk writer; past it, puts are refused with
    # RESOURCE_EXHAUSTED instead of growing the server's memory without bound.
    max_pending_write_bytes: int = 1 * GiB
    # One tenant's share of the bytes still arriving (0: half): one tenant's held or
    # flooding puts cannot take the whole bound from the others (store/backlog.py).
    max_pending_write_bytes_per_tenant: int = 0

    def effective_map_bytes(self) -> int:
        if self.lmdb_map_bytes:
            return self.lmdb_map_bytes
        return self.disk_budget_bytes * 3 // 2 + 256 * MiB


@dataclass(frozen=True)
class LimitsConfig:
    # A 128k-token prompt is 512 digests at 256 tokens per block: one call takes it.
    max_digests_per_call: int = 8192
    # A 256-token block of a 70B model with 320 KiB of KV per token is 80 MiB.
    max_block_bytes: int = 128 * MiB
    # Largest gRPC message (one frame of chunks) either way.
    max_message_bytes: int = 16 * MiB
    # Get frames are filled to about this many payload bytes.
    get_frame_bytes: int = 4 * MiB
    # Per principal (override with requests_per_s on a [[principals]] entry); 0: unlimited.
    # A replica makes about three calls per inference request, and one server process
    # answers some thousands of small calls per second: this keeps one runaway
    # principal from taking all of it while never limiting a normal replica.
    requests_per_s: int = DEFAULT_REQUESTS_PER_S
    # A principal may burst to requests_per_s * request_burst_s calls.
    request_burst_s: int = DEFAULT_BURST_S

    def check_digest_count(self, count: int) -> None:
        if count > self.max_digests_per_call:
            raise InvalidArgument(
                f"{count} digests exceed max_digests_per_call {self.max_digests_per_call}; "
                "split the call or raise it in [limits]"
            )

    def check_block_bytes(self, index: int, size: int) -> None:
        if size > self.max_block_bytes:
            raise InvalidArgument(
                f"block {index} is {size} bytes, over max_block_bytes {self.max_block_bytes}; "
                "raise it in [limits] or use smaller blocks"
            )
        if size == 0:
            raise InvalidArgument(f"block {index} is empty; blocks carry at least one byte")


@dataclass(frozen=True)
class BulkConfig:
    """The bulk channel's listeners (cacheserver/transport/bulk/): TCP/TLS, and same-host."""

    # HOST:PORT of the TCP/TLS listener (DESIGN §8). "": the gRPC listen host at the
    # gRPC port + 1 (port 0 stays 0: a free port, as in tests). A fixed port is one a
    # firewall rule or a Kubernetes Service can name.
    listen: str = ""
    # HOST:PORT that OpenBulk announces. "": the bound address. Clients told a wildcard
    # host (0.0.0.0, [::]) dial the host they dialed for gRPC at the announced port;
    # behind NAT or a Service, name what replicas reach instead.
    advertise: str = ""
    # Offer clients on this host (and network namespace) a Unix socket on which
    # payloads move through a shared-memory arena, not TCP: one copy each way instead
    # of two, no TLS (the bytes never leave the host's kernel). Off: TCP/TLS only.
    same_host: bool = True
    # Each same-host connection's arena: the most payload bytes one request carries
    # (bigger requests are split; a bigger block goes over TCP). Pages are taken as
    # they are first used and kept while the connection lasts.
    arena_bytes: int = 64 * MiB
    # Same-host connections open at once (each holds up to arena_bytes of memory);
    # past it, clients use TCP.
    max_arenas: int = 32
    # Of which one principal may hold at most this many, so one replica (or one stolen
    # token) cannot push every other principal's same-host connections to TCP.
    max_arenas_per_principal: int = 8
    # A PUT's block must arrive, and a GET's reply must be taken, at least this fast
    # (after 2 s of slack), or the connection is closed. While a block arrives it holds
    # journal space, and while a reply is sent it keeps the journal from reusing space:
    # a peer that trickles or stops reading must not hold either for longer (32 MiB/s
    # lets a 128 MiB block take 6 s; far below what any replica's network gives).
    min_transfer_bytes_per_s: int = 32 * MiB


@dataclass(frozen=True)
class TlsFiles:
    cert_chain: Path
    private_key: Path
    client_ca: Path | None = None  # set: clients must present a certificate signed by it


@dataclass(frozen=True)
class TelemetryConfig:
    """What the server exports; by default nothing leaves the process but its logs."""

    # HOST:PORT of a Prometheus text endpoint (/metrics); "": off. Port 0 picks one.
    metrics_listen: str = ""
    # OTLP/HTTP collector base URL (e.g. http://127.0.0.1:4318) for metrics and traces;
    # "": off. Needs the `otlp` extra.
    otlp_endpoint: str = ""
    # Label tenant-level metrics with the tenant id. Off by default: tenant ids are
    # customer names to some operators, and a label per tenant multiplies the series.
    per_tenant_labels: bool = False
    log_format: str = "text"  # or "json": one object per line, with request ids
    # How often the health probe writes to the LMDB tier and checks free disk space.
    health_interval_ms: int = 500


@dataclass(frozen=True)
class ServerConfig:
    listen: str = DEFAULT_LISTEN
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    allow_insecure_listen: bool = False
    storage: StorageConfig = field(default_factory=StorageConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    access: AccessConfig | None = None  # None: dev mode (tenant `dev`, token in data dir)
    tls: TlsFiles | None = None  # None: plaintext (loopback, or allow_insecure_listen)
    audit_log: Path | None = None  # None: <data_dir>/audit.log
    # The naming secret. Keep it off the data dir's backups: with both, a holder can
    # compute the storage name of a guessed prefix and test whether it was cached.
    secret_file: Path | None = None  # None: <data_dir>/server.secret
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    bulk: BulkConfig = field(default_factory=BulkConfig)
    # The shared tier several servers use at once (cacheserver.tiers.cluster); None: none.
    redis_cluster: RedisClusterConfig | None = None

    @property
    def audit_log_path(self) -> Path:
        return self.audit_log if self.audit_log is not None else self.data_dir / AUDIT_FILE

    @property
    def secret_path(self) -> Path:
        return self.secret_file if self.secret_file is not None else self.data_dir / SECRET_FILE

    @property
    def is_dev_mode(self) -> bool:
        return self.access is None


def _positive_ints(
    raw: Mapping[str, Any], cls: type[Any], table: str, source: str, text: str
) -> Any:
    defaults = cls()
    values: dict[str, Any] = {}
    for key, value in raw.items():
        line = line_of(text, key)
        where = f"{source}:{line}" if line else source
        if not hasattr(defaults, key):
            allowed = ", ".join(sorted(defaults.__dataclass_fields__))
            raise ConfigError(f"{where}: {table}.{key}: unknown key; allowed: {allowed}")
        expected = type(getattr(defaults, key))
        if type(value) is not expected or (expected is int and value < 0):
            raise ConfigError(
                f"{where}: {table}.{key}: must be {expected.__name__}"
                + (" >= 0" if expected is int else "")
            )
        values[key] = value
    return replace(defaults, **values)


def _table(raw: Mapping[str, Any], key: str, source: str, text: str) -> Mapping[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{source}:{line_of(text, key)}: {key}: must be a table [{key}]")
    return value


def _parse_tls(raw: Mapping[str, Any], source: str, text: str) -> TlsFiles | None:
    """`[tls]` with `cert` and `key` (PEM files), and `client_ca` for mTLS."""
    if not raw:
        return None
    for key, value in raw.items():
        where = f"{source}:{line_of(text, key)}"
        if key not in TLS_KEYS:
            raise ConfigError(
                f"{where}: tls.{key}: unknown key; allowed: {', '.join(sorted(TLS_KEYS))}"
            )
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: tls.{key}: must be a path to a PEM file")
    if "cert" not in raw or "key" not in raw:
        raise ConfigError(f"{source}:{line_of(text, 'tls')}: tls: give both cert and key")
    client_ca = raw.get("client_ca")
    return TlsFiles(Path(raw["cert"]), Path(raw["key"]), Path(client_ca) if client_ca else None)


def _parse_telemetry(raw: Mapping[str, Any], source: str, text: str) -> TelemetryConfig:
    """`[telemetry]`: the keys of TelemetryConfig, each of its type."""
    defaults = TelemetryConfig()
    for key, value in raw.items():
        where = f"{source}:{line_of(text, key)}"
        if not hasattr(defaults, key):
            allowed = ", ".join(sorted(defaults.__dataclass_fields__))
            raise ConfigError(f"{where}: telemetry.{key}: unknown key; allowed: {allowed}")
        expected = type(getattr(defaults, key))
        if type(value) is not expected or (expected is int and value <= 0):
            raise ConfigError(
                f"{where}: telemetry.{key}: must be {expected.__name__}"
                + (" > 0" if expected is int else "")
            )
    config = replace(defaults, **raw)
    check_telemetry(config, f"{source}: telemetry")
    return config


def check_telemetry(config: TelemetryConfig, where: str) -> None:
    """Values a flag can also set: checked the same way for the file and the flags."""
    if config.log_format not in LOG_FORMATS:
        raise ConfigError(f"{where}: log_format {config.log_format!r}; use text or json")
    if config.metrics_listen and not config.metrics_listen.rpartition(":")[2].isdigit():
        raise ConfigError(f"{where}: metrics_listen {config.metrics_listen!r} is not [HOST:]PORT")
    if config.otlp_endpoint and not config.otlp_endpoint.startswith(("http://", "https://")):
        raise ConfigError(
            f"{where}: otlp_endpoint {config.otlp_endpoint!r}; give the collector's "
            "OTLP/HTTP base URL, e.g. http://127.0.0.1:4318"
        )


def load_config(path: Path) -> ServerConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read config {path}: {error.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    source = str(path)
    for key in raw:
        if key not in TOP_KEYS:
            raise ConfigError(
                f"{source}:{line_of(text, key)}: {key}: unknown key; "
                f"allowed: {', '.join(sorted(TOP_KEYS))}"
            )
    tenants = raw.get("tenants", [])
    principals = raw.get("principals", [])
    if not isinstance(tenants, list) or not isinstance(principals, list):
        raise ConfigError(
            f"{source}: tenants and principals must be arrays of tables "
            "([[tenants]], [[principals]])"
        )
    access = parse_access(tenants, principals, source=source, text=text)
    listen = raw.get("listen", DEFAULT_LISTEN)
    data_dir = raw.get("data_dir", DEFAULT_DATA_DIR)
    insecure = raw.get("allow_insecure_listen", False)
    audit_log = raw.get("audit_log")
    secret_file = raw.get("secret_file")
    if (
        not isinstance(listen, str)
        or not isinstance(data_dir, str)
        or not isinstance(insecure, bool)
        or not isinstance(audit_log, str | None)
        or not isinstance(secret_file, str | None)
    ):
        raise ConfigError(
            f"{source}: listen, data_dir, audit_log and secret_file must be strings, "
            "allow_insecure_listen a boolean"
        )
    return ServerConfig(
        listen=listen,
        data_dir=Path(data_dir),  # relative to the working directory, like --data-dir
        allow_insecure_listen=insecure,
        storage=_positive_ints(
            _table(raw, "storage", source, text), StorageConfig, "storage", source, text
        ),
        limits=_positive_ints(
            _table(raw, "limits", source, text), LimitsConfig, "limits", source, text
        ),
        access=access,
        tls=_parse_tls(_table(raw, "tls", source, text), source, text),
        audit_log=Path(audit_log) if audit_log else None,
        secret_file=Path(secret_file) if secret_file else None,
        telemetry=_parse_telemetry(_table(raw, "telemetry", source, text), source, text),
        bulk=_parse_bulk(_table(raw, "bulk", source, text), source, text),
        redis_cluster=parse_redis_cluster(
            _table(raw, "redis_cluster", source, text),
            source,
            lambda key: _line_in_table(text, "redis_cluster", key),
        ),
    )


def _parse_bulk(raw: Mapping[str, Any], source: str, text: str) -> BulkConfig:
    bulk: BulkConfig = _positive_ints(raw, BulkConfig, "bulk", source, text)
    if bulk.arena_bytes < 1 * MiB:
        raise ConfigError(
            f"{source}:{line_of(text, 'arena_bytes')}: bulk.arena_bytes: "
            "must be at least 1048576 (1 MiB)"
        )
    for key in ("listen", "advertise"):
        if key in raw:
            line = _line_in_table(text, "bulk", key)
            check_bulk_address(raw[key], key, f"{source}:{line}: bulk.{key}")
    return bulk


def _line_in_table(text: str, table: str, key: str) -> int:
    """1-based line of `key = ...` after the `[table]` header (`listen` is also a
    top-level key, so the first match in the file may be the wrong one)."""
    header = re.search(rf"^[ \t]*\[\s*{re.escape(table)}\s*\]", text, re.MULTILINE)
    start = header.end() if header else 0
    found = re.compile(rf"^[ \t]*{re.escape(key)}\s*=", re.MULTILINE).search(text, start)
    return text.count("\n", 0, found.start()) + 1 if found else 0
