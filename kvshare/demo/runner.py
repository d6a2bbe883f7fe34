"""Run the demo: a store, N replica processes, a round-robin balancer, two runs.

The balancer sends the workload's requests in order, each to the next replica in
turn (round robin), and waits for the reply before sending the next, so TTFT measures
the replica's own work on an otherwise idle machine. Run 1 uses local prefix caches
only; run 2 adds the shared store. Both runs send the same prompts.

With `public_prefix` (`kvshare demo --public-prefix N`) every tenant's prompts begin
with one N-token framework prompt, and a third run publishes it into the public
scope first (`kvshare.publish`): run 2 then shows each tenant storing and computing
its own copy, run 3 one copy for all. Each store run gets a fresh store, so its
stored bytes are its own.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import secrets
import statistics
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from cacheserver.config import BulkConfig, ServerConfig, StorageConfig
from cacheserver.embedded import EmbeddedServer
from kvshare.demo.replica import (
    ReplicaSettings,
    RequestResult,
    StoreSettings,
    demo_model,
    replica_main,
)
from kvshare.demo.workload import DemoRequest, WorkloadShape, build_workload, public_prompt
from policy.config import AccessConfig, PublicConfig, TenantConfig
from policy.identity import Action, Principal, TokenCredential, hash_token
from policy.sealing import new_key_entry
from policy.types import PUBLIC, TenantId

Hook = Callable[[str, int], None]  # (run name, request index) before each request
STORE_RUNS = ("shared_store", "public_scope")
PUBLIC_QUOTA_BYTES = 1 << 30


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
        if self.name in STORE_RUNS:
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
    public: bool = False  # the replicas read published prefixes
    stored_bytes: Callable[[], int] | None = None  # an embedded store's bytes, all scopes
    publisher_token: str | None = None  # may publish into its public scope


def demo_tenants(shape: WorkloadShape) -> list[str]:
    return [f"tenant-{i}" for i in range(shape.tenants)]


def demo_access(
    tenants: list[str],
    token: str,
    *,
    require_sealed: bool = False,
    publisher_token: str | None = None,
) -> AccessConfig:
    """The replicas' principal; with `publisher_token`, a public scope whose readers
    are the demo's tenants and a principal that may publish into it."""
    principal = Principal(
        "demo-replicas",
        frozenset(TenantId(t) for t in tenants),
        frozenset({Action.READ, Action.WRITE}),
    )
    credentials = [TokenCredential(hash_token(token), principal)]
    public = None
    if publisher_token is not None:
        publisher = Principal("demo-publisher", frozenset(), frozenset({Action.PUBLISH}))
        credentials.append(TokenCredential(hash_token(publisher_token), publisher))
        public = PublicConfig(PUBLIC_QUOTA_BYTES, require_sealed=require_sealed)
    return AccessConfig(
        tuple(
            TenantConfig(TenantId(t), require_sealed=require_sealed, read_public=public is not None)
            for t in tenants
        ),
        tuple(credentials),
        public=public,
    )


def write_keyring(directory: Path, tenants: list[str]) -> Path:
    """Data keys for `tenants` and the public scope."""
    path = directory / "keyring.toml"
    path.write_text("".join(new_key_entry(t, 1) for t in [*tenants, PUBLIC]))
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
        None
        if store is None
        else StoreSettings(store.address, store.token, store.keyring_file, public=store.public)
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
    public_prefix: int = 0  # tokens of a framework prompt every tenant's prompts begin with


@dataclass(frozen=True)
class DemoResult:
    options: DemoOptions
    local: RunReport
    shared: RunReport
    public: RunReport | None = None  # the run with the framework prompt published
    stored_bytes: dict[str, int] = field(default_factory=dict)  # per store run

    @property
    def outputs_identical(self) -> bool:
        runs = [self.shared] + ([self.public] if self.public is not None else [])
        return all(
            a.output_tokens == b.output_tokens
            for run in runs
            for a, b in zip(self.local.results, run.results, strict=True)
        )

    def report(self) -> dict[str, Any]:
        """The `kvshare demo --json` object (docs/design.md §8 contract keys)."""
        runs = {"local_only": self.local.summary(), "shared_store": self.shared.summary()}
        if self.public is not None:
            runs["public_scope"] = self.public.summary()
        out: dict[str, Any] = {
            "replicas": self.options.replicas,
            "requests": self.options.requests,
            "runs": runs,
            "outputs_identical": self.outputs_identical,
        }
        if self.public is not None:
            tenant_only, public = (
                self.stored_bytes["shared_store"],
                self.stored_bytes["public_scope"],
            )
            out["public_prefix"] = {
                "tokens": self.options.public_prefix,
                "stored_bytes": dict(self.stored_bytes),
                "stored_bytes_ratio": round(public / tenant_only, 4) if tenant_only else 0.0,
                "prefill_tokens_ratio": round(
                    runs["public_scope"]["prefill_tokens"]
                    / max(runs["shared_store"]["prefill_tokens"], 1),
                    4,
                ),
            }
        return out


