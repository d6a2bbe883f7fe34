"""`kvshare serve`: flags, config loading, and one-line start-up errors."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import replace
from pathlib import Path

from cacheserver.config import ServerConfig, load_config
from cacheserver.config.specs import FLAG_SPECS, check_flag
from kvcommon.errors import ConfigError
from kvcommon.memtune import tune_allocator

# A connection thread back from a receive waits for the GIL until its holder blocks or
# this interval passes (5 ms by default): with several connections busy, that wait was
# the tail of put and get latency. The server's Python work per call is short.
SWITCH_INTERVAL_S = 0.0005


def _int_or_text(text: str) -> int | str:
    """An integer flag's value; anything else is kept for its spec to refuse in one
    line that says what is allowed (argparse's own refusal prints the usage too)."""
    try:
        return int(text)
    except ValueError:
        return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML server config (tenants, principals, storage, limits, tls, audit_log). "
        "Without it: dev mode, one tenant 'dev' whose token is written "
        "to <data-dir>/dev.token",
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="address to serve on (default 127.0.0.1:50051; port 0 picks a "
        "free port, printed in the 'serving on' line)",
    )
    parser.add_argument(
        "--bulk-listen",
        metavar="HOST:PORT",
        help="the bulk channel's TCP/TLS listener (overrides [bulk] listen; default: the "
        "--listen host at its port + 1; port 0 picks a free port)",
    )
    parser.add_argument(
        "--bulk-advertise",
        metavar="HOST:PORT",
        help="the bulk address OpenBulk announces to clients (overrides [bulk] advertise; "
        "default: the bound one; a wildcard host means the host clients dialed for gRPC)",
    )
    parser.add_argument(
        "--bulk-workers",
        metavar="N",
        type=int,
        help="processes serving bulk requests (overrides [bulk] workers; N > 1 adds N - 1 "
        "worker processes for plain-TCP reads; default: 1 on hosts of 1-2 cores, else half "
        "the cores, at most 8)",
    )
    parser.add_argument(
        "--data-dir",
        type=str,  # a Path would read "" as "."; checked, then made a Path
        metavar="DIR",
        help="where blocks, the server secret and the dev token live (default ./kvshare-data)",
    )
    parser.add_argument(
        "--memory-budget-bytes",
        type=_int_or_text,
        metavar="N",
        help="byte budget of the in-memory tier (default 1 GiB)",
    )
    parser.add_argument(
        "--disk-budget-bytes",
        type=_int_or_text,
        metavar="N",
        help="byte budget of the LMDB tier (default 8 GiB)",
    )
    parser.add_argument(
        "--no-sync-writes",
        action="store_true",
        help="never fsync, not even periodically (benchmarks; a power loss may lose "
        "recent blocks, a process crash loses nothing acknowledged)",
    )
    parser.add_argument(
        "--sync-writes",
        action="store_true",
        help="fsync every commit before acknowledging a put (survives power loss; "
        "default: commits reach the OS at once and are fsynced every second)",
    )
    parser.add_argument(
        "--tls-cert",
        type=str,  # a Path would read "" as "."; checked, then made a Path
        metavar="PEM",
        help="server certificate chain; with --tls-key enables TLS (overrides [tls])",
    )
    parser.add_argument("--tls-key", type=str, metavar="PEM", help="server private key")
    parser.add_argument(
        "--tls-client-ca",
        type=str,  # a Path would read "" as "."; checked, then made a Path
        metavar="PEM",
        help="CA bundle for client certificates; set: mTLS is required",
    )
    parser.add_argument(
        "--allow-insecure-listen",
        action="store_true",
        help="allow a non-loopback --listen without TLS (trusted networks only)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="text lines, or one JSON object per line with request ids (overrides "
        "[telemetry] log_format; default text)",
    )
    parser.add_argument(
        "--metrics-listen",
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics (kvshare_*) at http://HOST:PORT/metrics; a bare PORT "
        "is loopback (the endpoint has no authentication); port 0 picks one, printed as "
        "'metrics on HOST:PORT' (overrides [telemetry] metrics_listen)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="export metrics and traces over OTLP/HTTP to this collector, e.g. "
        "http://127.0.0.1:4318 (needs the otlp extra; overrides [telemetry] otlp_endpoint)",
    )


def _config_from(args: argparse.Namespace) -> ServerConfig:
    # Each flag is checked by the spec of the key it overrides, before the file is read:
    # a bad flag is named as the flag, whatever the file says.
    for flag in FLAG_SPECS:
        check_flag(flag, getattr(args, flag[2:].replace("-", "_")))
    config = load_config(args.config) if args.config else ServerConfig()
    return _with_flags(config, args)


def _with_flags(config: ServerConfig, args: argparse.Namespace) -> ServerConfig:
    """`config` with the command line laid over it (at start-up, and at each reload)."""
    storage = config.storage
    if args.memory_budget_bytes is not None:
        storage = replace(storage, memory_budget_bytes=args.memory_budget_bytes)
    if args.disk_budget_bytes is not None:
        storage = replace(storage, disk_budget_bytes=args.disk_budget_bytes)
    if args.no_sync_writes:
        storage = replace(storage, sync_writes=False, sync_interval_ms=0)
    if args.sync_writes:
        storage = replace(storage, sync_writes=True)
    telemetry = replace(
        config.telemetry,
        metrics_listen=args.metrics_listen or config.telemetry.metrics_listen,
        otlp_endpoint=args.otlp_endpoint or config.telemetry.otlp_endpoint,
        log_format=args.log_format or config.telemetry.log_format,
    )
    bulk = replace(
        config.bulk,
        listen=args.bulk_listen or config.bulk.listen,
        advertise=args.bulk_advertise or config.bulk.advertise,
        workers=args.bulk_workers or config.bulk.workers,
    )
    return replace(
        config,
        listen=args.listen or config.listen,
        data_dir=Path(args.data_dir) if args.data_dir else config.data_dir,
        allow_insecure_listen=args.allow_insecure_listen or config.allow_insecure_listen,
        storage=storage,
        telemetry=telemetry,
        bulk=bulk,
    )


def run(args: argparse.Namespace) -> int:
    tune_allocator()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Everything the server writes is its own: data, journal, audit log, secret, token.
    # Each file is also created with an explicit owner-only mode; the umask covers any
    # file a library makes on the server's behalf.
    os.umask(0o077)
    from cacheserver.reload import ConfigSource
    from cacheserver.server import TlsFiles, serve
    from kvcommon.logs import configure_logging
    from kvcommon.tracing import current_trace_ids

    try:
        config = _config_from(args)
        configure_logging(args.log_level, config.telemetry.log_format, current_trace_ids)
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ConfigError("give both --tls-cert and --tls-key, or neither")
        if args.tls_client_ca and not args.tls_cert:
            raise ConfigError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        tls = (
            TlsFiles(
                Path(args.tls_cert),
                Path(args.tls_key),
                Path(args.tls_client_ca) if args.tls_client_ca else None,
            )
            if args.tls_cert
            else None
        )
        source = None
        if args.config:
            source = ConfigSource(args.config, lambda loaded: _with_flags(loaded, args), tls)
        asyncio.run(serve(config, tls, source))
    except ConfigError as error:
        print(f"kvshare serve: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run: kvshare serve")
