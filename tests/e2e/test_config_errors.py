"""Every configuration value is range-checked: a bad one is one line naming the file,
the line, the key and what is allowed, and `kvshare serve` exits 2, never a traceback.

Each case is a config (or flags) that once ended in a traceback, a server that started
broken (max_message_bytes past gRPC's int32; sync_interval_ms = 2**62 killed the fsync
thread after the start; min_transfer_bytes_per_s = 0 failed every bulk transfer) or a
silently accepted nonsense value (negative budgets, max_block_bytes = 0), or an error at
line 0. All cases run through the same path as `kvshare serve` in-process
(`cli._config_from`, fast); a handful also run as the real `kvshare serve --config`
subprocess, and a config at the upper bounds starts (the positive control).
"""

from __future__ import annotations

import argparse
import hashlib
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cacheserver import cli as serve_cli
from kvcommon.errors import ConfigError
from tests.support.servers import ServerProcess, run_cli

TOKEN_A = hashlib.sha256(b"a").hexdigest()
TOKEN_B = hashlib.sha256(b"b").hexdigest()
# Appended after each case's text: the access part every real config has.
ACCESS = f"""
[[tenants]]
id = "acme"

[[principals]]
name = "replica-a"
token_sha256 = "{TOKEN_A}"
tenants = ["acme"]
actions = ["read", "write"]
"""


@dataclass(frozen=True)
class Case:
    id: str
    text: str | bytes  # the config's first lines (ACCESS follows unless alone)
    key: str  # the key the error names ("" for syntax errors)
    says: str  # the allowed range, or what to change
    line: int | str = 0  # the line (or "line:column") the error names; 0: a flag's error
    flags: tuple[str, ...] = ()
    alone: bool = False  # the config is `text` only


def in_table(table: str, key: str, literal: str, says: str) -> Case:
    """`[table]` with `key = literal` (the TOML text of the value) on line 2."""
    text = f"[{table}]\n{key} = {literal}\n"
    return Case(f"{key}={literal[:24]}", text, f"{table}.{key}", says, 2)


def in_cluster(key: str, literal: str, says: str) -> Case:
    """`[redis_cluster]` with a valid seed node and `key = literal` on line 3."""
    text = f'[redis_cluster]\nnodes = ["h:7000"]\n{key} = {literal}\n'
    return Case(f"redis_cluster.{key}={literal[:24]}", text, f"redis_cluster.{key}", says, 3)


def in_tenant(key: str, literal: str, says: str) -> Case:
    """A `[[tenants]]` entry (tenants[0]) with `key = literal` on line 3."""
    text = f'[[tenants]]\nid = "b"\n{key} = {literal}\n'
    return Case(f"tenants.{key}={literal[:24]}", text, f"tenants[0].{key}", says, 3)


def at_top(key: str, literal: str, says: str) -> Case:
    return Case(f"{key}={literal[:24]}", f"{key} = {literal}\n", key, says, 1)


def flag(name: str, value: str, says: str, *more: str) -> Case:
    return Case(f"{name}={value}", "", name, says, flags=(name, value, *more))


