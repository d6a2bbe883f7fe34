"""Does a slow store stall the batch? Inter-token latency of a decoding request while
another request's long prefix loads from kvshare, with synchronous and asynchronous
loads (KVShareConnector's `load_mode`), on vLLM's CPU backend.

    .venv-vllm/bin/python benchmarks/vllm_async.py --quick [--json]

Setup: an embedded kvshare store (sealed blocks) behind a relay that caps the store's
replies at `--store-mib-s` (a slow store or a long link, injected here without touching
the product), two vLLM engine processes with the connector (one per load mode), the
demo's random-weight Llama. The arriving request's prefix is saved once through an
engine, then each run empties the engines' own caches, so every load comes from the
store through the relay.

Runs, each with the same request arriving after `--arrive-after` running tokens:
`no_load` (its prefix is in the engine's own prefix cache: nothing loads, and what
remains is what admitting any request costs the running one, the prefill of its last
uncached tokens), `sync`, `async` and `auto` (the default: the connector chooses per
request, here asynchronous since another request is decoding) (its prefix is only in
the store and loads).
The running request alone is measured too and printed beside them (not in the JSON).
Reported per run: the running request's inter-token latency (p50, p99, max, in ms)
and the arriving request's TTFT. `--json` prints exactly {"no_load": {...}, "sync":
{...}, "async": {...}, "auto": {...}}. The greedy tokens must be identical in every run, and the
arriving request's prefix must come from the store in both load modes, or the
benchmark exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvshare.demo.vllm_engine import DEMO_MODEL, EngineProcess, Prompt, write_tiny_llama
from kvshare.demo.vllm_runner import start_store
from replica_agent.client import BlockClient
from replica_agent.hashing import BlockHasher

TENANT = "bench"
LOAD_MODES = ("sync", "async", "auto")
STORE_BLOCK_TOKENS = 128  # one vLLM CPU block
ARRIVING_TOKENS = 8


class SlowRelay:
    """A TCP relay to the store that paces the store's replies at `bytes_per_s`."""

    def __init__(self, target: str, bytes_per_s: float) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._bytes_per_s = bytes_per_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            upstream = socket.create_connection(self._target)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(
                target=self._pipe, args=(upstream, client, self._bytes_per_s), daemon=True
            ).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, bytes_per_s: float) -> None:
        try:
            while data := source.recv(64 << 10):
                if bytes_per_s:
                    time.sleep(len(data) / bytes_per_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def itl_ms(times: Sequence[float]) -> dict[str, float]:
    gaps = sorted((b - a) * 1e3 for a, b in itertools.pairwise(times))
    p99 = gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))]
    return {"itl_p50_ms": statistics.median(gaps), "itl_p99_ms": p99, "itl_max_ms": gaps[-1]}


def summary(runs: Sequence[dict[str, Any]], arrive_after: int) -> dict[str, float]:
    """Each figure's median over the repeats (one spike from another process on a
    shared machine does not make the figure). ITL counts the running request's tokens
    from the arrival on: the window in which the other request loads and prefills."""
    rows = [itl_ms(run["running_token_times_s"][arrive_after - 1 :]) for run in runs]
    figures = {key: round(statistics.median(row[key] for row in rows), 2) for key in rows[0]}
    if "arriving_ttft_s" in runs[0]:
        ttft = statistics.median(run["arriving_ttft_s"] for run in runs)
        figures["ttft_ms"] = round(ttft * 1e3, 1)
    return figures


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens (a few minutes)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--store-mib-s", type=float, default=16.0, help="relay's reply rate")
    parser.add_argument("--prefix-blocks", type=int, default=8, help="store blocks to load")
    parser.add_argument("--arrive-after", type=int, default=20, help="running tokens first")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode (medians)")
    parser.add_argument("--dump", help="write every run's token times to this JSON file")
    return parser.parse_args(argv)


def wait_stored(address: str, token: str, namespace: str, prompt: list[int], blocks: int) -> None:
    digests = BlockHasher(namespace, STORE_BLOCK_TOKENS).digests(prompt)[:blocks]
    deadline = time.monotonic() + 120
    with BlockClient(address, token) as client:
        while client.lookup(TENANT, namespace, digests) < blocks:
            if time.monotonic() > deadline:
                raise SystemExit("the arriving request's prefix never reached the store")
            time.sleep(0.2)


