"""Store -> device restore bandwidth of the replica agent, with every restore checked.

    python benchmarks/restore_bandwidth.py [--device cuda] [--blocks 32] [--layers 32]
        [--transport same-host|bulk-tcp|grpc] [--rounds 5] [--no-seal] [--json]

Starts a real server in a temp dir, saves `--blocks` blocks of a Llama-3-8B-like layout
(32 layers, 8 KV heads, head_dim 128, bf16, 256 tokens per block = 32 MiB each by
default) through a ReplicaAgent (sealed unless `--no-seal`), then times, after one
untimed warm-up round, the median of `--rounds` of each stage:

- `views` (the bare GET the restore starts from): `BlockClient.iter_views` of all blocks
  over `--transport` (`same-host`: the shared-memory arena of a server on this host;
  `bulk-tcp`: the bulk channel over TCP; `grpc`: streamed gRPC frames), each block a
  view of the connection's buffers or the arena, valid until the next: no copy;
- `fetch`: `BlockClient.get` of all blocks, each copied into `bytes`;
- `fetch_open`: the same plus opening (AES-GCM) every block;
- `views_open` (sealed only): the agent's read and open, `BlockClient.iter_views` (each
  block a view of the connection's buffers or the arena, valid until the next), each
  opened with `BlockSealer.open` (a fresh plaintext per block);
- `views_open_into` (sealed only): the same, each opened with `BlockSealer.open_into`
  into one reused buffer the caller owns;
- `restore_kept`: `agent.load_into` whole blocks into one destination kept across rounds
  (as CUDA's caching allocator keeps device memory): read as `views` does, open each
  block into its pinned staging slot (CUDA) or its destination (CPU), check it there,
  copy it to the device (CUDA), timed until the caller's stream has the bytes;
  `restore_vs_views` is its rate over `views`' (their rounds alternate);
- `restore`: `agent.load`, the same into a destination allocated per call (on the CPU
  its first-touch page faults are in this figure, not in `restore_kept`).

Every restore is compared byte for byte with the blocks that were saved (after the
timer stops); a mismatch aborts the run. Reports GB/s of block payload (GB = 1e9 bytes).
Compare `restore` with the model's prefill rate x KV bytes per token: a restore pays
when it is faster than recompute (Llama-3-8B on an H100: ~20k tokens/s x 128 KiB =
~2.6 GB/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code

from cacheserver.config import ServerConfig, StorageConfig
from cacheserver.embedded import EmbeddedServer
from policy.sealing import BlockSealer, Keyring, new_key_entry
from replica_agent import codec
from replica_agent.agent import PrefixMatch, ReplicaAgent
from replica_agent.client import BlockClient
from replica_agent.spec import ModelSpec

TRANSPORTS = {  # BlockClient(bulk=..., same_host=...)
    "same-host": (True, True),
    "bulk-tcp": (True, False),
    "grpc": (False, False),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--transport", choices=sorted(TRANSPORTS), default="same-host")
    p.add_argument("--no-seal", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device (torch sees none)")
    return args


def median_gbps(nbytes: int, timings: list[float]) -> float:
    return round(nbytes / statistics.median(timings) / 1e9, 3)


def wait_for_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.current_stream(torch.device(device)).synchronize()


def check_restored(restored: torch.Tensor, saved: list[torch.Tensor]) -> None:
    if restored.shape[0] != len(saved):
        sys.exit(f"restore returned {restored.shape[0]} of {len(saved)} blocks; aborting")
    host = restored.to("cpu")
    for index, (got, want) in enumerate(zip(host, saved, strict=True)):
        if not torch.equal(got, want):
            sys.exit(f"restored block {index} differs from the saved block; aborting")


def timed_rounds(
    rounds: int, action: Callable[[], object], check: Callable[[object], None] = lambda _: None
) -> list[float]:
    """Timings of `rounds` calls after one untimed warm-up (connections, pinned staging,
    the arena, allocator caches); `check` sees each result after its timer stopped."""
    check(action())
    timings = []
    for _ in range(rounds):
        started = time.perf_counter()
        result = action()
        timings.append(time.perf_counter() - started)
        check(result)
    return timings


def alternating_rounds(
    rounds: int, *actions: tuple[Callable[[], object], Callable[[object], None]]
) -> list[list[float]]:
    """`timed_rounds` of several actions, their rounds interleaved (one of each in turn),
    so that a shared machine's slow spells fall on all of them alike."""
    for action, check in actions:
        check(action())
    timings: list[list[float]] = [[] for _ in actions]
    for _ in range(rounds):
        for (action, check), times in zip(actions, timings, strict=True):
            started = time.perf_counter()
            result = action()
            times.append(time.perf_counter() - started)
            check(result)
    return timings


