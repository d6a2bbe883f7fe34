"""Store -> device restore bandwidth of the replica agent.

    python benchmarks/restore_bandwidth.py [--device cuda] [--blocks 32] [--layers 32]

Starts a real server in a temp dir, saves `--blocks` sealed blocks of a Llama-3-8B-like
layout (32 layers, 8 KV heads, head_dim 128, bf16, 256 tokens per block = 32 MiB each
by default) through a ReplicaAgent, then times `agent.load` into `--device` (pinned
staging and non-blocking copies on CUDA). Reports GB/s for: the gRPC Get alone, Get +
open (AEAD), and the full restore into device memory, each the median of `--rounds`.
Compare the last figure with the model's prefill rate x KV bytes per token: a restore
pays when it is faster than recompute (Llama-3-8B on an H100: ~20k tokens/s x 128 KiB
= ~2.6 GB/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cacheserver.config import ServerConfig, StorageConfig
from cacheserver.embedded import EmbeddedServer
from policy.sealing import BlockSealer, Keyring, new_key_entry
from replica_agent.agent import ReplicaAgent
from replica_agent.spec import ModelSpec


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-seal", action="store_true")
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def median_gbps(nbytes: int, timings: list[float]) -> float:
    return nbytes / statistics.median(timings) / 1e9


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
    with tempfile.TemporaryDirectory() as tmp:
        keyring = Path(tmp) / "keyring.toml"
        keyring.write_text(new_key_entry("dev", 1))
        keyring.chmod(0o600)
        sealer = None if args.no_seal else BlockSealer(Keyring.from_file(keyring))
        total = args.blocks * spec.block_payload_bytes
        storage = StorageConfig(
            memory_budget_bytes=2 * total + (1 << 30),
            disk_budget_bytes=2 * total + (1 << 30),
            sync_writes=False,
        )
        config = ServerConfig(listen="127.0.0.1:0", data_dir=Path(tmp) / "data", storage=storage)
        with EmbeddedServer(config) as server:
            token = (config.data_dir / "dev.token").read_text().strip()
            agent = ReplicaAgent.connect(
                server.address, token, spec, sealer=sealer, device=args.device, timeout_s=120
            )
            digests = agent.digests(list(range(args.blocks * spec.block_tokens)))
            for digest in digests:
                agent.save("dev", [digest], [torch.randn(spec.block_shape).to(torch.bfloat16)])
                agent.flush()
            match = agent.match("dev", digests)
            get_s, open_s, restore_s = [], [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                payloads = agent.client.get("dev", agent.model, digests)
                get_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for digest, payload in zip(digests, payloads, strict=True):
                    if sealer is not None:
                        sealer.open("dev", agent.model, digest, payload)
                open_s.append(time.perf_counter() - t0 + get_s[-1])
                t0 = time.perf_counter()
                restored = agent.load(match)
                restore_s.append(time.perf_counter() - t0)
                assert restored.shape[0] == args.blocks
            agent.close()
    result = {
        "device": args.device,
        "blocks": args.blocks,
        "block_bytes": spec.block_payload_bytes,
        "sealed": sealer is not None,
        "get_gb_per_s": round(median_gbps(total, get_s), 3),
        "get_open_gb_per_s": round(median_gbps(total, open_s), 3),
        "restore_gb_per_s": round(median_gbps(total, restore_s), 3),
    }
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
