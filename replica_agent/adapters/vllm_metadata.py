"""What the scheduler side hands the worker side each step: the plans it puts in vLLM's
connector metadata (`vllm.KVShareMetadata`), built by `vllm_plan.SchedulerPlanner` and
carried out by `vllm_store.WorkerStore` and `vllm_loader.AsyncLoader`.

vLLM may log its metadata, so digests stay out of every plan's repr.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadPlan:
    request_id: str
    tenant: str
    digests: tuple[bytes, ...] = field(repr=False)  # the store blocks to fetch, in order
    skip_tokens: int  # leading tokens of the first store block vLLM already holds
    block_ids: tuple[int, ...]  # the vLLM blocks that receive the tokens after those
    public_blocks: int = 0  # leading `digests` read from @public; the rest from `tenant`
    is_async: bool = False  # by the worker's loader thread, reported in get_finished


@dataclass(frozen=True)
class SavePlan:
    request_id: str
    tenant: str
    digests: tuple[bytes, ...] = field(repr=False)
    block_ids: tuple[int, ...]  # the vLLM blocks that hold these store blocks' tokens
