"""One request's restore is one trace: agent spans are parents of the server's spans."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cacheserver.config import ServerConfig
from cacheserver.embedded import EmbeddedServer
from cacheserver.telemetry import ServerTelemetry
from replica_agent.agent import ReplicaAgent
from replica_agent.client import BlockClient
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry

SPEC = ModelSpec(
    model_id="t/m", revision="r", num_layers=2, num_kv_heads=2, head_dim=8,
    dtype="float32", block_tokens=4,
)  # fmt: skip


def only(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def is_child(child: ReadableSpan, parent: ReadableSpan) -> bool:
    assert child.context is not None and parent.context is not None
    return (
        child.parent is not None
        and child.context.trace_id == parent.context.trace_id
        and child.parent.span_id == parent.context.span_id
    )


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "grpc"])
def test_agent_restore_and_server_get_share_one_trace(tmp_path: Path, bulk: bool) -> None:
    server_spans, agent_spans = InMemorySpanExporter(), InMemorySpanExporter()
    telemetry = ServerTelemetry(span_processors=[SimpleSpanProcessor(server_spans)])
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(agent_spans))
    data_dir = tmp_path / "data"
    config = ServerConfig(listen="127.0.0.1:0", data_dir=data_dir)
    with EmbeddedServer(config, telemetry=telemetry) as server:
        token = (data_dir / "dev.token").read_text().strip()
        client = BlockClient(server.address, token, bulk=bulk)
        agent = ReplicaAgent(
            client, SPEC, telemetry=AgentTelemetry(tracer_provider=tracer_provider)
        )
        digests = agent.digests(list(range(16)))
        agent.save("dev", digests, [torch.randn(SPEC.block_shape) for _ in digests])
        agent.flush()
        request = tracer_provider.get_tracer("engine").start_as_current_span("request")
        with request:  # one inference request: match, then restore
            match = agent.match("dev", digests)
            restored = agent.load(match)
        agent.close()
    assert restored.shape[0] == 4  # positive control: the restore really hit

    agent_done, server_done = agent_spans.get_finished_spans(), server_spans.get_finished_spans()
    outer = only(list(agent_done), "request")
    load = only(list(agent_done), "kvshare.agent.load")
    lookup_span = only(list(agent_done), "kvshare.agent.match")
    assert is_child(load, outer) and is_child(lookup_span, outer)
    get_name = "kvshare.bulk/Get" if bulk else "kvshare.v1.BlockStore/Get"
    server_get = only(
        [s for s in server_done if s.name == get_name and is_child(s, load)], get_name
    )
    assert server_get.kind.name == "SERVER"
    lookup_name = "kvshare.bulk/Lookup" if bulk else "kvshare.v1.BlockStore/Lookup"
    assert any(is_child(s, lookup_span) for s in server_done if s.name == lookup_name)
    save = only(list(agent_done), "kvshare.agent.save")
    put_name = "kvshare.bulk/Put" if bulk else "kvshare.v1.BlockStore/Put"
    assert any(is_child(s, save) for s in server_done if s.name == put_name)
