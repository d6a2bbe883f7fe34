"""One request decoding while another arrives, step by step (the engine child's side).

`interleave` drives vLLM's engine one step at a time, so each of the running request's
tokens gets the time its step returned: the inter-token latency a streaming client
sees. The arriving request is added after the running one produced `arrive_after`
tokens; its TTFT runs from that moment to the step that returns its first token.
Greedy, with `ignore_eos`, so every run decodes the same number of tokens.

Runs inside `kvshare.demo.vllm_engine`'s child (the process that owns the engine);
used by benchmarks/vllm_async.py.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

_ids = itertools.count()


def _params(prompt: dict[str, Any], max_tokens: int) -> Any:
    from vllm import SamplingParams

    tenant = prompt.get("tenant")
    extra = {"kv_transfer_params": {"kvshare_tenant": tenant}} if tenant else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)


def interleave(llm: Any, message: dict[str, Any]) -> dict[str, Any]:
    engine = llm.llm_engine
    serial = next(_ids)
    running_id, arriving_id = f"running-{serial}", f"arriving-{serial}"
    running, arriving = message["running"], message.get("arriving")
    engine.add_request(
        running_id,
        {"prompt_token_ids": list(running["token_ids"])},
        _params(running, message["running_tokens"]),
    )
    times: list[float] = []
    running_tokens: list[int] = []
    arrived_at: float | None = None
    result: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            tokens = list(out.outputs[0].token_ids)
            if out.request_id == running_id:
                times.extend([now] * (len(tokens) - len(running_tokens)))
                running_tokens = tokens
            elif out.request_id == arriving_id and tokens and arrived_at is not None:
                result.setdefault("arriving_ttft_s", now - arrived_at)
                result.setdefault("arriving_first_token_at_s", now)
                result["arriving_tokens"] = tokens
                result["arriving_cached_tokens"] = int(out.num_cached_tokens or 0)
        if arriving is not None and arrived_at is None and len(times) >= message["arrive_after"]:
            engine.add_request(
                arriving_id,
                {"prompt_token_ids": list(arriving["token_ids"])},
                _params(arriving, message["arriving_tokens"]),
            )
            arrived_at = time.perf_counter()
            result["arrived_at_s"] = arrived_at
    result["running_tokens"] = running_tokens
    result["running_token_times_s"] = times
    return result
