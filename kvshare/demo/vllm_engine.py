"""A vLLM engine in its own process, driven over stdin/stdout (the vLLM demo and tests).

    engine = EngineProcess(model_dir, connector={...extra config...} or None)
    outs = engine.generate([Prompt(token_ids, tenant="acme")], max_tokens=4)
    engine.stats()    # the connector's counters (scheduler and worker side)
    engine.close()    # vLLM shuts down; the connector flushes its pending saves

One engine per process: vLLM keeps its KV-transfer connector in a process global, so
two engines with connectors cannot share a process; and a replica is a process in
practice. The child runs vLLM's offline `LLM` in-process (no engine-core subprocess),
on the CPU backend here (`VLLM_CPU_KVCACHE_SPACE`), with a random-weight Llama made by
`write_tiny_llama` (no download). Replies are single lines prefixed with `REPLY_TAG`,
so vLLM's own logging on stdout is skipped.

Run as `python -m kvshare.demo.vllm_engine MODEL_DIR CONFIG_JSON`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPLY_TAG = "KVSHARE-ENGINE "
CONNECTOR = "KVShareConnector"
CONNECTOR_MODULE = "replica_agent.adapters.vllm"
# head_dim 64 (hidden / heads): the CPU attention kernels do not support 16. The tests'
# model is small (fast to start and run); the demo's is the transformers demo's model
# (8 layers, 512 hidden, 2 KV heads), whose prefill work per KV byte is that of
# the reference model in docs/design.md §12, so TTFT compares as it would on a real one.
TEST_MODEL = {
    "num_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 4096,
    "max_position_embeddings": 8192,
}
DEMO_MODEL = {
    "num_layers": 8,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_kv_heads": 2,
    "intermediate_size": 2048,
    "vocab_size": 8192,
    "max_position_embeddings": 8192,
}


def write_tiny_llama(directory: Path, seed: int = 0, dims: dict[str, int] = TEST_MODEL) -> Path:
    """A random-weight Llama (fp32 safetensors + config.json) in `directory`."""
    from replica_agent.adapters.hf_tiny import tiny_llama

    if not (directory / "config.json").exists():
        model = tiny_llama(
            seed,
            num_layers=dims["num_layers"],
            hidden_size=dims["hidden_size"],
            num_attention_heads=dims["num_attention_heads"],
            num_kv_heads=dims["num_kv_heads"],
            intermediate_size=dims["intermediate_size"],
            vocab_size=dims["vocab_size"],
            max_position_embeddings=dims["max_position_embeddings"],
        )
        model.save_pretrained(directory)
    return directory


@dataclass(frozen=True)
class Prompt:
    token_ids: Sequence[int]
    tenant: str | None = None  # set as kv_transfer_params["kvshare_tenant"], as a gateway would
    cache_salt: str | None = None


@dataclass(frozen=True)
class Output:
    token_ids: tuple[int, ...]
    num_cached_tokens: int  # vLLM's prefix hits: its own cache plus tokens the store supplied
    ttft_s: float
    # A load's stages in ms after the request was submitted (replica_agent.adapters.
    # vllm_trace, plus "first_token"); empty when nothing loaded from the store.
    timeline: dict[str, float] = field(default_factory=dict)


class EngineProcess:
    def __init__(
        self,
        model_dir: Path,
        connector: dict[str, Any] | None,
        *,
        max_model_len: int = 4096,
        kv_cache_gib: int = 1,
        threads: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:
        config = {"connector": connector, "max_model_len": max_model_len}
        child_env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvshare.demo.vllm_engine", str(model_dir), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env,
        )
        self.log: list[str] = []
        self._started_s: float | None = None

    @property
    def started_s(self) -> float:
        """Seconds vLLM took to start; waits for it (engines start in parallel until then)."""
        if self._started_s is None:
            self._started_s = float(self._reply()["started_s"])
        return self._started_s

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY_TAG):
                reply: dict[str, Any] = json.loads(line[len(REPLY_TAG) :])
                if "error" in reply:
                    raise RuntimeError(f"engine failed: {reply['error']}")
                return reply
            self.log.append(line)
        tail = "".join(self.log[-30:])
        raise RuntimeError(f"engine exited ({self.proc.wait()}):\n{tail}")

    def _ask(self, **message: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        _ = self.started_s
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def generate(self, prompts: Sequence[Prompt], max_tokens: int = 4) -> list[Output]:
        reply = self._ask(
            op="generate", prompts=[asdict(p) for p in prompts], max_tokens=max_tokens
        )
        return [
            Output(tuple(o["token_ids"]), o["num_cached_tokens"], o["ttft_s"], o["timeline"])
            for o in reply["outputs"]
        ]

    def stats(self) -> dict[str, Any]:
        return dict(self._ask(op="stats")["stats"])

    def interleave(
        self,
        running: Prompt,
        running_tokens: int,
        arriving: Prompt | None = None,
        *,
        arrive_after: int = 0,
        arriving_tokens: int = 1,
    ) -> dict[str, Any]:
        """`running` decodes while `arriving` is added after `arrive_after` of its
        tokens; the per-token times and both outputs (kvshare.demo.vllm_timeline)."""
        reply = self._ask(
            op="interleave",
            running=asdict(running),
            running_tokens=running_tokens,
            arriving=asdict(arriving) if arriving is not None else None,
            arrive_after=arrive_after,
            arriving_tokens=arriving_tokens,
        )
        return dict(reply["timeline"])

    def reset_prefix_cache(self) -> None:
        self._ask(op="reset_prefix_cache")

    def close(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Shut vLLM down (the connector flushes its saves); the final worker stats."""
        try:
            reply = self._ask(op="shutdown")
            self.proc.wait(timeout=timeout_s)
            return dict(reply.get("stats", {}))
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            return {}  # it failed to start or died: nothing left to flush
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


