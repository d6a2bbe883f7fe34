"""`kvshare demo --engine vllm --conversations`: chats whose replies are the engine's own.

Each conversation is a tenant's system prompt, then turns: the prompt is the whole
history plus a new user message, the reply is the engine's greedy output, and the
history grows by both. Each turn goes to the next replica (round robin per
conversation), so a turn never finds its history in its own replica's cache: only the
store can supply it.

Two runs on fresh engines and a fresh store, the same conversations: with
`save_generated` off (only prompt blocks reach the store, so the next turn recomputes
the previous answer) and on (the blocks holding the answer are saved too). The replies
are greedy and must be identical in both runs. Reported per run: prompt tokens
prefilled, hit rates (vLLM's own cache and the store) and TTFT.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvshare.demo.replica import RequestResult
from kvshare.demo.runner import demo_tenants
from kvshare.demo.table import side_by_side
from kvshare.demo.vllm_engine import DEMO_MODEL, EngineProcess, write_tiny_llama
from kvshare.demo.vllm_runner import Progress, serve, start_store
from kvshare.demo.workload import DemoRequest, WorkloadShape

TURNS = 4
USER_TOKENS = 64
REPLY_TOKENS = 96
RUNS = {"prompt_blocks_only": False, "generated_saved": True}  # name: save_generated


def _messages(num_conversations: int, shape: WorkloadShape, seed: int) -> list[Any]:
    """Per conversation: its tenant, the system prompt, and each turn's user message."""
    rng = random.Random(seed)
    vocab = shape.vocab_size
    tenants = demo_tenants(shape)
    system = {t: [rng.randrange(vocab) for _ in range(shape.system_prompt_tokens)] for t in tenants}
    return [
        (
            tenants[index % len(tenants)],
            system[tenants[index % len(tenants)]],
            [[rng.randrange(vocab) for _ in range(USER_TOKENS)] for _ in range(TURNS)],
        )
        for index in range(num_conversations)
    ]


def _run(
    engines: list[EngineProcess], name: str, conversations: list[Any], progress: Progress | None
) -> list[RequestResult]:
    histories = [list(system) for _, system, _ in conversations]
    results: list[RequestResult] = []
    total = TURNS * len(conversations)
    for turn in range(TURNS):  # turn by turn, the conversations interleaved
        for index, (tenant, _, messages) in enumerate(conversations):
            prompt = histories[index] + messages[turn]
            replica = (index + turn) % len(engines)
            request = DemoRequest(len(results), tenant, f"c{index}", tuple(prompt), REPLY_TOKENS)
            result = serve(engines[replica], replica, request, with_tenant=True)
            histories[index] = prompt + list(result.output_tokens)
            results.append(result)
            if progress is not None:
                progress(name, len(results), total)
    return results


def _summary(results: list[RequestResult]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in results) or 1
    later = [r.ttft_s for r in results[len(results) // TURNS :]]  # turns 2 and on
    return {
        "prefill_tokens": sum(r.prefill_tokens for r in results),
        "token_hit_rate": round(sum(r.local_tokens + r.store_tokens for r in results) / prompt, 4),
        "store_hit_rate": round(sum(r.store_tokens for r in results) / prompt, 4),
        "ttft_p50_s": round(statistics.median(r.ttft_s for r in results), 4),
        "later_turns_ttft_p50_s": round(statistics.median(later), 4) if later else 0.0,
    }


def run_conversation_demo(
    replicas: int, num_requests: int, seed: int, *, seal: bool, progress: Progress | None = None
) -> dict[str, Any]:
    shape = WorkloadShape(vocab_size=DEMO_MODEL["vocab_size"])
    conversations = _messages(max(1, num_requests // TURNS), shape, seed)
    outputs: dict[str, list[RequestResult]] = {}
    for name, save_generated in RUNS.items():
        with tempfile.TemporaryDirectory(prefix="kvshare-vllm-chat-") as tmp:
            directory = Path(tmp)
            server, connector = start_store(directory, demo_tenants(shape), seal=seal)
            connector["save_generated"] = save_generated
            model_dir = write_tiny_llama(directory / "model", seed, DEMO_MODEL)
            engines = [EngineProcess(model_dir, connector) for _ in range(replicas)]
            try:
                outputs[name] = _run(engines, name, conversations, progress)
            finally:
                for engine in engines:
                    engine.close()
                server.stop()
    first, second = outputs.values()
    return {
        "engine": "vllm",
        "mode": "conversations",
        "replicas": replicas,
        "conversations": len(conversations),
        "turns": TURNS,
        "reply_tokens": REPLY_TOKENS,
        "runs": {name: _summary(results) for name, results in outputs.items()},
        "outputs_identical": all(
            a.output_tokens == b.output_tokens for a, b in zip(first, second, strict=True)
        ),
    }


def format_conversation_table(report: dict[str, Any]) -> str:
    runs = report["runs"]
    off, on = runs["prompt_blocks_only"], runs["generated_saved"]
    rows = [
        ("prefill tokens", f"{off['prefill_tokens']:,}", f"{on['prefill_tokens']:,}"),
        ("token hit rate", f"{off['token_hit_rate']:.1%}", f"{on['token_hit_rate']:.1%}"),
        ("  from shared store", f"{off['store_hit_rate']:.1%}", f"{on['store_hit_rate']:.1%}"),
        ("TTFT p50", f"{off['ttft_p50_s'] * 1e3:.0f} ms", f"{on['ttft_p50_s'] * 1e3:.0f} ms"),
        (
            "TTFT p50, turns 2+",
            f"{off['later_turns_ttft_p50_s'] * 1e3:.0f} ms",
            f"{on['later_turns_ttft_p50_s'] * 1e3:.0f} ms",
        ),
    ]
    lines = [
        f"kvshare demo: {report['replicas']} vLLM replicas, {report['conversations']} "
        f"conversations of {report['turns']} turns, replies generated by the engine",
        "",
        *side_by_side("prompt blocks only", "answers saved too", rows),
    ]
    same = "yes" if report["outputs_identical"] else "NO"
    lines += ["", f"replies identical in both runs: {same}"]
    return "\n".join(lines)
