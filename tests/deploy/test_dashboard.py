"""The Grafana dashboard and the Prometheus alert rules (deploy/grafana) query only what
the server exports.

A real `kvshare serve`, over a real 3-node Redis Cluster and with per-tenant labels, is
put through a workload that makes every family of metrics appear (gRPC and bulk calls,
evictions, a quota refusal, a refused token, a block that fails its checksum after a
restart); its /metrics is scraped. Every PromQL expression of the dashboard (panels and
template variables) and of the rules is read by a small tokenizer into the metric names
it selects and the labels its matchers name; the check fails on any name the scrapes
never showed, and on a matcher's label the metric does not carry. Histograms are read
as their samples (`_bucket`, `_sum`, `_count`), counters as `_total`: the names PromQL
selects. Positive controls: a bogus metric name, and a bogus label, make the check fail.
With Debian's `promtool`, the expressions are also parsed by Prometheus itself.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]
from prometheus_client.parser import text_string_to_metric_families

from kvcommon.errors import KvshareError, ResourceExhausted
from kvshare.bench.redis_cluster import LocalRedisCluster, unavailable_reason
from replica_agent.client import BlockClient
from tests.support.datafiles import flip_stored_byte
from tests.support.repo import REPO
from tests.support.scrape import scrape_text
from tests.support.servers import ServerProcess

GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "kvshare-dashboard.json"
RULES = GRAFANA / "kvshare-alerts.yaml"
# Series Prometheus itself makes for every scrape target (the alert for a server that
# cannot be scraped), and the labels it adds to every series it scrapes.
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"job", "instance"}
MODEL = "deploy/model@r1;fp32;L2;H2;D8;B4;tp0/1"
KiB = 1024
METRICS_RE = re.compile(r"metrics on (\S+)")

# -- a small PromQL tokenizer ----------------------------------------------------------

_TOKENS = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<number>(?:0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?:ms|[smhdwy])*)
  | (?P<variable>\$\{[^}]*\}|\$\w+)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<matcher>=~|!~|!=|==|<=|>=|=)
  | (?P<space>\s+)
  | (?P<other>.)
    """,
    re.VERBOSE,
)
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
# Aggregations may put `by (...)` before their parenthesis: `sum by (le) (rate(x[5m]))`.
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count"}
AGGREGATIONS |= {"count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}


@dataclass(frozen=True)
class Token:
    kind: str
    text: str


def tokens(expr: str) -> list[Token]:
    out = []
    for match in _TOKENS.finditer(expr):
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            out.append(Token(kind, match.group()))
    return out


@dataclass(frozen=True)
class Selected:
    metric: str
    labels: frozenset[str]  # the label names its matchers name


def selections(expr: str) -> list[Selected]:
    """Each metric an expression selects, with the labels of its `{...}` matchers.
    Function and aggregation names (an identifier before `(`), keywords, the labels of
    `by (...)`/`on (...)` and of matchers, strings, numbers, durations and Grafana
    variables are not metrics."""
    found: list[Selected] = []
    items = tokens(expr)
    i = 0
    while i < len(items):
        token = items[i]
        following = items[i + 1] if i + 1 < len(items) else None
        if token.kind == "ident" and token.text.lower() in GROUPING:
            if following is not None and following.text == "(":
                i = _after_closing(items, i + 1, "(", ")")
                continue
        elif token.kind == "ident" and token.text.lower() in KEYWORDS | AGGREGATIONS:
            pass
        elif token.kind == "ident" and following is not None and following.text == "(":
            pass  # a function or an aggregation
        elif token.kind == "ident":
            labels: set[str] = set()
            if following is not None and following.text == "{":
                end = _after_closing(items, i + 1, "{", "}")
                inside = items[i + 2 : end - 1]
                labels = {
                    a.text
                    for a, b in itertools.pairwise(inside)
                    if a.kind == "ident" and b.kind == "matcher"
                }
                i = end - 1
            found.append(Selected(token.text, frozenset(labels)))
        elif token.text == "{":
            raise ValueError(f"a selector without a metric name in {expr!r}: name the metric")
        i += 1
    return found


def _after_closing(items: list[Token], start: int, opening: str, closing: str) -> int:
    """The index after the bracket that closes the one at `start`."""
    depth = 0
    for index in range(start, len(items)):
        depth += {opening: 1, closing: -1}.get(items[index].text, 0)
        if depth == 0:
            return index + 1
    raise ValueError(f"unbalanced {opening}{closing}")


_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<selector>.*),\s*)?(?P<label>\w+)\s*\)\s*$")