DAY = "from 1 to 86400000 (1 day)"
TIB = "1099511627776 (1 TiB)"
BUDGET = "70368744177664 (64 TiB)"
CASES = [
    # -- the file itself ---------------------------------------------------------------
    Case("non-utf8", b'listen = "\xff"\n', "", "not UTF-8 text (byte 0xff); save", "1:11"),
    Case("latin1-comment", b"# caf\xe9\n", "", "save the config as UTF-8", "1:6"),
    Case("invalid-toml", "listen = \n", "", "not valid TOML: Invalid value", "1:10"),
    Case("duplicate-key", 'listen = "a:1"\nlisten = "b:1"\n', "", "Cannot overwrite", 2),
    Case("unclosed-array", "listen = [1,\n", "", "not valid TOML", 1, alone=True),
    Case("nested-too-deep", "x = " + "[" * 3000 + "]" * 3000, "", "nested too deeply", 0),
    # -- misplaced tables and unknown keys: the real line, never 0 ---------------------
    Case("misspelt-table", "\n[telemetri]\nlog_format = 'json'\n", "telemetri", "allowed:", 2),
    Case("table-in-table", "[storage.limits]\nx = 5\n", "storage.limits", "unknown key", 1),
    Case("array-for-table", "[[storage]]\nsync_writes = true\n", "storage", "write [storage]", 1),
    in_table("limits", "sync_interval_ms", "5", "unknown key; allowed: get_frame_bytes"),
    Case("table-as-value", "storage = 5\n", "storage", "must be a table", 1),
    Case("one-tenants-table", "[tenants]\nid = 'a'\n", "tenants", "not [tenants]", 1, alone=True),
    Case("tenant-not-table", "tenants = [1]\n", "tenants[0]", "must be a table", 1, alone=True),
    in_tenant("quota", "5", "unknown key; allowed: epoch"),
    # -- ports ---------------------------------------------------------------------------
    at_top("listen", '"127.0.0.1:99999"', "port from 0 to 65535"),
    at_top("listen", '"127.0.0.1:-1"', "port from 0 to 65535"),
    at_top("listen", '"localhost"', "is not HOST:PORT"),
    at_top("listen", "50051", "must be str"),
    in_table("bulk", "listen", '"0.0.0.0:70000"', "port from 0 to 65535"),
    in_table("bulk", "advertise", '"store:0"', "port from 1 to 65535"),
    in_table("telemetry", "metrics_listen", '"99999"', "port from 0 to 65535"),
    in_table("redis_cluster", "nodes", '["10.0.0.7:0"]', "a node's real address and port"),
    in_table("redis_cluster", "nodes", '["10.0.0.7:65536"]', "from 0 to 65535"),
    # -- [limits] ------------------------------------------------------------------------
    in_table("limits", "max_message_bytes", str(2**62), "to 2146435071 (2047 MiB - 1)"),
    in_table("limits", "max_message_bytes", "0", "from 1048576 (1 MiB) to 2146435071"),
    in_table("limits", "max_block_bytes", "0", "from 1 to 4294967295 (4 GiB - 1)"),
    Case(  # TOML breaks lines at \n only: U+2028 in a value does not shift the count
        "line-after-u2028",
        'audit_log = "/tmp/a\u2028b"\n[limits]\nmax_block_bytes = 0\n',
        "limits.max_block_bytes",
        "from 1 to 4294967295",
        3,
    ),
    in_table("limits", "max_block_bytes", "-1", "from 1 to 4294967295 (4 GiB - 1)"),
    in_table("limits", "max_block_bytes", "1.5", "must be int, not 1.5; use an integer"),
    in_table("limits", "max_block_bytes", '"128MiB"', "must be int, not '128MiB'"),
    in_table("limits", "max_block_bytes", "true", "must be int, not True"),
    in_table("limits", "max_digests_per_call", "0", "from 1 to 1000000"),
    in_table("limits", "get_frame_bytes", str(2**40), "from 1 to 2146435071"),
    in_table("limits", "requests_per_s", "-5", "from 1 to 1000000, or 0 (unlimited)"),
    in_table("limits", "request_burst_s", "0", "from 1 to 3600"),
    # -- [storage] -----------------------------------------------------------------------
    in_table("storage", "sync_interval_ms", str(2**62), f"{DAY}, or 0 (no periodic fsync)"),
    in_table("storage", "sync_interval_ms", "-1", f"{DAY}, or 0 (no periodic fsync)"),
    in_table("storage", "memory_budget_bytes", "-1", f"from 0 to {BUDGET}"),
    in_table("storage", "disk_budget_bytes", "0", f"from 1 to {BUDGET}"),
    in_table("storage", "disk_budget_bytes", str(2**62), f"from 1 to {BUDGET}"),
    in_table("storage", "lmdb_map_bytes", "4096", "or 0 (derived from disk_budget_bytes)"),
    in_table("storage", "journal_bytes", "4096", f"from 16777216 (16 MiB) to {TIB}, or 0"),
    in_table("storage", "drain_idle_ms", str(2**40), "from 0 to 86400000 (1 day)"),
    in_table("storage", "max_pending_write_bytes", "0", f"from 1 to {TIB}"),
    in_table("storage", "max_pending_write_bytes_per_tenant", "-1", "or 0 (half of"),
    in_table("storage", "journal_dir", "5", "must be a path"),
    in_table("storage", "sync_writes", '"yes"', "must be bool (true or false)"),
    # -- [bulk] --------------------------------------------------------------------------
    in_table("bulk", "min_transfer_bytes_per_s", "0", f"from 1024 (1 KiB) to {TIB}"),
    in_table("bulk", "arena_bytes", "4096", "from 1048576 (1 MiB) to 4294967296 (4 GiB)"),
    in_table("bulk", "arena_bytes", str(2**40), "from 1048576 (1 MiB) to 4294967296 (4 GiB)"),
    in_table("bulk", "max_arenas", "-1", "from 1 to 4096, or 0 (no same-host arenas"),
    in_table("bulk", "same_host", "1", "must be bool"),
    # -- [tls] ---------------------------------------------------------------------------
    Case("tls-cert-empty", '[tls]\ncert = ""\nkey = "k"\n', "tls.cert", "not a usable path", 2),
    Case("tls-key-int", '[tls]\ncert = "c"\nkey = 3\n', "tls.key", "must be a path", 3),
    Case("tls-cert-only", '[tls]\ncert = "c.pem"\n', "tls", "give both cert and key", 1),
    in_table("tls", "ca", '"ca.pem"', "unknown key; allowed: cert, client_ca, key"),
    # -- [telemetry] ---------------------------------------------------------------------
    in_table("telemetry", "health_interval_ms", "0", DAY),
    in_table("telemetry", "health_interval_ms", str(2**62), DAY),
    in_table("telemetry", "log_format", '"xml"', "log_format 'xml'; use text or json"),
    in_table("telemetry", "otlp_endpoint", '"collector:4318"', "OTLP/HTTP base URL"),
    # -- top-level values ----------------------------------------------------------------
    at_top("data_dir", '""', "give a path of 1 to 4096 bytes without NUL"),
    at_top("data_dir", '"a\\u0000b"', "without NUL"),
    at_top("audit_log", "7", "must be a path"),
    at_top("secret_file", '"' + "s" * 5000 + '"', "a path of 1 to 4096 bytes"),
    at_top("allow_insecure_listen", '"yes"', "must be bool"),
    # -- [[tenants]] and [[principals]] --------------------------------------------------
    in_tenant("quota_bytes", "-1", f"to {BUDGET}, or 0 (bounded only by the global budget)"),
    in_tenant("quota_bytes", str(2**62), f"from 1 to {BUDGET}"),
    in_tenant("epoch", str(2**32), "from 0 to 4294967295"),
    in_tenant("epoch", "-1", "from 0 to 4294967295"),
    Case(
        "principal-rate-2^62",
        f'[[principals]]\nname = "p"\ntoken_sha256 = "{TOKEN_B}"\nrequests_per_s = {2**62}\n',
        "principals[0].requests_per_s",
        "from 1 to 1000000, or 0 (unlimited)",
        4,
    ),
    Case(
        "principal-name-newline",
        f'[[principals]]\nname = "p\\nq"\ntoken_sha256 = "{TOKEN_B}"\n',
        "principals[0].name",
        "1 to 256 printable characters",
        2,
    ),
    # -- [redis_cluster] -----------------------------------------------------------------
    in_cluster("timeout_ms", "0", "from 1 to 3600000 (1 hour)"),
    in_cluster("timeout_ms", str(2**62), "from 1 to 3600000 (1 hour)"),
    in_cluster("retry_after_ms", "-1", "from 0 to 86400000 (1 day)"),
    in_cluster("write_queue_bytes", "0", f"from 1 to {TIB}"),
    in_cluster("delete_stream_entries", "0", "from 1 to 100000000"),
    in_cluster("username", '"a\\nb"', "printable characters"),
    in_cluster("password_file", "5", "must be a path"),
    in_cluster("key_prefix", '"{kv}"', "no braces"),
    # -- command-line flags: the same specs ------------------------------------------------
    flag("--listen", "127.0.0.1:99999", "port from 0 to 65535"),
    flag("--memory-budget-bytes", "-1", f"from 0 to {BUDGET}"),
    flag("--disk-budget-bytes", "0", f"from 1 to {BUDGET}"),
    flag("--memory-budget-bytes", "1GiB", "must be int, not '1GiB'"),
    flag("--metrics-listen", "70000", "port from 0 to 65535"),
    flag("--bulk-advertise", "h:0", "port from 1 to 65535"),
    flag("--data-dir", "", "a path of 1 to 4096 bytes"),
    flag("--tls-cert", "", "a path of 1 to 4096 bytes", "--tls-key", "k.pem"),
]

