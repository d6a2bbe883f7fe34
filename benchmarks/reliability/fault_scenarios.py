"""Fault-injection scenarios for benchmarks/faults.py, each against real `kvshare serve`
processes in a directory of its own. A scenario returns `Outcome`: passed, a detail
line (what was seen, in numbers), or a reason it was skipped (not root, no tool).

What each checks is in its docstring; what is common: an acknowledged block is never
lost or served with other bytes, a refused put says what to do, reads go on, and the
server recovers without a restart once the fault is gone.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.reliability.harness import (
    PrincipalSpec,
    ServerProc,
    Tenancy,
    TenantSpec,
    write_tenancy,
)
from replica_agent.client import BlockClient, BlockStoreError

MODEL = "faults/model@r1;L4"
MiB = 1 << 20
TENANTS = [TenantSpec("alpha", 0), TenantSpec("beta", 0)]
PRINCIPALS = [
    PrincipalSpec("a", ("alpha",), ("read", "write")),
    PrincipalSpec("b", ("beta",), ("read", "write")),
    PrincipalSpec("root", ("alpha", "beta"), ("read", "write", "admin")),
]


@dataclass
class Outcome:
    passed: bool | None  # None: skipped
    detail: str
    acknowledged_lost: int = 0
    torn_served: int = 0
    kill9_cycles: int = 0


@dataclass
class Env:
    """A scenario's directory and its private journal directory."""

    directory: Path
    journal_dir: Path
    servers: list[ServerProc] = field(default_factory=list)

    def config(
        self,
        storage: Mapping[str, int | bool | str] | None = None,
        tokens: Mapping[str, str] | None = None,
    ) -> Tenancy:
        settings = {"journal_dir": str(self.journal_dir), **(storage or {})}
        return write_tenancy(self.directory, TENANTS, PRINCIPALS, storage=settings, tokens=tokens)

    def start(
        self, tenancy: Tenancy, env: dict[str, str] | None = None, *, max_descriptors: int = 0
    ) -> ServerProc:
        server = ServerProc(
            tenancy.path, self.directory / "server.log", env=env, max_descriptors=max_descriptors
        )
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in self.servers:
            if server.alive():
                with contextlib.suppress(RuntimeError):
                    server.terminate(timeout_s=30)


def block(digest: bytes, size: int) -> bytes:
    import hashlib

    return hashlib.shake_256(digest).digest(size)


def put_one(client: BlockClient, tenant: str, digest: bytes, size: int) -> list[bool]:
    """Put one block of `size` named `digest`, with the bytes `block` derives from it."""
    return client.put(tenant, MODEL, [digest], [block(digest, size)])


def check_blocks(
    client: BlockClient, tenant: str, digests: list[bytes], size: int
) -> tuple[int, int]:
    """(missing, wrong bytes) among `digests` of `tenant`, in batches."""
    missing = wrong = 0
    for start in range(0, len(digests), 256):
        batch = digests[start : start + 256]
        got = client.get(tenant, MODEL, batch)
        wrong += sum(1 for d, b in zip(batch, got, strict=False) if b != block(d, size))
        for d in batch[len(got) :]:  # a get stops at the first miss: ask for the rest one by one
            one = client.get(tenant, MODEL, [d])
            if not one:
                missing += 1
            elif one[0] != block(d, size):
                wrong += 1
    return missing, wrong


def status_of(call: Callable[[], object]) -> tuple[str, str]:
    try:
        call()
    except BlockStoreError as error:
        return error.code().name, error.details()
    return "OK", ""


# -- kill -9 under a write load ------------------------------------------------------