def dashboard_queries(dashboard: dict[str, object]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable. A variable's
    `label_values(SELECTOR, LABEL)` is Grafana's, not PromQL: its selector is checked,
    with LABEL as one of the labels the selector must carry."""

    def panels(items: object) -> Iterator[dict[str, object]]:
        for panel in items if isinstance(items, list) else []:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):  # type: ignore[attr-defined]
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in dashboard["templating"]["list"]:  # type: ignore[index]
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(text)
        assert match and match["selector"], f"variable {variable['name']}: {text}"
        selector = match["selector"]
        # The label the variable lists must be on the metric: a matcher on it checks that.
        with_label = (
            selector[:-1] + f', {match["label"]}=~".*"}}'
            if selector.endswith("}")
            else selector + f'{{{match["label"]}=~".*"}}'
        )
        yield f"variable {variable['name']!r}", with_label


def rule_queries(rules: dict[str, object]) -> Iterator[tuple[str, str]]:
    for group in rules["groups"]:  # type: ignore[attr-defined]
        for rule in group["rules"]:
            yield f"rule {rule.get('alert') or rule.get('record')!r}", rule["expr"]


def problems(queries: list[tuple[str, str]], exported: dict[str, set[str]]) -> list[str]:
    """What the queries select that the server does not export."""
    found = []
    for where, expr in queries:
        for selected in selections(expr):
            if selected.metric in PROMETHEUS_SERIES:
                continue
            if selected.metric not in exported:
                found.append(f"{where}: {selected.metric} is not exported")
                continue
            missing = selected.labels - exported[selected.metric] - TARGET_LABELS
            if missing:
                found.append(f"{where}: {selected.metric} has no label {sorted(missing)}")
    return found


def all_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    rules = yaml.safe_load(RULES.read_text())
    return [*dashboard_queries(dashboard), *rule_queries(rules)]


# -- the tokenizer on its own -----------------------------------------------------------


def test_the_tokenizer_finds_metrics_and_only_metrics() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, method) (rate(a_bucket{job=~"$job", '
        'method!="x"}[$__rate_interval]))) / on (instance) group_left (tier) '
        "sum without (status) (b_total offset 5m) > bool 1e3 or vector(0) unless "
        'label_replace(c_sum{le="0.5"}, "d_total", "$1", "method", "e_total(.*)") '
        "and f:recorded[1h:5m]"
    )
    assert selections(expr) == [
        Selected("a_bucket", frozenset({"job", "method"})),
        Selected("b_total", frozenset()),
        Selected("c_sum", frozenset({"le"})),
        Selected("f:recorded", frozenset()),
    ]
    with pytest.raises(ValueError, match="name the metric"):
        selections('{__name__=~"kvshare_.*"}')


def test_the_check_fails_on_a_bogus_metric_or_label() -> None:
    """Positive control: a query naming what the server does not export is reported."""
    exported = {"kvshare_health_serving": set(), "kvshare_tier_bytes": {"tier"}}
    good = [("ok", 'sum by (tier) (kvshare_tier_bytes{tier="lmdb", job="kvshare"})')]
    assert problems(good, exported) == []
    bogus = [
        ("metric", "rate(kvshare_bogus_total[5m])"),
        ("label", 'kvshare_tier_bytes{tenant="acme"}'),
        ("prometheus", "up == 0 and kvshare_health_serving == 0"),
    ]
    assert problems(bogus, exported) == [
        "metric: kvshare_bogus_total is not exported",
        "label: kvshare_tier_bytes has no label ['tenant']",
    ]
    # and in the shipped files' own walk: a bogus panel is found
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"].append({"title": "bogus", "targets": [{"expr": "kvshare_nope"}]})
    queries = list(dashboard_queries(dashboard))
    assert ("panel 'bogus'", "kvshare_nope") in queries
    assert "panel 'bogus': kvshare_nope is not exported" in problems(queries, exported)


def test_the_dashboard_and_rules_cover_what_operators_watch() -> None:
    """Every topic the dashboard is for has a query (the names the real-server test
    below checks against the scrape)."""
    named = {s.metric for _, expr in all_queries() for s in selections(expr)}
    for metric in (
        "kvshare_lookup_blocks_total",  # per-tenant hit rate
        "kvshare_served_bytes_total",  # bytes
        "kvshare_tenant_quota_bytes",  # quota use
        "kvshare_rpc_duration_seconds_bucket",  # latency by transport
        "kvshare_rpc_requests_total",  # bulk vs gRPC, errors
        "kvshare_integrity_failures_total",
        "kvshare_evictions_total",
        "kvshare_cluster_events_total",  # the cluster's write queue
        "kvshare_health_serving",
        "kvshare_cluster_reachable",
        "kvshare_journal_undrained_bytes",  # the journal and writer backlog
        "kvshare_journal_capacity_bytes",
        "kvshare_writer_backlog_bytes",
        "kvshare_writer_backlog_blocks",
        "kvshare_writer_backlog_limit_bytes",
        "kvshare_tenant_backlog_bytes",
        "kvshare_build_info",
    ):
        assert metric in named, metric
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}
            assert rule["annotations"]["summary"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian: prometheus)")
def test_prometheus_parses_every_expression(tmp_path: Path) -> None:
    """promtool checks the rules file as Prometheus loads it, and the dashboard's
    queries as recording rules (Grafana's variables replaced by values)."""
    checked = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    dashboard = json.loads(DASHBOARD.read_text())
    values = {"$__rate_interval": "5m", "$job": "kvshare", "$instance": ".*", "$tenant": ".*"}
    records = []
    for index, (_, expr) in enumerate(dashboard_queries(dashboard)):
        for variable, value in values.items():
            expr = expr.replace(variable, value)
        records.append({"record": f"dashboard:query_{index}", "expr": expr})
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    checked = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "x:y", "expr": "sum by (le (rate(kvshare_rpc_requests_total[5m]))"}
    ]}]}))  # fmt: skip
    assert subprocess.run(["promtool", "check", "rules", str(broken)],
                          capture_output=True, timeout=60).returncode != 0  # fmt: skip