def measure(
    agent: ReplicaAgent,
    sealer: BlockSealer | None,
    match: PrefixMatch,
    saved: list[torch.Tensor],
    args: argparse.Namespace,
) -> dict[str, float]:
    digests = list(match.digests)

    def fetch() -> list[bytes]:
        return agent.client.get("dev", agent.model, digests)

    def fetch_open() -> list[bytes]:
        payloads = fetch()
        if sealer is None:
            return payloads
        return [
            sealer.open("dev", agent.model, d, p) for d, p in zip(digests, payloads, strict=True)
        ]

    opened = bytearray(agent.spec.block_payload_bytes + codec.HEADER_BYTES)

    def views_open() -> list[int]:
        assert sealer is not None
        views = agent.client.iter_views("dev", agent.model, digests)
        return [
            len(sealer.open("dev", agent.model, d, v)) for d, v in zip(digests, views, strict=True)
        ]

    def views_open_into() -> list[int]:
        assert sealer is not None
        views = agent.client.iter_views("dev", agent.model, digests)
        return [
            sealer.open_into("dev", agent.model, d, v, opened).nbytes
            for d, v in zip(digests, views, strict=True)
        ]

    def bare_views() -> list[int]:
        return [len(view) for view in agent.client.iter_views("dev", agent.model, digests)]

    def restore() -> torch.Tensor:
        restored = agent.load(match)
        wait_for_device(args.device)
        return restored

    kept = torch.empty(
        (len(digests), *agent.spec.block_shape),
        dtype=codec.torch_dtype(agent.spec),
        device=agent.device,
    )

    def restore_kept() -> torch.Tensor:
        count = agent.load_into(match, lambda index: [(kept[index], ())])
        wait_for_device(args.device)
        return kept[:count]

    def check_fetched(payloads: object) -> None:
        if len(payloads) != len(digests):  # type: ignore[arg-type]
            sys.exit(f"fetched {len(payloads)} of {len(digests)} blocks; aborting")  # type: ignore[arg-type]

    total = len(digests) * agent.spec.block_payload_bytes
    paired = alternating_rounds(
        args.rounds,
        (bare_views, check_fetched),
        (restore_kept, lambda r: check_restored(r, saved)),  # type: ignore[arg-type]
    )
    views_gbps, kept_gbps = (median_gbps(total, timings) for timings in paired)
    views: dict[str, float] = {}
    if sealer is not None:
        for name, action in (("views_open", views_open), ("views_open_into", views_open_into)):
            timings = timed_rounds(args.rounds, action, check_fetched)
            views[f"{name}_gb_per_s"] = median_gbps(total, timings)
    return {
        "views_gb_per_s": views_gbps,
        "restore_kept_gb_per_s": kept_gbps,
        "restore_vs_views": round(kept_gbps / views_gbps, 3),
        "fetch_gb_per_s": median_gbps(total, timed_rounds(args.rounds, fetch, check_fetched)),
        "fetch_open_gb_per_s": median_gbps(
            total, timed_rounds(args.rounds, fetch_open, check_fetched)
        ),
        **views,
        "restore_gb_per_s": median_gbps(
            total,
            timed_rounds(args.rounds, restore, lambda r: check_restored(r, saved)),  # type: ignore[arg-type]
        ),
    }


def main() -> None:
    args = parse()
    spec = ModelSpec(
        model_id="bench/llama-3-8b-like",
        revision="r",
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype="bfloat16",
        block_tokens=args.block_tokens,
    )
    total = args.blocks * spec.block_payload_bytes
    with tempfile.TemporaryDirectory() as tmp:
        keyring = Path(tmp) / "keyring.toml"
        keyring.write_text(new_key_entry("dev", 1))
        keyring.chmod(0o600)
        sealer = None if args.no_seal else BlockSealer(Keyring.from_file(keyring))
        storage = StorageConfig(
            memory_budget_bytes=2 * total + (1 << 30),
            disk_budget_bytes=2 * total + (1 << 30),
            sync_writes=False,
        )
        config = ServerConfig(listen="127.0.0.1:0", data_dir=Path(tmp) / "data", storage=storage)
        with EmbeddedServer(config) as server:
            token = (config.data_dir / "dev.token").read_text().strip()
            bulk, same_host = TRANSPORTS[args.transport]
            client = BlockClient(
                server.address, token, timeout_s=120, bulk=bulk, same_host=same_host
            )
            agent = ReplicaAgent(
                client,
                spec,
                sealer=sealer,
                device=args.device,
                save_buffer_bytes=max(total, 1 << 20) + (1 << 20),
            )
            digests = agent.digests(list(range(args.blocks * spec.block_tokens)))
            saved = [torch.randn(spec.block_shape).to(torch.bfloat16) for _ in digests]
            for digest, block in zip(digests, saved, strict=True):
                if not agent.save("dev", [digest], [block]):
                    sys.exit("a save was dropped; raise save_buffer_bytes")
            agent.flush()
            match = agent.match("dev", digests)
            if match.blocks != args.blocks:
                sys.exit(f"the store holds {match.blocks} of {args.blocks} blocks; aborting")
            figures = measure(agent, sealer, match, saved, args)
            agent.close()
    result = {
        "device": str(agent.device),
        "transport": args.transport,
        "blocks": args.blocks,
        "block_bytes": spec.block_payload_bytes,
        "sealed": sealer is not None,
        "rounds": args.rounds,
        "content_checked": True,
        **figures,
    }
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
