"""`kvshare demo`: flags, progress on stderr, a table (or `--json`) on stdout."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvshare.demo.table import side_by_side


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replicas",
        type=int,
        default=4,
        metavar="N",
        help="replica processes behind the round-robin balancer (default 4)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=72,
        metavar="M",
        help="requests in the workload (default 72)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload and model seed")
    parser.add_argument(
        "--engine",
        choices=("transformers", "vllm"),
        default="transformers",
        help="replica engine: transformers (default) or vllm (needs vLLM installed: "
        "scripts/setup_vllm_venv.sh builds .venv-vllm)",
    )
    parser.add_argument(
        "--conversations",
        action="store_true",
        help="with --engine vllm: multi-turn chats whose replies are the engine's own "
        "(greedy), each turn on the next replica; compares saving the answers' blocks "
        "with saving prompt blocks only (--requests counts turns)",
    )
    parser.add_argument(
        "--public-prefix",
        type=int,
        default=0,
        metavar="TOKENS",
        help="every tenant's prompts begin with one TOKENS-token framework prompt; a "
        "third run publishes it into the public scope (stored once for all tenants)",
    )
    parser.add_argument(
        "--no-seal",
        action="store_true",
        help="store blocks unsealed (to measure what sealing costs)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (the contract keys) instead of a table",
    )


class _Progress:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, run: str, done: int, total: int) -> None:
        width = 30
        filled = width * done // total
        elapsed = time.monotonic() - self.started
        sys.stderr.write(
            f"\r  {run:<13} [{'#' * filled}{'.' * (width - filled)}] "
            f"{done}/{total}  {elapsed:5.1f}s"
        )
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def format_table(report: dict[str, Any]) -> str:
    local, shared = report["runs"]["local_only"], report["runs"]["shared_store"]
    rows = [
        ("token hit rate", f"{local['token_hit_rate']:.1%}", f"{shared['token_hit_rate']:.1%}"),
        ("  from local cache", f"{local['token_hit_rate']:.1%}", f"{shared['local_hit_rate']:.1%}"),
        ("  from shared store", "-", f"{shared['store_hit_rate']:.1%}"),
        (
            "TTFT p50",
            f"{local['ttft_p50_s'] * 1000:.0f} ms",
            f"{shared['ttft_p50_s'] * 1000:.0f} ms",
        ),
        (
            "TTFT p95",
            f"{local['ttft_p95_s'] * 1000:.0f} ms",
            f"{shared['ttft_p95_s'] * 1000:.0f} ms",
        ),
        ("prefill tokens", f"{local['prefill_tokens']:,}", f"{shared['prefill_tokens']:,}"),
    ]
    public = report["runs"].get("public_scope")
    if public is not None:
        stored = report["public_prefix"]["stored_bytes"]
        rows += [
            ("", "", ""),
            ("public framework prompt", f"{report['public_prefix']['tokens']} tokens", ""),
            ("  stored, tenant-keyed", "-", f"{stored['shared_store'] / 2**20:,.0f} MiB"),
            ("  stored, public scope", "-", f"{stored['public_scope'] / 2**20:,.0f} MiB"),
            ("  prefill, public scope", "-", f"{public['prefill_tokens']:,}"),
            ("  TTFT p50, public scope", "-", f"{public['ttft_p50_s'] * 1000:.0f} ms"),
        ]
    engine = " vLLM" if report.get("engine") == "vllm" else ""
    lines = [
        f"kvshare demo: {report['replicas']}{engine} replicas behind round robin, "
        f"{report['requests']} requests",
        "",
        *side_by_side("local caches only", "with shared store", rows),
    ]
    speedup = local["ttft_p50_s"] / shared["ttft_p50_s"] if shared["ttft_p50_s"] else 0.0
    lines += [
        "",
        f"TTFT p50 {speedup:.1f}x lower with the shared store; outputs identical: "
        f"{'yes' if report['outputs_identical'] else 'NO'}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvshare.demo.runner import DemoOptions, run_demo

    if args.replicas < 1 or args.requests < 1:
        print("kvshare demo: error: --replicas and --requests must be at least 1", file=sys.stderr)
        return 2
    if args.engine == "vllm":
        return _run_vllm(args)
    if args.conversations:
        print("kvshare demo: error: --conversations needs --engine vllm", file=sys.stderr)
        return 2
    if args.public_prefix < 0:
        print("kvshare demo: error: --public-prefix must be >= 0", file=sys.stderr)
        return 2
    options = DemoOptions(
        replicas=args.replicas,
        requests=args.requests,
        seed=args.seed,
        seal=not args.no_seal,
        public_prefix=args.public_prefix,
    )
    print(
        f"kvshare demo: starting a store and {args.replicas} replica processes "
        "(small random-weight Llama on CPU)...",
        file=sys.stderr,
    )
    report = run_demo(options, progress=_Progress()).report()
    print(json.dumps(report) if args.json else format_table(report))
    return 0


def _run_vllm(args: argparse.Namespace) -> int:
    from kvshare.demo.vllm_runner import run_vllm_demo, vllm_available

    if not vllm_available():
        print(
            "kvshare demo: error: --engine vllm needs vLLM; build its venv with "
            "scripts/setup_vllm_venv.sh and run .venv-vllm/bin/python -m kvshare demo "
            "--engine vllm",
            file=sys.stderr,
        )
        return 2
    print(
        f"kvshare demo: starting a store and {args.replicas} vLLM engine processes "
        "(small random-weight Llama, vLLM's CPU backend)...",
        file=sys.stderr,
    )
    if args.conversations:
        from kvshare.demo.vllm_conversation import (
            format_conversation_table,
            run_conversation_demo,
        )

        chats = run_conversation_demo(
            args.replicas, args.requests, args.seed, seal=not args.no_seal, progress=_Progress()
        )
        print(json.dumps(chats) if args.json else format_conversation_table(chats))
        return 0
    report = run_vllm_demo(
        args.replicas, args.requests, args.seed, seal=not args.no_seal, progress=_Progress()
    )
    print(json.dumps(report) if args.json else format_table(report))
    return 0