# -- the child process ---------------------------------------------------------------------


def _send(**reply: Any) -> None:
    sys.stdout.write(REPLY_TAG + json.dumps(reply) + "\n")
    sys.stdout.flush()


def _connectors(llm: Any) -> tuple[Any, Any] | None:
    """The engine's scheduler-side and worker-side connectors (None: no connector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return llm.llm_engine.engine_core.engine_core.scheduler.connector, get_kv_transfer_group()


def _connector_stats(llm: Any) -> dict[str, Any]:
    connectors = _connectors(llm)
    if connectors is None:
        return {}
    scheduler, worker = connectors
    planner = scheduler._planner
    return {
        "worker": asdict(worker.stats),
        "scheduler": {**asdict(scheduler.stats), **asdict(planner.stats)},
        "tracked_requests": scheduler.tracked_requests,
        "namespace": worker.namespace,
        "block_tokens": worker.block_tokens,
    }


def _build(model_dir: str, config: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if config["connector"] is not None:
        transfer = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config=config["connector"],
        )
    return LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        gpu_memory_utilization=0.1,
        max_model_len=config["max_model_len"],
        max_num_batched_tokens=config["max_model_len"],
        max_num_seqs=8,
        disable_log_stats=False,
        kv_transfer_config=transfer,
    )


def _load_timeline(llm: Any, submitted: float) -> dict[str, float]:
    """The stages of the load of the one request just served, in ms after `submitted`
    (both connector sides' marks; {} without a connector or a load)."""
    connectors = _connectors(llm)
    if connectors is None:
        return {}
    merged: dict[str, float] = {}
    for side in (connector.timeline.take() for connector in connectors):
        for marks in side.values():  # one request at a time: at most one id
            merged.update({stage: round((at - submitted) * 1e3, 2) for stage, at in marks.items()})
    return merged


def _generate(llm: Any, message: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    outputs = []
    for prompt in message["prompts"]:  # one at a time, as a round-robin balancer sends them
        extra = {"kv_transfer_params": {"kvshare_tenant": prompt["tenant"]}}
        params = SamplingParams(
            max_tokens=message["max_tokens"],
            temperature=0.0,
            extra_args=extra if prompt["tenant"] else None,
        )
        request: dict[str, Any] = {"prompt_token_ids": list(prompt["token_ids"])}
        if prompt["cache_salt"]:
            request["cache_salt"] = prompt["cache_salt"]
        started = time.perf_counter()
        submitted = time.monotonic()  # the connector's clock (vllm_trace)
        (out,) = llm.generate([request], params, use_tqdm=False)
        wall = time.perf_counter() - started
        latency = getattr(out.metrics, "first_token_latency", 0.0) or wall
        timeline = _load_timeline(llm, submitted)
        if timeline:
            timeline["first_token"] = round(latency * 1e3, 2)
        outputs.append(
            {
                "token_ids": list(out.outputs[0].token_ids),
                "num_cached_tokens": int(out.num_cached_tokens or 0),
                "ttft_s": float(latency),
                "timeline": timeline,
            }
        )
    return outputs


def main(argv: Sequence[str]) -> int:
    model_dir, config = argv[0], json.loads(argv[1])
    started = time.perf_counter()
    try:
        llm = _build(model_dir, config)
    except Exception as error:
        _send(error=f"{type(error).__name__}: {error}")
        return 1
    _send(started_s=time.perf_counter() - started)
    for line in sys.stdin:
        message = json.loads(line)
        op = message["op"]
        if op == "generate":
            _send(outputs=_generate(llm, message))
        elif op == "stats":
            _send(stats=_connector_stats(llm))
        elif op == "interleave":
            from kvshare.demo.vllm_timeline import interleave

            _send(timeline=interleave(llm, message))
        elif op == "reset_prefix_cache":
            _send(ok=llm.reset_prefix_cache())
        elif op == "shutdown":
            _send(stats=_shutdown(llm))
            return 0
    return 0


def _shutdown(llm: Any) -> dict[str, Any]:
    """Shut the engine down; the worker connector's counters after its final flush."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    llm.llm_engine.engine_core.shutdown()  # the connector's shutdown flushes saves
    return asdict(worker.stats) if worker is not None else {}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