# Through the real `kvshare serve --config` process as well: the cases that ended in a
# traceback or a broken server, and one of each other kind.
SUBPROCESS = [
    "non-utf8",
    f"max_message_bytes={2**62}",
    f"sync_interval_ms={2**62}",
    "min_transfer_bytes_per_s=0",
    'listen="127.0.0.1:99999"',
    "misspelt-table",
    "nested-too-deep",
    "--memory-budget-bytes=1GiB",
]


def write_case(tmp_path: Path, case: Case) -> Path:
    path = tmp_path / "kvshare.toml"
    text = case.text if isinstance(case.text, bytes) else case.text.encode()
    path.write_bytes(text if case.alone else text + ACCESS.encode())
    return path


def serve_args(tmp_path: Path, case: Case) -> list[str]:
    """The case's flags; a data dir and port of the test's own, so that a config that
    were wrongly accepted would start a server there, not in the repository."""
    args = ["--config", str(write_case(tmp_path, case))]
    if "--data-dir" not in case.flags:
        args += ["--data-dir", str(tmp_path / "data")]
    return args + list(case.flags)


def check_line(line: str, case: Case, path: Path) -> None:
    """The one line names the file and line (or the flag), the key and what is allowed."""
    assert "Traceback" not in line and "\n" not in line
    if case.flags:
        assert line.startswith(f"kvshare serve: error: {case.key}: "), line
    elif case.line:
        assert line.startswith(f"kvshare serve: error: {path}:{case.line}:"), line
    else:
        assert line.startswith(f"kvshare serve: error: {path}: "), line
    if case.key and not case.flags:
        assert f": {case.key}: " in line, line
    assert case.says in line, line


