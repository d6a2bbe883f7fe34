"""`kvshare demo --engine vllm`: the demo's two runs on N real vLLM engine processes.

The same workload, balancer and report as the transformers demo (kvshare.demo.runner),
with each replica a vLLM engine (CPU backend, random-weight Llama) running
KVShareConnector against an embedded store. Engines start once: in the first run
requests carry no tenant, so the connector stays out of every request (the engines
use only vLLM's own prefix cache, `require_request_tenant`); then every engine's cache
is emptied and the second run sends the same requests with their tenant, as a gateway
would, so the connector loads what other replicas saved. TTFT is vLLM's own measure
(arrival to first token); hits are vLLM's `num_cached_tokens`, split into local and
store by the tokens the connector planned to load.
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cacheserver.config import ServerConfig, StorageConfig
from cacheserver.embedded import EmbeddedServer
from kvshare.demo.replica import RequestResult
from kvshare.demo.runner import RunReport, demo_access, demo_tenants, write_keyring
from kvshare.demo.vllm_engine import DEMO_MODEL, EngineProcess, Prompt, write_tiny_llama
from kvshare.demo.workload import DemoRequest, WorkloadShape, build_workload

STORE_BLOCK_TOKENS = 128  # one vLLM CPU block: the finest a store block can be
Progress = Callable[[str, int, int], None]


def vllm_available() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def serve(
    engine: EngineProcess,
    replica: int,
    request: DemoRequest,
    *,
    with_tenant: bool,
    timelines: list[dict[str, float]] | None = None,
) -> RequestResult:
    """One request on one engine; a load's stages go to `timelines` when given."""
    before = engine.stats().get("scheduler", {}).get("tokens_planned", 0)
    prompt = Prompt(request.token_ids, request.tenant if with_tenant else None)
    (output,) = engine.generate([prompt], max_tokens=request.max_new_tokens)
    store = engine.stats().get("scheduler", {}).get("tokens_planned", 0) - before
    cached = min(output.num_cached_tokens, len(request.token_ids))
    if timelines is not None and output.timeline:
        timelines.append(output.timeline)
    return RequestResult(
        request.index,
        replica,
        output.ttft_s,
        output.token_ids,
        len(request.token_ids),
        cached - store,
        store,
        len(request.token_ids) - cached,
    )


def run_round_robin(
    engines: list[EngineProcess],
    name: str,
    requests: list[DemoRequest],
    progress: Progress | None = None,
    timelines: list[dict[str, float]] | None = None,
    *,
    forget_local: bool = False,
) -> RunReport:
    """One run of the workload: "local_only" sends no tenant (the connector stays out),
    any other name sends each request's tenant, as a gateway would. `forget_local`
    empties the engine's own cache before each request (every hit is the store's)."""
    report = RunReport(name)
    for engine in engines:
        engine.reset_prefix_cache()
    for request in requests:
        replica = request.index % len(engines)  # round robin
        if forget_local:
            engines[replica].reset_prefix_cache()
        result = serve(
            engines[replica],
            replica,
            request,
            with_tenant=name != "local_only",
            timelines=timelines,
        )
        report.results.append(result)
        if progress is not None:
            progress(name, request.index + 1, len(requests))
    return report


def start_store(
    directory: Path, tenants: list[str], *, seal: bool
) -> tuple[EmbeddedServer, dict[str, Any]]:
    """An embedded store for the demo's tenants, and the engines' connector config."""
    token = secrets.token_urlsafe(24)
    token_file = directory / "replicas.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    server = EmbeddedServer(
        ServerConfig(
            listen="127.0.0.1:0",
            data_dir=directory / "data",
            storage=StorageConfig(memory_budget_bytes=2 << 30, disk_budget_bytes=4 << 30),
            access=demo_access(tenants, token, require_sealed=seal),
        )
    )
    connector: dict[str, Any] = {
        "target": server.start(),
        "token_file": str(token_file),
        "tenant": tenants[0],
        "require_request_tenant": True,
        "block_tokens": STORE_BLOCK_TOKENS,
    }
    if seal:
        connector["keyring_file"] = str(write_keyring(directory, tenants))
    return server, connector


def run_vllm_demo(
    replicas: int, num_requests: int, seed: int, *, seal: bool, progress: Progress | None = None
) -> dict[str, Any]:
    """Both runs; the `kvshare demo --json` object plus `"engine": "vllm"`."""
    shape = WorkloadShape(vocab_size=DEMO_MODEL["vocab_size"])
    requests = build_workload(num_requests, shape, seed)
    tenants = demo_tenants(shape)
    with tempfile.TemporaryDirectory(prefix="kvshare-vllm-demo-") as tmp:
        directory = Path(tmp)
        server, connector = start_store(directory, tenants, seal=seal)
        model_dir = write_tiny_llama(directory / "model", seed, DEMO_MODEL)
        engines = [EngineProcess(model_dir, connector) for _ in range(replicas)]
        try:
            local = run_round_robin(engines, "local_only", requests, progress)
            shared = run_round_robin(engines, "shared_store", requests, progress)
        finally:
            for engine in engines:
                engine.close()
            server.stop()
    pairs = zip(local.results, shared.results, strict=True)
    return {
        "engine": "vllm",
        "replicas": replicas,
        "requests": num_requests,
        "runs": {"local_only": local.summary(), "shared_store": shared.summary()},
        "outputs_identical": all(a.output_tokens == b.output_tokens for a, b in pairs),
    }
