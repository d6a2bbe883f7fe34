"""The far host's side of the two-host tests, run inside the client namespace:

    ip netns exec NS python -m tests.twohost.replica MODE '<json args>'

Modes print one JSON object per line on stdout:
- `blocks`: a BlockClient puts random blocks and reads them back (`bulk`: false for
  gRPC only);
- `scrape`: the text of a Prometheus endpoint (run in the server's namespace);
- `save`: a ReplicaAgent prefills prompts of the small model and saves their blocks;
- `restore`: a ReplicaAgent restores prefixes another process saved and compares the
  model's output with a full recompute (fp32: logits within 1e-4, same greedy tokens);
- `serve`: a long-lived replica; each stdin line `{"prompts": [...]}` runs one
  inference per prompt (match, load, prefill the rest, compare with a recompute, save)
  and prints what happened.

Every mode first checks that it runs in the namespace it was told (`namespace`): the
machine's own namespace may route 198.18.0.0/15 somewhere real.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

from kvshare.bench.netns import Host

BLOCK_TOKENS = 16


class _Warnings(logging.Handler):
    """Counts the client's warnings (a bulk channel falling back to gRPC logs one)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _client_tls(args: dict[str, Any]) -> Any:
    from replica_agent.client import ClientTls

    if not args.get("root_ca"):
        return None
    cert, key = args.get("client_cert"), args.get("client_key")
    return ClientTls(
        root_ca=Path(args["root_ca"]),
        client_cert=Path(cert) if cert else None,
        client_key=Path(key) if key else None,
    )


def blocks(args: dict[str, Any]) -> dict[str, Any]:
    from replica_agent.client import BlockClient, BlockStoreError

    digests = [os.urandom(32) for _ in range(args["count"])]
    payloads = [os.urandom(args["block_bytes"]) for _ in digests]
    try:
        with BlockClient(
            args["address"],
            args["token"],
            tls=_client_tls(args),
            timeout_s=10,
            bulk=args.get("bulk", True),
        ) as client:
            stored = client.put(args["tenant"], "twohost/model", digests, payloads)
            found = client.get(args["tenant"], "twohost/model", digests)
    except BlockStoreError as error:
        return {"error": error.code().name}
    return {"stored": sum(stored), "identical": found == payloads}


def scrape(args: dict[str, Any]) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{args['metrics']}/metrics", timeout=10) as response:
        return {"text": response.read().decode("utf-8")}


def _agent(args: dict[str, Any], dtype: str = "float32") -> Any:
    from policy.sealing import BlockSealer, Keyring
    from replica_agent.agent import ReplicaAgent
    from replica_agent.breaker import CircuitBreaker
    from tests.support.agent_writer import build

    model, spec = build(dtype, BLOCK_TOKENS)
    agent = ReplicaAgent.connect(
        args["address"],
        args["token"],
        spec,  # type: ignore[arg-type]
        tls=_client_tls(args),
        timeout_s=2.0,
        sealer=BlockSealer(Keyring.from_file(Path(args["keyring"]))),
        breaker=CircuitBreaker(failure_threshold=2, cooldown_s=0.5),
    )
    return model, agent


def save(args: dict[str, Any]) -> dict[str, Any]:
    """Prefill each prompt in full and save its blocks (sealed), as a warm replica does."""
    from replica_agent.adapters.hf import blocks_from_cache, prefill

    model, agent = _agent(args)
    for prompt in args["prompts"]:
        _, cache = prefill(model, prompt)
        digests = agent.digests(prompt)
        agent.save(args["tenant"], digests, blocks_from_cache(cache, agent.spec, 0, len(digests)))
    agent.flush()
    report = {"blocks_saved": agent.stats.blocks_saved, "store_errors": agent.stats.store_errors}
    agent.close()
    return report


def restore(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from replica_agent.adapters.hf import cache_from_blocks, greedy_continue, prefill

    model, agent = _agent(args)
    worst, same_tokens, restored_tokens = 0.0, True, 0
    for prompt in args["prompts"]:
        restored = agent.load(agent.match(args["tenant"], agent.digests(prompt)))
        cache = cache_from_blocks(restored, agent.spec, model.config)
        tokens = len(restored) * BLOCK_TOKENS
        restored_tokens += tokens
        logits, cache = prefill(model, prompt, prefix_cache=cache, prefix_tokens=tokens)
        full_logits, full_cache = prefill(model, prompt)
        worst = max(worst, torch.max(torch.abs(logits - full_logits)).item())
        same_tokens &= greedy_continue(model, logits, cache, 8) == greedy_continue(
            model, full_logits, full_cache, 8
        )
    report = {
        "restored_tokens": restored_tokens,
        "max_logit_difference": worst,
        "same_tokens": same_tokens,
        "open_failures": agent.stats.open_failures,
        "store_errors": agent.stats.store_errors,
    }
    agent.close()
    return report


def serve(args: dict[str, Any]) -> None:
    """One inference per prompt per stdin line; a failed inference is reported, never raised."""
    from replica_agent.adapters.hf import (
        blocks_from_cache,
        cache_from_blocks,
        greedy_continue,
        prefill,
    )

    model, agent = _agent(args)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        report = {"requests": 0, "failed": 0, "store_tokens": 0, "mismatches": 0}
        skipped_before = agent.stats.skipped_breaker_open
        for prompt in json.loads(line)["prompts"]:
            report["requests"] += 1
            try:
                digests = agent.digests(prompt)
                match = agent.match(args["tenant"], digests)
                restored = agent.load(match)
                cache = cache_from_blocks(restored, agent.spec, model.config)
                tokens = len(restored) * BLOCK_TOKENS
                logits, cache = prefill(model, prompt, prefix_cache=cache, prefix_tokens=tokens)
                full_logits, full_cache = prefill(model, prompt)
                computed = blocks_from_cache(full_cache, agent.spec, 0, len(digests))
                if greedy_continue(model, logits, cache, 4) != greedy_continue(
                    model, full_logits, full_cache, 4
                ):
                    report["mismatches"] += 1
                report["store_tokens"] += tokens
                agent.save(args["tenant"], digests, computed)
            except Exception as error:  # the test counts these; there must be none
                report["failed"] += 1
                print(f"inference failed: {type(error).__name__}: {error}", file=sys.stderr)
        agent.flush()
        report["store_errors"] = agent.stats.store_errors
        report["skipped_breaker_open"] = agent.stats.skipped_breaker_open - skipped_before
        report["blocks_saved"] = agent.stats.blocks_saved
        print(json.dumps(report), flush=True)
    agent.close()


def main() -> None:
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    Host(args["namespace"], "").require_current()
    warnings = _Warnings()
    logging.getLogger().addHandler(warnings)
    if mode == "serve":
        serve(args)
        return
    report = {"blocks": blocks, "scrape": scrape, "save": save, "restore": restore}[mode](args)
    report["warnings"] = warnings.messages
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
