"""Server configuration, parsed once at start-up into frozen dataclasses.

The TOML keys `listen`, `data_dir`, `[[tenants]]` and `[[principals]]` are a contract
(docs/design.md §8); `[storage]`, `[limits]`, `[tls]`, `[telemetry]`, `[bulk]` and
`audit_log` are optional with the defaults below; `[redis_cluster]` (docs/design.md §6)
is parsed by `cacheserver.tiers.cluster.config`; the specs of every key are in
`cacheserver.config.specs`.
Command-line flags override the file. Every key has one spec (its type and range,
`STORAGE_SPECS` and its neighbours below; `policy.config` for the access part and the
spec types), and the flags are checked by the specs of the keys they override: a bad
value, an unknown key or a misplaced table is one ConfigError naming the file, the line,
the key and what is allowed, so `kvshare serve` prints one line and exits 2.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cacheserver.config.specs import (
    AUTO_MAX_WORKERS,
    BULK_SPECS,
    DEFAULT_DATA_DIR,
    DEFAULT_LISTEN,
    LIMITS_SPECS,
    MAX_CONFIG_BYTES,
    STORAGE_SPECS,
    TELEMETRY_SPECS,
    TLS_SPECS,
    TOP_KEYS,
    TOP_SPECS,
)
from cacheserver.tiers.cluster.config import RedisClusterConfig, parse_redis_cluster
from kvcommon.errors import ConfigError, InvalidArgument
from policy.audit import AUDIT_FILE
from policy.config import (
    AccessConfig,
    parse_access,
)
from policy.config_text import (
    ConfigText,
    GiB,
    MiB,
    Spec,
)
from policy.naming import SECRET_FILE
from policy.ratelimit import DEFAULT_BURST_S, DEFAULT_REQUESTS_PER_S


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
    # does not compete with serving for the CPU. With [bulk] workers > 1 and this
    # default, also within 20 ms under load (the workers read blocks from LMDB only).
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

    # HOST:PORT of the TCP/TLS listener (docs/design.md §8). "": the gRPC listen host at the
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
    # Processes that serve bulk requests: the server and workers - 1 bulk workers
    # (cacheserver.worker), each with a GIL of its own. Plain-TCP connections are shared
    # among them in turn; a worker answers the reads it finds whole in LMDB and hands
    # everything else back (docs/architecture.md, "Bulk workers"). 1: the server alone.
    # 0 (the default): what suits the host, `processes()`.
    workers: int = 0

    def processes(self) -> int:
        """`workers`, or for 0: the server alone on a host of 1 or 2 cores (there a
        worker takes CPU from the server's puts and from anything else on the host;
        measured in docs/benchmarks.md), else half the cores, at most AUTO_MAX_WORKERS:
        the other half stays with the server's own threads (puts, gRPC, TLS
        connections, the writer) and the host."""
        if self.workers:
            return self.workers
        cores = len(os.sched_getaffinity(0))
        return 1 if cores <= 2 else min(cores // 2, AUTO_MAX_WORKERS)


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

    def __post_init__(self) -> None:
        # The file's check names its line (load_config); this one catches flags
        # (--disk-budget-bytes) and configs built in code.
        problem = public_quota_problem(self.access, self.storage)
        if problem is not None:
            raise ConfigError(f"[public] quota_bytes: {problem}")

    @property
    def audit_log_path(self) -> Path:
        return self.audit_log if self.audit_log is not None else self.data_dir / AUDIT_FILE

    @property
    def secret_path(self) -> Path:
        return self.secret_file if self.secret_file is not None else self.data_dir / SECRET_FILE

    @property
    def is_dev_mode(self) -> bool:
        return self.access is None


def public_quota_problem(access: AccessConfig | None, storage: StorageConfig) -> str | None:
    """Why the public scope's quota cannot be served with this storage, or None. A
    quota past the disk budget lets a publisher fill the whole store: every tenant's
    puts would then be refused or evict one another for the scope's sake."""
    public = access.public if access is not None else None
    if public is None or public.quota_bytes <= storage.disk_budget_bytes:
        return None
    return (
        f"{public.quota_bytes} bytes exceeds [storage] disk_budget_bytes "
        f"{storage.disk_budget_bytes}, so a publisher could fill the whole store; lower "
        "quota_bytes (to at most half of memory_budget_bytes, so that every published "
        "block stays in memory) or raise disk_budget_bytes"
    )


def _section(
    raw: Mapping[str, Any], cls: type[Any], specs: Mapping[str, Spec], table: str, cfg: ConfigText
) -> Any:
    return replace(cls(), **cfg.check_table(raw, specs, (table,)))