def kill9_cycles(env: Env, cycles: int) -> Outcome:
    """`cycles` times: a writer puts blocks without pause, the server is killed with -9
    at a random moment, restarted (the put journal on in even cycles, off in odd), and
    every block acknowledged in any cycle so far is fetched and compared."""
    import threading

    rng = random.Random(7)
    size = 8 << 10  # small: every cycle re-reads every block acknowledged so far
    acked: list[bytes] = []
    lost = torn = 0
    tenancy = env.config({"journal_bytes": 16 * MiB})
    for cycle in range(cycles):
        storage = {"journal_bytes": 16 * MiB if cycle % 2 == 0 else 0, "drain_idle_ms": 100}
        tenancy = env.config(storage, tokens=tenancy.tokens)
        server = env.start(tenancy)
        with BlockClient(server.address, tenancy.tokens["a"]) as client:
            missing, wrong = check_blocks(client, "alpha", acked, size)
        lost, torn = lost + missing, torn + wrong
        stop = threading.Event()

        def write(
            address: str = server.address, token: str = tenancy.tokens["a"], stop: object = stop
        ) -> None:
            with BlockClient(address, token, timeout_s=5) as writer:
                while not stop.is_set():  # type: ignore[attr-defined]
                    digests = [os.urandom(32) for _ in range(rng.randint(1, 6))]
                    try:
                        writer.put("alpha", MODEL, digests, [block(d, size) for d in digests])
                    except Exception:  # the server died mid-call: not acknowledged
                        return
                    acked.extend(digests)
                    # A steady load, not a flood: every cycle re-reads all blocks so far.
                    time.sleep(0.005)

        thread = threading.Thread(target=write)
        thread.start()
        time.sleep(rng.uniform(0.2, 1.0))
        server.kill9()
        stop.set()
        thread.join()
    server = env.start(tenancy)
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        missing, wrong = check_blocks(client, "alpha", acked, size)
    lost, torn = lost + missing, torn + wrong
    return Outcome(
        lost == 0 and torn == 0,
        f"{cycles} cycles, {len(acked)} acknowledged blocks checked after each restart: "
        f"{lost} missing, {torn} with wrong bytes",
        acknowledged_lost=lost,
        torn_served=torn,
        kill9_cycles=cycles,
    )


# -- full file systems -----------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path)],
        check=True,
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def needs_root() -> str | None:
    if os.geteuid() != 0:
        return "needs root (mounts a small tmpfs)"
    return None


def fill_until_refused(
    client: BlockClient, tenant: str, size: int, limit: int
) -> tuple[list[bytes], str, str]:
    """Put blocks of `size` until one is refused: (acknowledged, status, message)."""
    acked: list[bytes] = []
    for _ in range(limit):
        digest = os.urandom(32)
        code, message = status_of(functools.partial(put_one, client, tenant, digest, size))
        if code != "OK":
            return acked, code, message
        acked.append(digest)
    return acked, "OK", ""


