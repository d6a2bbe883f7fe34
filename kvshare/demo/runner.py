"""Run the demo: a store, N replica processes, a round-robin balancer, two runs.

The balancer sends the workload's requests in order, each to the next replica in
turn (round robin), and waits for the reply before sending the next, so TTFT measures
the replica's own work on an otherwise idle machine. Run 1 uses local prefix caches
only; run 2 adds the shared store. Both runs send the same prompts.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from cacheserver.config import BulkConfig, ServerConfig, StorageConfig
from cacheserver.embedded import EmbeddedServer
from kvshare.demo.replica import (
    ReplicaSettings,
    RequestResult,
    StoreSettings,
    replica_main,
)
from kvshare.demo.workload import DemoRequest, WorkloadShape, build_workload
from policy.config import AccessConfig, TenantConfig
from policy.identity import Action, Principal, TokenCredential, hash_token
from policy.sealing import new_key_entry
from policy.types import TenantId

Hook = Callable[[str, int], None]  # (run name, request index) before each request


@dataclass
class RunReport:
    name: str
    results: list[RequestResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        prompt = sum(r.prompt_tokens for r in self.results) or 1
        local = sum(r.local_tokens for r in self.results)
        store = sum(r.store_tokens for r in self.results)
        ttfts = sorted(r.ttft_s for r in self.results)
        out: dict[str, Any] = {
            "token_hit_rate": round((local + store) / prompt, 4),
            "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else 0.0,
            "ttft_p95_s": round(_percentile(ttfts, 0.95), 4),
            "prefill_tokens": sum(r.prefill_tokens for r in self.results),
        }
        if self.name == "shared_store":
            out["local_hit_rate"] = round(local / prompt, 4)
            out["store_hit_rate"] = round(store / prompt, 4)
        return out


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    rank = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[rank]


@dataclass
class StoreHandle:
    """Where the replicas find the store; the demo embeds one unless given another."""

    address: str
    token: str
    keyring_file: Path | None


def demo_tenants(shape: WorkloadShape) -> list[str]:
    return [f"tenant-{i}" for i in range(shape.tenants)]


def demo_access(tenants: list[str], token: str, *, require_sealed: bool = False) -> AccessConfig:
    principal = Principal(
        "demo-replicas",
        frozenset(TenantId(t) for t in tenants),
        frozenset({Action.READ, Action.WRITE}),
    )
    return AccessConfig(
        tuple(TenantConfig(TenantId(t), require_sealed=require_sealed) for t in tenants),
        (TokenCredential(hash_token(token), principal),),
    )


def write_keyring(directory: Path, tenants: list[str]) -> Path:
    path = directory / "keyring.toml"
    path.write_text("".join(new_key_entry(t, 1) for t in tenants))
    path.chmod(0o600)
    return path


class ReplicaPool:
    """N replica processes, spoken to over pipes."""

    def __init__(self, replicas: int, settings: ReplicaSettings) -> None:
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs = []
        for index in range(replicas):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=replica_main, args=(child, index, settings), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self.wire_models = [self._expect(c, "ready") for c in self._conns]

    @staticmethod
    def _expect(conn: Connection, kind: str) -> Any:
        reply = conn.recv()
        if reply[0] != kind:
            raise RuntimeError(f"replica answered {reply[0]!r}, expected {kind!r}")
        return reply[1]

    def __len__(self) -> int:
        return len(self._conns)

    def broadcast(self, *message: Any) -> list[Any]:
        for conn in self._conns:
            conn.send(message)
        return [self._expect(conn, "ok") for conn in self._conns]

    def serve(self, replica: int, request: DemoRequest) -> RequestResult:
        self._conns[replica].send(("serve", request))
        result: RequestResult = self._expect(self._conns[replica], "result")
        return result

    def close(self) -> None:
        try:
            self.broadcast("stop")
        finally:
            for proc in self._procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()


def run_once(
    pool: ReplicaPool,
    name: str,
    requests: list[DemoRequest],
    store: StoreHandle | None,
    *,
    progress: Callable[[str, int, int], None] | None = None,
    hook: Hook | None = None,
) -> RunReport:
    settings = (
        None if store is None else StoreSettings(store.address, store.token, store.keyring_file)
    )
    pool.broadcast("configure", settings)
    report = RunReport(name)
    for request in requests:
        if hook is not None:
            hook(name, request.index)
        replica = request.index % len(pool)  # round robin
        report.results.append(pool.serve(replica, request))
        if progress is not None:
            progress(name, request.index + 1, len(requests))
    pool.broadcast("flush")
    return report


@dataclass(frozen=True)
class DemoOptions:
    replicas: int = 4
    requests: int = 72
    seed: int = 0
    shape: WorkloadShape = field(default_factory=WorkloadShape)
    replica: ReplicaSettings = field(default_factory=ReplicaSettings)
    seal: bool = True


@dataclass(frozen=True)
class DemoResult:
    options: DemoOptions
    local: RunReport
    shared: RunReport

    @property
    def outputs_identical(self) -> bool:
        pairs = zip(self.local.results, self.shared.results, strict=True)
        return all(a.output_tokens == b.output_tokens for a, b in pairs)

    def report(self) -> dict[str, Any]:
        """The `kvshare demo --json` object (docs/design.md §8 contract keys)."""
        return {
            "replicas": self.options.replicas,
            "requests": self.options.requests,
            "runs": {"local_only": self.local.summary(), "shared_store": self.shared.summary()},
            "outputs_identical": self.outputs_identical,
        }


def run_demo(
    options: DemoOptions,
    *,
    store: StoreHandle | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    hook: Hook | None = None,
) -> DemoResult:
    """Both runs; embeds a server in a temp dir unless `store` names one."""
    requests = build_workload(options.requests, options.shape, options.seed)
    with tempfile.TemporaryDirectory(prefix="kvshare-demo-") as tmp:
        server: EmbeddedServer | None = None
        if store is None:
            tenants = demo_tenants(options.shape)
            token = secrets.token_urlsafe(24)
            server = EmbeddedServer(
                ServerConfig(
                    listen="127.0.0.1:0",
                    data_dir=Path(tmp) / "data",
                    storage=StorageConfig(
                        memory_budget_bytes=2 << 30, disk_budget_bytes=4 << 30, sync_writes=False
                    ),
                    access=demo_access(tenants, token, require_sealed=options.seal),
                    # Every demo replica runs as one principal, so it gets every arena a
                    # production server shares out per principal.
                    bulk=BulkConfig(max_arenas_per_principal=BulkConfig().max_arenas),
                )
            )
            store = StoreHandle(
                server.start(), token, write_keyring(Path(tmp), tenants) if options.seal else None
            )
        pool = ReplicaPool(options.replicas, options.replica)
        try:
            local = run_once(pool, "local_only", requests, None, progress=progress, hook=hook)
            shared = run_once(pool, "shared_store", requests, store, progress=progress, hook=hook)
        finally:
            pool.close()
            if server is not None:
                server.stop()
    return DemoResult(options, local, shared)