def run_demo(
    options: DemoOptions,
    *,
    store: StoreHandle | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    hook: Hook | None = None,
) -> DemoResult:
    """The runs; embeds a server in a temp dir per store run unless `store` names one
    (then there is no public-scope run)."""
    shape = replace(options.shape, public_prompt_tokens=options.public_prefix)
    requests = build_workload(options.requests, shape, options.seed)
    stored: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="kvshare-demo-") as tmp:
        pool = ReplicaPool(options.replicas, options.replica)
        try:
            local = run_once(pool, "local_only", requests, None, progress=progress, hook=hook)
            with _store(options, Path(tmp) / "tenant-only", store, public=False) as handle:
                shared = run_once(
                    pool, "shared_store", requests, handle, progress=progress, hook=hook
                )
                if handle.stored_bytes is not None:
                    stored["shared_store"] = handle.stored_bytes()
            public = None
            if options.public_prefix and store is None:
                with _store(options, Path(tmp) / "public", None, public=True) as handle:
                    _publish(options, handle, public_prompt(shape, options.seed))
                    public = run_once(
                        pool, "public_scope", requests, handle, progress=progress, hook=hook
                    )
                    assert handle.stored_bytes is not None
                    stored["public_scope"] = handle.stored_bytes()
        finally:
            pool.close()
    return DemoResult(options, local, shared, public, stored)


@contextlib.contextmanager
def _store(
    options: DemoOptions, directory: Path, given: StoreHandle | None, *, public: bool
) -> Iterator[StoreHandle]:
    """`given`, or an embedded store of the demo's tenants (with a public scope)."""
    if given is not None:
        yield given
        return
    directory.mkdir()
    tenants = demo_tenants(options.shape)
    token = secrets.token_urlsafe(24)
    publisher = secrets.token_urlsafe(24) if public else None
    server = EmbeddedServer(
        ServerConfig(
            listen="127.0.0.1:0",
            data_dir=directory / "data",
            storage=StorageConfig(
                memory_budget_bytes=2 << 30, disk_budget_bytes=4 << 30, sync_writes=False
            ),
            access=demo_access(
                tenants, token, require_sealed=options.seal, publisher_token=publisher
            ),
            # Every demo replica runs as one principal, so it gets every arena a
            # production server shares out per principal.
            bulk=BulkConfig(max_arenas_per_principal=BulkConfig().max_arenas),
        )
    )
    address = server.start()
    spaces = [TenantId(t) for t in tenants] + ([PUBLIC] if public else [])

    def stored_bytes() -> int:
        running = server.server
        assert running is not None
        return sum(running.store.tenant_usage(t)[1] for t in spaces)

    try:
        yield StoreHandle(
            address,
            token,
            write_keyring(directory, tenants) if options.seal else None,
            public=public,
            stored_bytes=stored_bytes,
            publisher_token=publisher,
        )
    finally:
        server.stop()


def _publish(options: DemoOptions, handle: StoreHandle, tokens: list[int]) -> None:
    """Publish the framework prompt as an operator would (kvshare admin publish)."""
    from kvshare.publish import publish_prefix
    from policy.sealing import BlockSealer, Keyring
    from replica_agent.agent import ReplicaAgent

    model, spec = demo_model(options.replica)
    sealer = BlockSealer(Keyring.from_file(handle.keyring_file)) if handle.keyring_file else None
    assert handle.publisher_token is not None
    agent = ReplicaAgent.connect(handle.address, handle.publisher_token, spec, sealer=sealer)
    try:
        publish_prefix(agent, model, tokens)
    finally:
        agent.close()