def measure(args: argparse.Namespace, directory: Path) -> dict[str, dict[str, Any]]:
    rng = random.Random(11)
    vocab = DEMO_MODEL["vocab_size"]
    running = Prompt([rng.randrange(vocab) for _ in range(64)], TENANT)
    prefix_tokens = args.prefix_blocks * STORE_BLOCK_TOKENS
    arriving = Prompt([rng.randrange(vocab) for _ in range(prefix_tokens + 40)], TENANT)
    running_tokens = 200 if args.quick else 400  # decodes past the end of the load
    server, connector = start_store(directory, [TENANT], seal=True)
    token = Path(connector["token_file"]).read_text()
    relay = SlowRelay(server.address, args.store_mib_s * (1 << 20))
    model_dir = write_tiny_llama(directory / "model", 0, DEMO_MODEL)
    base = {
        **connector,
        "target": relay.address,
        "bulk": False,  # one gRPC connection, so every reply crosses the relay
        "same_host": False,
        "timeout_s": 60.0,
    }
    engines = {mode: EngineProcess(model_dir, {**base, "load_mode": mode}) for mode in LOAD_MODES}
    try:
        baselines = []  # without a tenant the connector stays out: vLLM computes it all
        for engine in engines.values():  # and it warms both: a shape's first steps are slow
            warm = engine.interleave(
                Prompt(running.token_ids),
                8,
                Prompt(arriving.token_ids),
                arrive_after=2,
                arriving_tokens=ARRIVING_TOKENS,
            )
            baselines.append(warm)
            engine.reset_prefix_cache()
        namespace = engines["async"].stats()["namespace"]
        engines["async"].generate([arriving], max_tokens=1)  # saves the prefix
        wait_stored(server.address, token, namespace, list(arriving.token_ids), args.prefix_blocks)
        runs: dict[str, list[dict[str, Any]]] = {
            "no_load": [],
            "sync": [],
            "async": [],
            "auto": [],
            "alone": [],
        }
        for _ in range(args.repeats):
            for name, mode, incoming in (
                ("no_load", "async", arriving),
                ("sync", "sync", arriving),
                ("async", "async", arriving),
                ("auto", "auto", arriving),
                ("alone", "async", None),
            ):
                engines[mode].reset_prefix_cache()
                if name == "no_load":  # the engine holds the prefix itself: nothing loads
                    engines[mode].generate([arriving], max_tokens=1)
                timeline = engines[mode].interleave(
                    running,
                    running_tokens,
                    incoming,
                    arrive_after=args.arrive_after,
                    arriving_tokens=ARRIVING_TOKENS,
                )
                runs[name].append(timeline)
    finally:
        for engine in engines.values():
            engine.close()
        server.stop()
    check(runs, baselines, prefix_tokens)
    if args.dump:
        Path(args.dump).write_text(json.dumps(runs))
    return {name: summary(timelines, args.arrive_after) for name, timelines in runs.items()}


def check(
    runs: dict[str, list[dict[str, Any]]], baselines: list[dict[str, Any]], prefix_tokens: int
) -> None:
    """Same greedy tokens everywhere; the prefix came from the store in both modes."""
    problems = []
    every = [run for timelines in runs.values() for run in timelines]
    if len({tuple(run["running_tokens"]) for run in every}) != 1:
        problems.append("the running request's tokens differ between runs")
    loading = runs["sync"] + runs["async"] + runs["auto"]
    arriving = loading + runs["no_load"] + baselines
    if len({tuple(run["arriving_tokens"]) for run in arriving}) != 1:
        problems.append("the arriving request's tokens differ between runs or from vLLM's own")
    if any(run["arriving_cached_tokens"] < prefix_tokens for run in loading):
        problems.append("the arriving request's prefix was not loaded from the store")
    if problems:
        raise SystemExit("vllm_async: " + "; ".join(problems))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvshare-vllm-async-") as tmp:
        figures = measure(args, Path(tmp))
    if args.json:
        print(json.dumps({name: figures[name] for name in ("no_load", *LOAD_MODES)}))
        return 0
    for name, row in figures.items():
        cells = "  ".join(f"{key} {value}" for key, value in row.items())
        print(f"{name:8} {cells}")
    for mode in ("async", "auto"):
        ratio = figures[mode]["itl_max_ms"] / figures["no_load"]["itl_max_ms"]
        print(f"{mode} max ITL / no-load max ITL: {ratio:.2f} (target <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
