"""Telemetry leaks nothing it protects: canary tokens, digests, payloads and bearer
tokens go through the agent and the client, then are searched for in every sink."""

from __future__ import annotations

import base64
import dataclasses
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cacheserver.config import TelemetryConfig, load_config
from cacheserver.embedded import EmbeddedServer
from cacheserver.telemetry import ServerTelemetry
from kvcommon.errors import KvshareError
from kvcommon.logs import JsonFormatter
from kvcommon.tracing import current_trace_ids
from policy.audit import read_records
from replica_agent.agent import ReplicaAgent
from replica_agent.client import BlockClient
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry
from tests.support.scrape import scrape_text
from tests.support.servers import write_config

SPEC = ModelSpec(
    model_id="t/canary-model-id", revision="r", num_layers=2, num_kv_heads=2, head_dim=8,
    dtype="float32", block_tokens=4,
)  # fmt: skip
TOKEN_IDS = [3_141_592_600 + i for i in range(16)]  # u32, ten digits: never in a number by chance
CANARY_MODEL = "canary-model-SECRET-PROMPT-TEXT"
CANARY_PAYLOAD = b"CANARY-PAYLOAD-BYTES-" * 64
WRONG_TOKEN = "canary-wrong-bearer-token-4f1d9a"


@pytest.fixture
def captured_logs() -> Iterator[io.StringIO]:
    """Every log record of the process, as the JSON log of `kvshare serve` renders it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(current_trace_ids))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def forms(secret: bytes) -> list[str]:
    return [
        secret.hex(),
        base64.b64encode(secret).decode(),
        base64.urlsafe_b64encode(secret).decode(),
    ]


def test_no_canary_reaches_metrics_traces_logs_or_audit(
    tmp_path: Path, captured_logs: io.StringIO
) -> None:
    tenancy = write_config(tmp_path)
    config = dataclasses.replace(
        load_config(tenancy.path), telemetry=TelemetryConfig(metrics_listen="127.0.0.1:0")
    )
    server_spans, agent_spans = InMemorySpanExporter(), InMemorySpanExporter()
    agent_metrics = InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(agent_spans))
    telemetry = ServerTelemetry(
        config.telemetry, span_processors=[SimpleSpanProcessor(server_spans)]
    )
    with EmbeddedServer(config, telemetry=telemetry) as server:
        assert server.server is not None
        metrics_address = server.server.metrics_address
        agent = ReplicaAgent(
            BlockClient(server.address, tenancy.tokens["a"]),
            SPEC,
            telemetry=AgentTelemetry(
                meter_provider=MeterProvider(metric_readers=[agent_metrics]),
                tracer_provider=tracer_provider,
            ),
        )
        digests = agent.digests(TOKEN_IDS)
        blocks = [torch.full(SPEC.block_shape, 31337.25) for _ in digests]
        agent.save("alpha", digests, blocks)
        agent.flush()
        match = agent.match("alpha", digests)
        assert agent.load(match).shape[0] == len(digests)  # positive control: restored
        agent.close()

        raw_digests = [os.urandom(32) for _ in range(3)]
        with BlockClient(server.address, tenancy.tokens["a"], bulk=False) as client:
            client.put("alpha", CANARY_MODEL, raw_digests, [CANARY_PAYLOAD] * 3)
            assert client.get("alpha", CANARY_MODEL, raw_digests) == [CANARY_PAYLOAD] * 3
            with pytest.raises(KvshareError):
                client.lookup("beta", CANARY_MODEL, raw_digests)  # denied: audited
        with BlockClient(server.address, WRONG_TOKEN) as client, pytest.raises(KvshareError):
            client.lookup("alpha", CANARY_MODEL, raw_digests)  # authn failure: audited
        metrics_text = scrape_text(metrics_address)

    sinks = {
        "server metrics": metrics_text,
        "agent metrics": agent_metrics.get_metrics_data().to_json(),  # type: ignore[union-attr]
        "server spans": "\n".join(s.to_json() for s in server_spans.get_finished_spans()),
        "agent spans": "\n".join(s.to_json() for s in agent_spans.get_finished_spans()),
        "logs": captured_logs.getvalue(),
        "audit log": config.audit_log_path.read_text(),
    }
    # Positive controls: every sink holds records of this workload.
    assert "kvshare_put_blocks_total" in sinks["server metrics"]
    assert "kvshare.agent.tokens" in sinks["agent metrics"]
    assert "kvshare.bulk/Get" in sinks["server spans"]
    assert "kvshare.agent.load" in sinks["agent spans"]
    assert '"request_id"' in sinks["logs"]  # the audit records, through the log path
    events = {r["event"] for r in read_records(config.audit_log_path)}
    assert {"denied", "authn_failure"} <= events

    secrets = {
        "token ids": [str(t) for t in TOKEN_IDS],
        "digests": [f for d in [*digests, *raw_digests] for f in forms(d)],
        "payload": ["CANARY-PAYLOAD", *forms(CANARY_PAYLOAD[:24])],
        "bearer tokens": [*tenancy.tokens.values(), WRONG_TOKEN],
        "model": [CANARY_MODEL, "canary-model-id"],
        "tensor bytes": forms(blocks[0].flatten()[:4].numpy().tobytes()),
    }
    for sink, text in sinks.items():
        for kind, values in secrets.items():
            leaked = [v for v in values if v in text]
            assert not leaked, f"{kind} found in {sink}: {leaked[:2]}"
    for sink in ("server metrics", "agent metrics", "server spans", "agent spans"):
        assert '"alpha"' not in sinks[sink], f"tenant id in {sink} without per_tenant_labels"
