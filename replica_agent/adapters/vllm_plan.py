"""The scheduler side of the vLLM connector, without vLLM: what to load and what to save.

vLLM asks the connector, per waiting request, how many tokens beyond its own prefix
cache it can supply; later, per step, it hands over the blocks it allocated and the
tokens it scheduled. `SchedulerPlanner` answers from kvshare's digest chain:

- The first question about a request hashes its prompt (`replica_agent.hashing`, with
  the request's tenant, `cache_salt` and LoRA adapter) and asks the store once how
  many leading blocks it holds; the answer is kept per request, so vLLM's repeated
  questions (it asks again while a request waits for cache space) cost nothing and
  change nothing. The state goes when vLLM reports the request finished or aborted.
- The answer is whole store blocks, never the last prompt token (vLLM must compute at
  least one token to sample from), minus what vLLM already holds locally. Store blocks
  are a multiple of vLLM's block size, so the count is block-aligned for vLLM too.
- Each step's plans: a `LoadPlan` for a request whose external tokens were allocated
  (the store blocks and the vLLM blocks they go to) and a `SavePlan` for each request
  whose step completed new full store blocks that the store does not already hold.
- An asynchronous load is planned when vLLM allocates the request's blocks (the request
  then waits outside the batch, so no step schedules it first); after it vLLM asks no
  more of that request, and if it asks again (a failed load, a preemption) the answer
  is 0: what loaded is in vLLM's own cache, the rest is recomputed, never re-fetched.
- Saves follow the request's tokens as they grow: prompt blocks during prefill, then
  each block the model's output fills, hashed on the same chain (tenant, salt, LoRA),
  so a later prompt that holds the answer computes the same digests.

Public prefixes (replica_agent.public; `"public_prefixes"`, default true): the digests
come from `plan_chain` over the public catalogue the connector holds. The first
`public_blocks` (P) are on the public chain and listed in the catalogue: they are
looked up and loaded from the public scope `@public`, the rest from the request's
tenant, and only when all P are there. Only listed digests are ever sent to `@public`,
so a private prompt's digests never reach it. Saves go to the tenant and start at P
at the earliest (an engine never writes `@public`); the output's blocks extend the
same split chain, P fixed at the first look, so the next turn's plan (same catalogue)
computes the digests those saves used. An empty or unreadable catalogue gives P = 0:
the ordinary chain, exactly as without public prefixes.

Tenancy (`vllm_options.request_tenant`): a request's tenant comes from
`kv_transfer_params["kvshare_tenant"]`, set by the deployer's gateway after it
authenticated the end user; without one the request uses the configured default tenant,
or skips the cache (`require_request_tenant`). A malformed tenant skips the cache and
never falls back to the default. The store still checks every tenant against the
engine's principal (PERMISSION_DENIED is a miss).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvcommon.errors import ConfigError
from replica_agent.adapters.vllm_metadata import LoadPlan, SavePlan
from replica_agent.adapters.vllm_modes import AUTO, LoadModes
from replica_agent.public import PUBLIC_SCOPE, plan_chain

log = logging.getLogger(__name__)

# vLLM normally reports every finished request; the bound only stops a leak if not.
MAX_TRACKED_REQUESTS = 65536


@dataclass(frozen=True)
class RequestKey:
    """What names a request's blocks besides the model: tenant, prompt, salt, adapter."""

    tenant: str
    token_ids: Sequence[int]  # the prompt
    salt: bytes = b""
    lora_id: str | None = None
    # vLLM's live list of prompt plus output tokens (it grows as the model decodes):
    # what a save of generated blocks hashes. None: the prompt's blocks only.
    all_token_ids: Sequence[int] | None = None


