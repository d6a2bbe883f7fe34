"""How long an engine-like loop's steps take while the agent saves sealed blocks.

The loop runs a fixed step (a matmul, then a host sync, as an engine samples each token)
on the main thread; every few steps it saves freshly produced blocks. Reported: step
time percentiles without saves and with them. What a save costs the loop is the
snapshot enqueue in `save()` plus the saver thread's GIL use (sealing, the store call).
Used by scripts/gpu_check.py on a GPU and by a small CPU run in the default suite.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from cacheserver.config import ServerConfig
from cacheserver.embedded import EmbeddedServer
from policy.sealing import BlockSealer, Keyring, new_key_entry
from replica_agent.agent import ReplicaAgent
from replica_agent.codec import HEADER_BYTES, torch_dtype
from replica_agent.spec import ModelSpec

LLAMA_8B_BLOCK = ModelSpec("check/stall", "r", 32, 8, 128, "bfloat16", block_tokens=256)


def _percentiles_ms(step_s: list[float]) -> dict[str, float]:
    ordered = sorted(step_s)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1e3, 3),
        "max_ms": round(ordered[-1] * 1e3, 3),
    }


def _steps(device: torch.device, matrix: int, steps: int, on_step: Any = None) -> list[float]:
    a = torch.randn(matrix, matrix, device=device)
    step_s = []
    for step in range(steps):
        started = time.perf_counter()
        _ = a @ a
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        if on_step is not None:
            on_step(step)
        step_s.append(time.perf_counter() - started)
    return step_s


def engine_loop_with_saves(
    device: torch.device | str,
    *,
    spec: ModelSpec = LLAMA_8B_BLOCK,
    matrix: int = 4096,
    steps: int = 300,
    save_every: int = 10,
    blocks_per_save: int = 2,
) -> dict[str, Any]:
    device = torch.device(device)
    with tempfile.TemporaryDirectory() as tmp:
        keyring = Path(tmp) / "keyring.toml"
        keyring.write_text(new_key_entry("dev", 1))
        keyring.chmod(0o600)
        data_dir = Path(tmp) / "data"
        with EmbeddedServer(ServerConfig(listen="127.0.0.1:0", data_dir=data_dir)) as server:
            token = (data_dir / "dev.token").read_text().strip()
            agent = ReplicaAgent.connect(
                server.address,
                token,
                spec,
                device=device,
                sealer=BlockSealer(Keyring.from_file(keyring)),
                save_buffer_bytes=8 * (HEADER_BYTES + spec.block_payload_bytes),
                timeout_s=120,
            )
            digests = agent.digests(list(range(steps * blocks_per_save * spec.block_tokens)))
            baseline = _steps(device, matrix, steps)

            # Made once: a save copies the bytes at call time, so the engine may reuse them.
            blocks = [
                torch.randn(spec.block_shape, device=device).to(torch_dtype(spec))
                for _ in range(blocks_per_save)
            ]

            def save(step: int) -> None:
                if step % save_every == 0:
                    first = step * blocks_per_save
                    agent.save("dev", digests[first : first + blocks_per_save], blocks)

            saving = _steps(device, matrix, steps, save)
            agent.flush()
            stats = agent.stats
            agent.close()
    return {
        "ok": stats.blocks_saved > 0 and stats.store_errors == 0,
        "block_bytes": spec.block_payload_bytes,
        "sealed": True,
        "steps": steps,
        "without_saves": _percentiles_ms(baseline),
        "with_saves": _percentiles_ms(saving),
        "blocks_saved": stats.blocks_saved,
        "saves_dropped": stats.saves_dropped,
    }