# -- against a real server -------------------------------------------------------------


def exported_by(text: str, into: dict[str, set[str]]) -> None:
    """Sample names (what PromQL selects) -> the label names seen on them."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            into.setdefault(sample.name, set()).update(sample.labels)


def write_server_config(tmp_path: Path, seeds: list[str]) -> tuple[Path, dict[str, str]]:
    secret = tmp_path / "server.secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    tokens = {name: secrets.token_urlsafe(24) for name in ("a", "b")}
    nodes = ", ".join(f'"{seed}"' for seed in seeds)
    lines = [
        'listen = "127.0.0.1:0"',
        f'data_dir = "{tmp_path / "data"}"',
        f'secret_file = "{secret}"',
        "[storage]",
        f"memory_budget_bytes = {32 * KiB}",
        f"disk_budget_bytes = {64 * KiB}",
        "[telemetry]",
        'metrics_listen = "127.0.0.1:0"',
        "per_tenant_labels = true",
        "[redis_cluster]",
        f"nodes = [{nodes}]",
        "[[tenants]]",
        'id = "alpha"',
        "quota_bytes = 0",
        "[[tenants]]",
        'id = "beta"',
        f"quota_bytes = {8 * KiB}",
    ]
    for name, tenant in (("a", "alpha"), ("b", "beta")):
        digest = hashlib.sha256(tokens[name].encode()).hexdigest()
        lines += ["[[principals]]", f'name = "{name}"', f'token_sha256 = "{digest}"']
        lines += [f'tenants = ["{tenant}"]', 'actions = ["read", "write"]']
    path = tmp_path / "kvshare.toml"
    path.write_text("\n".join(lines) + "\n")
    return path, tokens


def start(config: Path) -> tuple[ServerProcess, str]:
    server = ServerProcess("--config", str(config))
    found = [m.group(1) for line in server.startup_lines if (m := METRICS_RE.search(line))]
    assert found, server.startup_lines
    return server, found[0]


def scrape_until(metrics: str, wanted: set[str], timeout_s: float = 15) -> str:
    """A scrape in which every name of `wanted` has samples (some are counted just
    after a call returns, or behind it: the cluster's writes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape_text(metrics)
        seen: dict[str, set[str]] = {}
        exported_by(text, seen)
        if wanted <= set(seen) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


@pytest.mark.slow
def test_every_query_names_a_metric_a_real_server_exports(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.fail(f"this test needs Redis: {reason}")  # CI installs it (.ci/run)
    exported: dict[str, set[str]] = {}
    digests = [os.urandom(32) for _ in range(12)]
    payloads = [os.urandom(8 * KiB) for _ in digests]  # 96 KiB: past both budgets
    with LocalRedisCluster(tmp_path / "redis") as cluster:
        config, tokens = write_server_config(tmp_path, cluster.seeds)
        server, metrics = start(config)
        try:
            with BlockClient(server.address, tokens["a"], bulk=False) as grpc_client:
                for i in range(len(digests)):
                    grpc_client.put("alpha", MODEL, digests[i : i + 1], payloads[i : i + 1])
                grpc_client.lookup("alpha", MODEL, [*digests, os.urandom(32)])
                grpc_client.get("alpha", MODEL, [digests[-1], os.urandom(32)])
            with BlockClient(server.address, tokens["a"]) as bulk_client:  # the bulk channel
                bulk_client.put("alpha", MODEL, [os.urandom(32)], [os.urandom(KiB)])
                bulk_client.lookup("alpha", MODEL, digests[-2:])
                bulk_client.get("alpha", MODEL, digests[-2:])
            with (
                BlockClient(server.address, tokens["b"], bulk=False) as b,
                pytest.raises(ResourceExhausted),
            ):
                b.put("beta", MODEL, [os.urandom(32)], [os.urandom(9 * KiB)])
            with (
                BlockClient(server.address, "not-a-token", bulk=False) as stranger,
                pytest.raises(KvshareError),
            ):
                stranger.lookup("alpha", MODEL, digests[:1])
            wanted = {"kvshare_cluster_events_total", "kvshare_evictions_total"}
            wanted |= {"kvshare_quota_rejections_total", "kvshare_rpc_duration_seconds_bucket"}
            exported_by(scrape_until(metrics, wanted), exported)
        finally:
            server.terminate()

        # A stored block that fails its checksum, read after a restart.
        flip_stored_byte(tmp_path / "data" / "lmdb" / "data.mdb", payloads[-1][:4096], 100)
        server, metrics = start(config)
        try:
            with BlockClient(server.address, tokens["a"], bulk=False) as grpc_client:
                grpc_client.get("alpha", MODEL, digests[-1:])
            text = scrape_until(metrics, {"kvshare_integrity_failures_total"})
            exported_by(text, exported)
        finally:
            server.terminate()

    # The workload reached every family (else the check below would be vacuous there).
    for name in (
        "kvshare_integrity_failures_total",
        "kvshare_cluster_events_total",
        "kvshare_cluster_reachable",
        "kvshare_tenant_quota_bytes",
        "kvshare_evictions_total",
        "kvshare_journal_undrained_bytes",
        "kvshare_tenant_backlog_bytes",
    ):
        assert name in exported, name
    assert {"tenant", "tier"} <= exported["kvshare_integrity_failures_total"]
    assert exported["kvshare_build_info"] == {"version"}
    assert problems(all_queries(), exported) == []