def wait_for_put(client: BlockClient, size: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        digest = os.urandom(32)
        put = lambda d=digest: client.put("alpha", MODEL, [d], [block(d, size)])  # noqa: E731
        if status_of(put)[0] == "OK":
            return True
        time.sleep(0.5)
    return False


def says_what_to_do(message: str, *words: str) -> bool:
    return any(w in message.lower() for w in words)


def disk_full(env: Env) -> Outcome:
    """The data dir on a 96 MiB tmpfs, then filled by another file: puts are refused
    with RESOURCE_EXHAUSTED and a message about space, reads go on with exact bytes,
    and once the other file is gone, puts work again without a restart."""
    reason = needs_root()
    if reason:
        return Outcome(None, reason)
    size = MiB
    with small_tmpfs(env.directory / "fs", 96 * MiB) as fs:
        tenancy = write_tenancy(
            fs,
            TENANTS,
            PRINCIPALS,
            storage={"journal_dir": str(env.journal_dir), "journal_bytes": 16 * MiB},
        )
        server = env.start(tenancy)
        filler = fs / "filler"
        with BlockClient(server.address, tenancy.tokens["a"]) as client:
            first = [os.urandom(32) for _ in range(4)]
            client.put("alpha", MODEL, first, [block(d, size) for d in first])
            free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
            with open(filler, "wb") as f:
                f.truncate(max(0, free - 12 * MiB))
                os.posix_fallocate(f.fileno(), 0, max(1, free - 12 * MiB))
            acked, code, message = fill_until_refused(client, "alpha", size, 200)
            missing, wrong = check_blocks(client, "alpha", first + acked, size)
            filler.unlink()
            recovered = wait_for_put(client, size, 30)
        alive = server.alive()
        server.terminate()
        server = env.start(tenancy)
        with BlockClient(server.address, tenancy.tokens["a"]) as client:
            missing2, wrong2 = check_blocks(client, "alpha", first + acked, size)
        server.terminate()
    clear = says_what_to_do(message, "space", "disk full")
    passed = (
        code == "RESOURCE_EXHAUSTED"
        and clear
        and not (missing + wrong + missing2 + wrong2)
        and recovered
        and alive
    )
    return Outcome(
        passed,
        f"refused after {len(acked)} puts with {code} ({message[:160]!r}); reads: {missing} "
        f"missing, {wrong} wrong; after restart {missing2} missing, {wrong2} wrong; "
        f"puts again once space returned: {recovered}",
        acknowledged_lost=missing + missing2,
        torn_served=wrong + wrong2,
    )


def lmdb_map_full(env: Env) -> Outcome:
    """An LMDB map smaller than the disk budget: puts are refused with
    RESOURCE_EXHAUSTED naming the map, reads go on, nothing acknowledged is lost.
    Without the journal (the refusal comes from the commit itself) and with it. With
    the journal, the blocks it acknowledged cannot reach LMDB either: after kill -9 the
    start must fail saying to raise the map (and keep the journal), and a start with a
    bigger map serves every one of them."""
    details, ok, lost_all, torn_all = [], True, 0, 0
    for journal in (0, 16 * MiB):
        storage = {
            "lmdb_map_bytes": 8 * MiB,
            "disk_budget_bytes": 1 << 30,
            "journal_bytes": journal,
        }
        tenancy = env.config(storage)
        server = env.start(tenancy)
        with BlockClient(server.address, tenancy.tokens["a"]) as client:
            acked, code, message = fill_until_refused(client, "alpha", 256 << 10, 400)
            missing, wrong = check_blocks(client, "alpha", acked, 256 << 10)
        server.kill9()
        refusal = ""
        if journal:  # LMDB still cannot take what the journal holds: the start fails
            refusal = start_refusal(env, tenancy)
            tenancy = env.config({**storage, "lmdb_map_bytes": 64 * MiB}, tenancy.tokens)
        server = env.start(tenancy)
        with BlockClient(server.address, tenancy.tokens["a"]) as client:
            missing2, wrong2 = check_blocks(client, "alpha", acked, 256 << 10)
        server.terminate()
        (env.directory / "data").rename(env.directory / f"data-map-full-{journal}")
        clear = says_what_to_do(message, "lmdb_map_bytes", "map")
        refused_start = not journal or "lmdb_map_bytes" in refusal
        ok &= code == "RESOURCE_EXHAUSTED" and clear and refused_start
        ok &= not (missing + wrong + missing2 + wrong2)
        lost_all, torn_all = lost_all + missing + missing2, torn_all + wrong + wrong2
        details.append(
            f"journal {'on' if journal else 'off'}: refused after {len(acked)} puts with {code} "
            f"({message[:120]!r}); before kill -9 {missing} missing, {wrong} wrong; "
            + (f"restart with the same map refused ({refusal[:160]!r}); " if journal else "")
            + f"after restart {missing2} missing, {wrong2} wrong"
        )
    return Outcome(ok, "; ".join(details), acknowledged_lost=lost_all, torn_served=torn_all)


def start_refusal(env: Env, tenancy: Tenancy) -> str:
    """The error line of a start that must fail ("" if the server started after all)."""
    try:
        server = env.start(tenancy)
    except RuntimeError as failed:
        lines = [x for x in str(failed).splitlines() if "kvshare serve: error:" in x]
        return lines[-1] if lines else str(failed)[-300:]
    server.terminate()
    return ""


def journal_tmpfs_full(env: Env) -> Outcome:
    """The journal's directory on an 8 MiB tmpfs under a 16 MiB journal: a put that
    needs space there is refused with RESOURCE_EXHAUSTED naming the journal (never a
    SIGBUS), reads go on, and the server still stops cleanly."""
    reason = needs_root()
    if reason:
        return Outcome(None, reason)
    with small_tmpfs(env.directory / "jfs", 8 * MiB) as jfs:
        tenancy = write_tenancy(
            env.directory,
            TENANTS,
            PRINCIPALS,
            storage={"journal_dir": str(jfs), "journal_bytes": 16 * MiB},
        )
        server = env.start(tenancy)
        with BlockClient(server.address, tenancy.tokens["a"]) as client:
            acked, code, message = fill_until_refused(client, "alpha", 512 << 10, 100)
            missing, wrong = check_blocks(client, "alpha", acked, 512 << 10)
        alive = server.alive()
        code_stop = server.terminate() if alive else -1
    clear = says_what_to_do(message, "journal")
    passed = (
        code == "RESOURCE_EXHAUSTED"
        and clear
        and alive
        and code_stop == 0
        and not (missing + wrong)
    )
    return Outcome(
        passed,
        f"refused after {len(acked)} puts with {code} ({message[:160]!r}); alive {alive}, "
        f"clean stop {code_stop == 0}; reads {missing} missing, {wrong} wrong",
        acknowledged_lost=missing,
        torn_served=wrong,
    )
