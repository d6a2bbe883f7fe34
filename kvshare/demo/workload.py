"""The demo's multi-tenant workload: chats and agent loops that re-send their context.

Deterministic for a seed. Each tenant has its own system prompt; a chat turn re-sends
the whole conversation plus a new user message; an agent step re-sends the growing
context plus the last tool output. The assistant's replies in the history are
scripted (as when replaying a recorded trace), so both runs of the demo send exactly
the same prompts and their outputs can be compared token for token.

With `public_prompt_tokens`, every tenant's system prompt follows one public
framework prompt (an agent framework's instructions and tool schemas): the text an
operator publishes into the public scope (`kvshare demo --public-prefix`). It is
drawn from its own seeded stream, so the rest of the workload is the same with it.

Sessions are interleaved in a seeded random order, as arrivals are in practice: the
next turn of a conversation lands on whichever replica round robin picks, which is
the point of the demo.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkloadShape:
    tenants: int = 3
    system_prompt_tokens: int = 256
    active_sessions: int = 6
    chat_turns: int = 6
    user_tokens: int = 96
    assistant_tokens: int = 128
    agent_steps: int = 6
    tool_output_tokens: int = 256
    max_new_tokens: int = 4
    vocab_size: int = 8192
    public_prompt_tokens: int = 0  # a framework prompt before every system prompt


@dataclass(frozen=True)
class DemoRequest:
    index: int
    tenant: str
    session: str
    token_ids: tuple[int, ...]
    max_new_tokens: int


@dataclass
class _Session:
    name: str
    tenant: str
    context: list[int]
    steps_left: int
    step_tokens: tuple[int, ...]  # tokens appended before each request
    reply_tokens: int  # scripted tokens appended after each request
    rng: random.Random = field(repr=False, default_factory=random.Random)

    def next_prompt(self, vocab: int) -> tuple[int, ...]:
        for part in self.step_tokens:
            self.context.extend(self.rng.randrange(vocab) for _ in range(part))
        prompt = tuple(self.context)
        self.context.extend(self.rng.randrange(vocab) for _ in range(self.reply_tokens))
        self.steps_left -= 1
        return prompt


def build_workload(num_requests: int, shape: WorkloadShape, seed: int = 0) -> list[DemoRequest]:
    rng = random.Random(seed)
    tenants = [f"tenant-{i}" for i in range(shape.tenants)]
    public = public_prompt(shape, seed)
    system = {
        t: public + [rng.randrange(shape.vocab_size) for _ in range(shape.system_prompt_tokens)]
        for t in tenants
    }
    counter = 0

    def new_session() -> _Session:
        nonlocal counter
        counter += 1
        tenant = rng.choice(tenants)
        is_agent = rng.random() < 0.4
        return _Session(
            name=f"{'agent' if is_agent else 'chat'}-{counter}",
            tenant=tenant,
            context=list(system[tenant]),
            steps_left=shape.agent_steps if is_agent else shape.chat_turns,
            step_tokens=(shape.tool_output_tokens,) if is_agent else (shape.user_tokens,),
            reply_tokens=shape.assistant_tokens // 2 if is_agent else shape.assistant_tokens,
            rng=random.Random(rng.getrandbits(64)),
        )

    sessions = [new_session() for _ in range(shape.active_sessions)]
    requests: list[DemoRequest] = []
    while len(requests) < num_requests:
        session = rng.choice(sessions)
        prompt = session.next_prompt(shape.vocab_size)
        requests.append(
            DemoRequest(len(requests), session.tenant, session.name, prompt, shape.max_new_tokens)
        )
        if session.steps_left == 0:
            sessions[sessions.index(session)] = new_session()
    return requests


def public_prompt(shape: WorkloadShape, seed: int = 0) -> list[int]:
    """The framework prompt every tenant's requests begin with (none by default)."""
    rng = random.Random(f"public-prompt/{seed}")
    return [rng.randrange(shape.vocab_size) for _ in range(shape.public_prompt_tokens)]