@dataclass(frozen=True)
class Chain:
    """How one request's digests are computed: `plan_chain` with these arguments, the
    catalogue narrowed to the request's own public digests once they are known, so an
    extension over decoded tokens keeps the public boundary of the first look."""

    model: str
    block_tokens: int
    salt: bytes = field(repr=False)
    lora_id: str | None
    public: frozenset[bytes] = field(default=frozenset(), repr=False)

    def digests(self, token_ids: Sequence[int]) -> tuple[bytes, ...]:
        plan = plan_chain(
            self.model,
            self.block_tokens,
            token_ids,
            self.public,
            salt=self.salt,
            lora_id=self.lora_id,
        )
        return plan.digests


@dataclass
class RequestState:
    tenant: str
    chain: Chain = field(repr=False)
    tokens: Sequence[int] = field(repr=False)  # what saves may cover (see RequestKey)
    digests: tuple[bytes, ...] = field(repr=False)  # full store blocks of `tokens` so far
    prompt_tokens: int
    store_blocks: int  # leading blocks the store held when asked (@public's, then the tenant's)
    saved_blocks: int  # blocks before this one are in the store or planned for it
    public_blocks: int = 0  # leading blocks on the public chain: read from @public, never saved
    block_ids: list[int] = field(default_factory=list)
    pending_load_tokens: int = 0
    load_issued: bool = False  # an asynchronous load was planned: never plan another
    load_async: bool = False  # the mode given with the last answer (vllm_modes)
    owner: object = field(default=None, repr=False)  # vLLM's Request: one per request id

    def digests_upto(self, blocks: int) -> tuple[bytes, ...]:
        """The first `blocks` digests, extending the chain over tokens decoded since."""
        if blocks > len(self.digests):
            self.digests = self.chain.digests(self.tokens[: blocks * self.chain.block_tokens])
        return self.digests[:blocks]


@dataclass(frozen=True)
class NewStep:
    """A request scheduled for the first time (or again after preemption)."""

    request_id: str
    block_ids: Sequence[int]
    num_computed_tokens: int  # local prefix hits plus the tokens the connector loads
    num_scheduled_tokens: int


@dataclass(frozen=True)
class RunningStep:
    request_id: str
    new_block_ids: Sequence[int] | None
    resumed: bool  # after preemption: new_block_ids is the whole block table
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass
class PlannerStats:
    lookups: int = 0
    blocks_matched: int = 0  # leading blocks found, @public's and the tenant's
    public_lookups: int = 0  # requests whose leading blocks were asked of @public
    public_blocks_matched: int = 0  # of blocks_matched, those found in @public
    requests_skipped: int = 0  # no tenant, malformed tenant, or nothing hashable
    tokens_planned: int = 0  # tokens put in load plans (a failed load is recomputed)
    loads_sync: int = 0  # load plans run before a forward pass (vllm_modes)
    loads_async: int = 0  # load plans run by the worker's loader thread
    duplicate_ids: int = 0  # a second live request under one id: that id skips the cache


Lookup = Callable[[str, Sequence[bytes]], int]  # (tenant or @public, digests) -> leading held
Catalogue = Callable[[], frozenset[bytes]]  # the public digests (PublicCatalogue.digests)