def test_the_table_is_large_and_its_ids_unique() -> None:
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
    assert set(SUBPROCESS) <= {c.id for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_value_is_one_line_naming_file_line_key_and_range(tmp_path: Path, case: Case) -> None:
    """In-process, through what `kvshare serve` runs before it serves (flags, then file)."""
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(serve_args(tmp_path, case))
    with pytest.raises(ConfigError) as raised:
        serve_cli._config_from(args)
    check_line(f"kvshare serve: error: {raised.value}", case, tmp_path / "kvshare.toml")


@pytest.mark.parametrize("case_id", SUBPROCESS)
def test_kvshare_serve_refuses_in_one_line_without_a_traceback(
    tmp_path: Path, case_id: str
) -> None:
    case = next(c for c in CASES if c.id == case_id)
    result = run_cli("serve", *serve_args(tmp_path, case))
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    check_line(lines[0], case, tmp_path / "kvshare.toml")
    assert not (tmp_path / "data").exists()  # refused before anything was created


def test_a_config_at_the_upper_bounds_starts(tmp_path: Path) -> None:
    """The positive control: the largest allowed values (those a test machine can hold)
    start the server, and the periodic fsync thread lives with a day's interval."""
    path = tmp_path / "kvshare.toml"
    path.write_text(
        f'listen = "127.0.0.1:0"\ndata_dir = "{tmp_path / "data"}"\n'
        "[storage]\nsync_interval_ms = 86400000\ndrain_idle_ms = 86400000\n"
        "journal_bytes = 16777216\n"
        "[limits]\nmax_message_bytes = 2146435071\nget_frame_bytes = 2146435071\n"
        "max_block_bytes = 4294967295\nmax_digests_per_call = 1000000\n"
        "requests_per_s = 1000000\nrequest_burst_s = 3600\n"
        "[telemetry]\nhealth_interval_ms = 86400000\n"
        "[bulk]\nmin_transfer_bytes_per_s = 1099511627776\nmax_arenas = 4096\n" + ACCESS
    )
    server = ServerProcess("--config", str(path))
    time.sleep(1)  # a thread given a wait it cannot take dies at once, with a traceback
    server.proc.send_signal(signal.SIGTERM)
    out, err = server.proc.communicate(timeout=60)
    assert server.proc.returncode == 0 and "stopped cleanly" in out
    assert "Traceback" not in err and "Exception in thread" not in err, err