def _table(raw: Mapping[str, Any], key: str, cfg: ConfigText) -> Mapping[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise cfg.error((key,), f"must be a table: write [{key}] and its keys below it")
    return value


def _parse_tls(raw: Mapping[str, Any], cfg: ConfigText) -> TlsFiles | None:
    """`[tls]` with `cert` and `key` (PEM files), and `client_ca` for mTLS."""
    if not raw:
        return None
    values = cfg.check_table(raw, TLS_SPECS, ("tls",))
    if "cert" not in values or "key" not in values:
        raise cfg.error(("tls",), "give both cert and key")
    client_ca = values.get("client_ca")
    return TlsFiles(
        Path(values["cert"]), Path(values["key"]), Path(client_ca) if client_ca else None
    )


def read_config_text(path: Path) -> str:
    """The file as text: one ConfigError naming the file (and where) if it is not UTF-8."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)  # not all of /dev/zero
    except OSError as error:
        raise ConfigError(f"cannot read config {path}: {error.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path}: over {MAX_CONFIG_BYTES} bytes; is this the config? (thousands of "
            "tenants and principals take well under 1 MiB)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise ConfigError(
            f"{path}:{line}:{column}: not UTF-8 text (byte 0x{data[error.start]:02x}); "
            "save the config as UTF-8"
        ) from None


_TOML_POSITION = re.compile(r"\s*\(at (?:line (\d+), column (\d+)|end of document)\)$")


def parse_toml(path: Path, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        message = " ".join(str(error).split())
        position = _TOML_POSITION.search(message)
        where = str(path)
        if position and position[1]:
            where = f"{path}:{position[1]}:{position[2]}"
        elif position:  # the file ends inside a value: its last line
            where = f"{path}:{len(text.splitlines()) or 1}"
        reason = message[: position.start()] if position else message
        raise ConfigError(f"{where}: not valid TOML: {reason}; fix the syntax there") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise ConfigError(
            f"{path}: not valid TOML: arrays or tables nested too deeply; no kvshare key "
            "nests more than two levels"
        ) from None


def load_config(path: Path) -> ServerConfig:
    text = read_config_text(path)
    raw = parse_toml(path, text)
    cfg = ConfigText(str(path), text)
    for key in raw:
        if key not in TOP_KEYS:
            raise cfg.error((key,), f"unknown key; allowed: {', '.join(sorted(TOP_KEYS))}")
    for key in ("tenants", "principals"):
        if not isinstance(raw.get(key, []), list):
            raise cfg.error((key,), f"must be an array of tables: write [[{key}]], not [{key}]")
    access = parse_access(
        raw.get("tenants", []),
        raw.get("principals", []),
        source=str(path),
        text=text,
        public_raw=raw.get("public"),
    )
    top = cfg.check_table({k: v for k, v in raw.items() if k in TOP_SPECS}, TOP_SPECS, ())
    audit_log = top.get("audit_log")
    secret_file = top.get("secret_file")
    storage = _section(_table(raw, "storage", cfg), StorageConfig, STORAGE_SPECS, "storage", cfg)
    problem = public_quota_problem(access, storage)
    if problem is not None:
        raise cfg.error(("public", "quota_bytes"), problem)
    return ServerConfig(
        listen=top.get("listen", DEFAULT_LISTEN),
        # relative to the working directory, like --data-dir
        data_dir=Path(top.get("data_dir", DEFAULT_DATA_DIR)),
        allow_insecure_listen=top.get("allow_insecure_listen", False),
        storage=storage,
        limits=_section(_table(raw, "limits", cfg), LimitsConfig, LIMITS_SPECS, "limits", cfg),
        access=access,
        tls=_parse_tls(_table(raw, "tls", cfg), cfg),
        audit_log=Path(audit_log) if audit_log else None,
        secret_file=Path(secret_file) if secret_file else None,
        telemetry=_section(
            _table(raw, "telemetry", cfg), TelemetryConfig, TELEMETRY_SPECS, "telemetry", cfg
        ),
        bulk=_section(_table(raw, "bulk", cfg), BulkConfig, BULK_SPECS, "bulk", cfg),
        redis_cluster=parse_redis_cluster(_table(raw, "redis_cluster", cfg), cfg),
    )


# Every field of each table has its spec (and nothing else does).
SECTION_SPECS: dict[type[Any], dict[str, Spec]] = {
    StorageConfig: STORAGE_SPECS,
    LimitsConfig: LIMITS_SPECS,
    BulkConfig: BULK_SPECS,
    TelemetryConfig: TELEMETRY_SPECS,
}