class SchedulerPlanner:
    def __init__(
        self,
        chain_model: str,
        store_block_tokens: int,
        vllm_block_tokens: int,
        lookup: Lookup,
        catalogue: Catalogue | None = None,
        load_mode: str = AUTO,
    ) -> None:
        """`chain_model` names the digest chain (the connector's rank-0 namespace);
        `catalogue`, when given, the public digests it may read from @public (None:
        public prefixes off, every chain the ordinary one); `load_mode` who waits for
        a load (vllm_modes)."""
        if store_block_tokens % vllm_block_tokens:
            raise ConfigError("store block tokens must be a multiple of vLLM's block size")
        self.chain_model = chain_model
        self.block_tokens = store_block_tokens
        self.vllm_block_tokens = vllm_block_tokens
        self.vllm_blocks_per_block = store_block_tokens // vllm_block_tokens
        self._lookup = lookup
        self._catalogue = catalogue
        self._states: dict[str, RequestState | None] = {}
        self._async_loads: list[LoadPlan] = []  # planned at allocation, sent next step
        self._loading: set[str] = set()  # asynchronous loads issued, not yet reported done
        self._cancelled: list[str] = []  # finished while their asynchronous load was queued
        self.modes = LoadModes(load_mode)
        self.stats = PlannerStats()

    @property
    def tracked_requests(self) -> int:
        return len(self._states)

    def new_matched_tokens(
        self,
        request_id: str,
        num_computed_tokens: int,
        describe: Callable[[], RequestKey | None],
        owner: object = None,
    ) -> int:
        """Tokens the store can supply after `num_computed_tokens` (0 when none).
        `owner` is vLLM's request object: a second live request under the same id
        (vLLM randomises ids unless told not to) is refused the cache, and so is the
        first from then on, so neither loads nor saves under the other's digests."""
        if request_id not in self._states:
            if len(self._states) >= MAX_TRACKED_REQUESTS:
                self._states.pop(next(iter(self._states)))
            state = self._first_look(describe())
            if state is not None:
                state.owner = owner
            self._states[request_id] = state
        state = self._states[request_id]
        if state is not None and owner is not None and state.owner not in (None, owner):
            log.warning("two live requests share one request id; both skip the cache")
            self.stats.duplicate_ids += 1
            self._states[request_id] = state = None
        if state is None or state.load_issued:
            # After an asynchronous load vLLM caches the blocks that arrived; a request
            # asked again (its load failed, or it was preempted) recomputes the rest, so a
            # block that keeps failing cannot bounce the request between load and retry.
            return 0
        loadable = min(state.store_blocks, (state.prompt_tokens - 1) // self.block_tokens)
        tokens = max(0, loadable * self.block_tokens - num_computed_tokens)
        state.load_async = tokens > 0 and self.modes.is_async(request_id)
        return tokens

    def is_load_async(self, request_id: str) -> bool:
        """The mode given with `request_id`'s last answer: vLLM allocates by it."""
        state = self._states.get(request_id)
        return state is not None and state.load_async

    def _first_look(self, key: RequestKey | None) -> RequestState | None:
        if key is None:
            self.stats.requests_skipped += 1
            return None
        catalogue = self._catalogue() if self._catalogue is not None else frozenset()
        plan = plan_chain(
            self.chain_model,
            self.block_tokens,
            key.token_ids,
            catalogue,
            salt=key.salt,
            lora_id=key.lora_id,
        )
        digests, public = plan.digests, plan.public_blocks
        chain = Chain(
            self.chain_model, self.block_tokens, key.salt, key.lora_id, frozenset(digests[:public])
        )
        saves_output = key.all_token_ids is not None
        if not digests and not saves_output:
            return None
        found = self._match(key.tenant, digests, public) if digests else 0
        tokens = key.all_token_ids if key.all_token_ids is not None else key.token_ids
        # Public blocks are never saved: none missing from @public goes to the tenant.
        saved = max(found, public)
        return RequestState(
            key.tenant, chain, tokens, digests, len(key.token_ids), found, saved, public
        )

    def _match(self, tenant: str, digests: Sequence[bytes], public: int) -> int:
        """Leading blocks held: the first `public` in @public (only those: they are
        listed in the catalogue), then, if all of them are there, the tenant's."""
        self.stats.lookups += 1
        found = 0
        if public:
            self.stats.public_lookups += 1
            found = self._lookup(PUBLIC_SCOPE, digests[:public])
            self.stats.public_blocks_matched += found
        if found == public and public < len(digests):
            found += self._lookup(tenant, digests[public:])
        self.stats.blocks_matched += found
        return found

    def after_alloc(
        self,
        request_id: str,
        num_external_tokens: int,
        block_ids: Sequence[int] = (),
        *,
        is_async: bool = False,
    ) -> None:
        """vLLM allocated the request's blocks. An asynchronous load is planned now: the
        request waits for it outside the batch, so no later step schedules it first."""
        state = self._states.get(request_id)
        if state is None:
            return
        state.pending_load_tokens = num_external_tokens
        if is_async and num_external_tokens > 0:
            state.block_ids = list(block_ids)
            state.load_issued = True
            self._loading.add(request_id)
            end = min(state.store_blocks, (state.prompt_tokens - 1) // self.block_tokens)
            self._plan(request_id, state, end * self.block_tokens, self._async_loads, True)

    def finished(self, request_id: str) -> None:
        """vLLM finished or aborted the request. Its asynchronous load, if one is still
        unreported, is cancelled (`take_cancelled`): a queued load is skipped, and the
        worker still reports it done, since vLLM frees the request's blocks only then.
        (A load is sent in the step that allocates it, and vLLM aborts between steps, so
        no load of a finished request is still to be sent.)"""
        self._states.pop(request_id, None)
        self.modes.finished(request_id)
        if request_id in self._loading:
            self._loading.discard(request_id)
            self._cancelled.append(request_id)

    def loads_reported(self, request_ids: Iterable[str]) -> None:
        """The workers reported these requests' asynchronous loads done."""
        self._loading.difference_update(request_ids)

    def build(
        self, new: Iterable[NewStep], running: Iterable[RunningStep]
    ) -> tuple[list[LoadPlan], list[SavePlan]]:
        """This step's plans; vLLM calls it once per step, after scheduling."""
        new, running = list(new), list(running)
        self.modes.observe_batch([s.request_id for s in new] + [r.request_id for r in running])
        loads, self._async_loads = self._async_loads, []
        saves: list[SavePlan] = []
        for step in new:
            state = self._states.get(step.request_id)
            if state is not None:
                state.block_ids = list(step.block_ids)
                self._plan(step.request_id, state, step.num_computed_tokens, loads)
                self._plan_save(step, state, saves)
        for cont in running:
            state = self._states.get(cont.request_id)
            if state is None:
                continue
            if cont.resumed:
                state.block_ids = list(cont.new_block_ids or ())
            elif cont.new_block_ids:
                state.block_ids.extend(cont.new_block_ids)
            self._plan(cont.request_id, state, cont.num_computed_tokens, loads)
            self._plan_save(cont, state, saves)
        return loads, saves

    def take_cancelled(self) -> list[str]:
        """Requests finished while their asynchronous load was queued or running."""
        cancelled, self._cancelled = self._cancelled, []
        return cancelled

    def _plan(
        self,
        request_id: str,
        state: RequestState,
        num_computed: int,
        loads: list[LoadPlan],
        is_async: bool = False,
    ) -> None:
        """A load of the `pending_load_tokens` that end at `num_computed`, if any."""
        count, state.pending_load_tokens = state.pending_load_tokens, 0
        if count <= 0:
            return
        self.stats.tokens_planned += count
        if is_async:
            self.stats.loads_async += 1
        else:
            self.stats.loads_sync += 1
        start, end = num_computed - count, num_computed
        first, last = start // self.block_tokens, end // self.block_tokens
        vllm_ids = state.block_ids[start // self.vllm_block_tokens : end // self.vllm_block_tokens]
        loads.append(
            LoadPlan(
                request_id,
                state.tenant,
                state.digests[first:last],
                start - first * self.block_tokens,
                tuple(vllm_ids),
                max(0, min(last, state.public_blocks) - first),
                is_async,
            )
        )

    def _plan_save(
        self, step: NewStep | RunningStep, state: RequestState, saves: list[SavePlan]
    ) -> None:
        """A save of the full store blocks this step completes. Blocks past the prompt
        hold the model's output; their KV exists once a step has fed their tokens, and
        their digests are the chain a later prompt holding those tokens computes."""
        computed = min(step.num_computed_tokens + step.num_scheduled_tokens, len(state.tokens))
        upto = computed // self.block_tokens
        per = self.vllm_blocks_per_block
        if upto <= state.saved_blocks or len(state.block_ids) < upto * per:
            return
        first = state.saved_blocks
        saves.append(
            SavePlan(
                step.request_id,
                state.tenant,
                state.digests_upto(upto)[first:upto],
                tuple(state.block_ids[first * per : upto * per]),
            )
        )
        state.saved_blocks = upto
