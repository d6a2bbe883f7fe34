"""The code tour stays true: docs/architecture.md's hop lists are what a trace finds.

docs/architecture.md ("Counting hops") defines a hop; this file traces it. A real server
runs in this process (port 0, LMDB in tmp_path) with a profile function on each of its
threads (`threading.setprofile` before it starts: every thread it starts has it), and a
real client makes one warm GET and one PUT of two blocks over each transport: gRPC, the
bulk channel over TCP (served by the ready loop) and the same-host arena. While a call
runs, every Python function entered on a server thread is recorded with its stack. A
bulk worker runs in a process of its own: it is traced there, through a
`sitecustomize.py` its Python imports from PYTHONPATH (WORKER_HOOK), no product code.

The request's events are those on a thread that entered a hop in `cacheserver/core/`
during the call, whose stack holds a frame of `cacheserver/transport/` or `cacheserver/core/`
(the ready loop looking up from epoll, the reaper, the writer, the health probe and the
like are not the request). Walking each event's stack from its outermost frame, every
module of `cacheserver/` not listed as named inside a hop becomes a hop the first time
it appears: the hops, in the order the request reaches them. The call ends when its
span ends (`ServerTelemetry._finish_rpc`), after the reply is sent.

The test parses the doc's lists (a `<!-- hops: VERB TRANSPORT -->` marker, then a
numbered list whose items open with the module's path in backticks) and the list of
modules named inside a hop (`<!-- hops: named-inside -->`), and asserts the traced
hops equal the documented ones, naming what was traced in each module on a mismatch.
"""

from __future__ import annotations

import fnmatch
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from cacheserver.transport.bulk.delegation import REDELEGATE_AFTER_READS
from replica_agent.client import BlockClient
from tests.support.servers import TEST_BULK_WORKERS, TRANSPORTS, Running, launch, write_config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PRODUCT = str(ROOT / "cacheserver") + os.sep
REQUEST_PACKAGES = ("cacheserver/transport/", "cacheserver/core/")
END_OF_CALL = ("cacheserver/telemetry.py", "ServerTelemetry._finish_rpc")
MODEL = "m;fp32;L2"
BLOCK_BYTES = 64 << 10
VERBS = ("get", "put")


# -- the doc's lists ------------------------------------------------------------------

MARKER = re.compile(r"<!-- hops: ([\w-]+)(?: ([\w-]+))? -->")
ITEM = re.compile(r"^\d+\. `([^`]+)`")


@dataclass
class Tour:
    """What docs/architecture.md says: the hop lists by (verb, transport), the modules
    named inside a hop, and the packages that count as one hop."""

    lists: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    inside: list[str] = field(default_factory=list)
    packages: list[str] = field(default_factory=list)


def documented() -> Tour:
    tour = Tour()
    lines = DOC.read_text().splitlines()
    for at, line in enumerate(lines):
        marker = MARKER.search(line)
        if marker is None:
            continue
        listed = _list_after(lines, at + 1)
        named = [p for item in listed for p in re.findall(r"`([^`]+/[^`]*)`", item)]
        if marker.group(1) == "named-inside":
            tour.inside = named
        elif marker.group(1) == "one-hop":
            tour.packages = named
        else:
            tour.lists[(marker.group(1), marker.group(2) or "")] = [
                m.group(1) for item in listed if (m := ITEM.match(item))
            ]
    return tour


def _list_after(lines: list[str], start: int) -> list[str]:
    """The items of the list that starts at or just after `start`, each with its
    continuation lines."""
    items: list[str] = []
    for line in lines[start:]:
        if not line.strip():
            if items:
                break
            continue
        if re.match(r"^(\d+\.|-) ", line):
            items.append(line)
        elif items and line.startswith(" "):
            items[-1] += " " + line.strip()
        else:
            break
    return items


def named_inside(path: str, patterns: list[str]) -> bool:
    return any(
        path.startswith(p) if p.endswith("/") else fnmatch.fnmatch(path, p) for p in patterns
    )


# -- the trace ------------------------------------------------------------------------


@dataclass
class Event:
    thread: int
    stack: tuple[tuple[str, str], ...]  # (path, qualname) of cacheserver frames, outer first


@dataclass
class Tracer:
    """The profile function every server thread runs; records only while armed."""

    caller: int = field(default_factory=threading.get_ident)
    armed: bool = False
    events: list[Event] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.armed or event != "call" or not frame.f_code.co_filename.startswith(PRODUCT):
            return
        thread = threading.get_ident()
        if thread == self.caller:
            return
        stack: list[tuple[str, str]] = []
        walked: FrameType | None = frame
        while walked is not None:
            code = walked.f_code
            if code.co_filename.startswith(PRODUCT):
                path = os.path.relpath(code.co_filename, ROOT)
                stack.append((path, code.co_qualname))
            walked = walked.f_back
        stack.reverse()
        self.events.append(Event(thread, tuple(stack)))
        if stack[-1] == END_OF_CALL:
            self.ended.set()

    def start(self) -> None:
        self.events = []
        self.ended.clear()
        self.armed = True

    def stop(self) -> list[Event]:
        if not self.ended.wait(30):
            self.armed = False
            raise AssertionError(f"the call's span never ended ({END_OF_CALL} not entered)")
        self.armed = False
        return self.events


@dataclass
class Hop:
    path: str
    entered: list[str] = field(default_factory=list)  # qualnames, in order


def hops(events: list[Event], tour: Tour) -> list[Hop]:
    """The request's hops (the module docstring says how)."""
    serving = {
        e.thread
        for e in events
        if any(
            p.startswith("cacheserver/core/") and not named_inside(p, tour.inside)
            for p, _ in e.stack
        )
    }
    found: dict[str, Hop] = {}
    for event in events:
        if event.thread not in serving:
            continue
        if not any(p.startswith(REQUEST_PACKAGES) for p, _ in event.stack):
            continue
        for path, qualname in event.stack:
            if named_inside(path, tour.inside):
                continue
            unit = next((p for p in tour.packages if path.startswith(p)), path)
            hop = found.setdefault(unit, Hop(unit))
            name = qualname if unit == path else f"{path.removeprefix(unit)}:{qualname}"
            if name not in hop.entered:
                hop.entered.append(name)
    return list(found.values())


def describe(traced: list[Hop]) -> str:
    return "\n".join(
        f"  {n}. {hop.path}: {', '.join(hop.entered)}" for n, hop in enumerate(traced, 1)
    )


def compare(documented_paths: list[str], traced: list[Hop]) -> str | None:
    """None when the trace and the doc agree; else what differs, by name."""
    traced_paths = [hop.path for hop in traced]
    if traced_paths == documented_paths:
        return None
    extra = [p for p in traced_paths if p not in documented_paths]
    missing = [p for p in documented_paths if p not in traced_paths]
    lines = [
        f"traced {len(traced_paths)} hops, the tour lists {len(documented_paths)}",
        f"traced, not in the tour: {extra}" if extra else "",
        f"in the tour, not traced: {missing}" if missing else "",
        "" if extra or missing else "same hops, another order",
        "traced:",
        describe(traced),
    ]
    return "\n".join(line for line in lines if line)


# -- the server and the calls ---------------------------------------------------------


@dataclass
class Traced:
    running: Running
    tracer: Tracer
    clients: dict[str, BlockClient]
    digests: list[bytes]
    payloads: list[bytes]
    puts: int = 0


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    """A server whose every thread runs the tracer, with two blocks stored, and one
    warm client per transport (each has made a put and a get already)."""
    if TEST_BULK_WORKERS > 1:
        pytest.skip("bulk workers serve in processes of their own, which this trace cannot see")
    tracer = Tracer()
    threading.setprofile(tracer)  # until the end: the server starts threads as it needs them
    try:
        with launch(write_config(tmp_path_factory.mktemp("tour"))) as running:
            yield from _warm(running, tracer)
    finally:
        threading.setprofile(None)


def _warm(running: Running, tracer: Tracer) -> Iterator[Traced]:
    digests = [bytes([n]) * 32 for n in range(2)]
    payloads = [bytes([n + 1]) * BLOCK_BYTES for n in range(2)]
    clients = {name: running.client("a", transport=name) for name in TRANSPORTS}
    try:
        for client in clients.values():
            client.put("alpha", MODEL, digests, payloads)
            assert [bytes(b) for b in client.get("alpha", MODEL, digests)] == payloads
        yield Traced(running, tracer, clients, digests, payloads)
    finally:
        for client in clients.values():
            client.close()


def trace(setup: Traced, verb: str, transport: str) -> list[Event]:
    """One warm call, traced: a GET of the two stored blocks, or a PUT of two new ones."""
    client = setup.clients[transport]
    if verb == "put":
        setup.puts += 1
        digests = [bytes([0x80 + setup.puts, n]) * 16 for n in range(2)]
        setup.tracer.start()
        stored = client.put("alpha", MODEL, digests, setup.payloads)
        events = setup.tracer.stop()
        assert stored == [True, True], stored
    else:
        setup.tracer.start()
        got = [bytes(b) for b in client.get("alpha", MODEL, setup.digests)]
        events = setup.tracer.stop()
        assert got == setup.payloads
    return events


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("verb", VERBS)
def test_the_tour_lists_the_traced_hops(traced: Traced, verb: str, transport: str) -> None:
    tour = documented()
    listed = tour.lists.get((verb, transport))
    assert listed is not None, f"docs/architecture.md has no hop list for {verb} {transport}"
    difference = compare(listed, hops(trace(traced, verb, transport), tour))
    assert difference is None, f"{verb.upper()} over {transport}: {difference}"


# -- the bulk worker, a process of its own ---------------------------------------------

# Imported at start-up by every Python process that has it on PYTHONPATH: the bulk
# workers the server starts inherit the test's environment. While the flag file exists
# it writes each cacheserver function entered, with its stack, to a file per process.
WORKER_HOOK = r"""
import os, sys, threading
_out = os.environ.get("KVSHARE_TOUR_TRACE")
if _out:
    _root = os.environ["KVSHARE_TOUR_ROOT"]
    _product = os.path.join(_root, "cacheserver", "")
    _armed = _out + ".armed"
    _file = open(f"{_out}.{os.getpid()}", "a", buffering=1)

    def _hook(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(_product):
            return
        if not os.path.exists(_armed):
            return
        stack = []
        walked = frame
        while walked is not None:
            code = walked.f_code
            if code.co_filename.startswith(_product):
                path = os.path.relpath(code.co_filename, _root)
                stack.append(f"{path}:{code.co_qualname}")
            walked = walked.f_back
        stack.reverse()
        _file.write(f"{threading.get_ident()}\t{' '.join(stack)}\n")

    sys.setprofile(_hook)
    threading.setprofile(_hook)
"""
WORKER_END = "cacheserver/transport/bulk/readyloop.py:ReadyLoop._park"  # served, parked again


@dataclass
class WorkerTrace:
    running: Running
    client: BlockClient
    out: Path
    digests: list[bytes]
    payloads: list[bytes]

    def get(self) -> list[Event]:
        """One warm GET the worker serves, traced in the worker."""
        for old in self.out.parent.glob(f"{self.out.name}.*"):
            old.write_text("")
        armed = Path(f"{self.out}.armed")
        armed.touch()
        try:
            got = [bytes(b) for b in self.client.get("alpha", MODEL, self.digests)]
            assert got == self.payloads
            lines = self._lines_until_parked()
        finally:
            armed.unlink()
        events = []
        for line in lines:
            thread, _, stack = line.partition("\t")
            frames = tuple(tuple(f.split(":", 1)) for f in stack.split(" "))
            events.append(Event(int(thread), frames))  # type: ignore[arg-type]
        return events

    def _lines_until_parked(self) -> list[str]:
        for _ in range(300):
            lines = [
                line
                for f in sorted(self.out.parent.glob(f"{self.out.name}.[0-9]*"))
                for line in f.read_text().splitlines()
            ]
            if any(line.endswith(WORKER_END) for line in lines):
                return lines
            threading.Event().wait(0.1)
        raise AssertionError("no bulk worker served the GET (no trace of it in a worker)")


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerTrace]:
    """A server with one bulk worker whose process runs WORKER_HOOK, two blocks in
    LMDB (the worker reads only what LMDB holds), and a warm client whose connection
    the worker serves (the server keeps the first plain-TCP connection, the worker
    gets the second: tests/e2e/test_bulk_workers.py)."""
    tmp = tmp_path_factory.mktemp("tour-worker")
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(WORKER_HOOK)
    out = tmp / "trace"
    with pytest.MonkeyPatch.context() as env:
        path = os.environ.get("PYTHONPATH")
        env.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(hook), path) if p))
        env.setenv("KVSHARE_TOUR_TRACE", str(out))
        env.setenv("KVSHARE_TOUR_ROOT", str(ROOT))
        with launch(write_config(tmp, extra="[bulk]\nworkers = 2\n")) as running:
            first = running.client("a", transport="bulk-tcp")
            client = running.client("a", transport="bulk-tcp")
            try:
                digests = [bytes([n]) * 32 for n in range(2)]
                payloads = [bytes([n + 1]) * BLOCK_BYTES for n in range(2)]
                assert first.get("alpha", MODEL, [bytes(32)]) == []
                assert client.get("alpha", MODEL, [bytes(32)]) == []  # the worker's
                first.put("alpha", MODEL, digests, payloads)
                _wait_for_lmdb(running)
                # A connection whose read was handed back goes back to the worker once
                # its last REDELEGATE_AFTER_READS requests were reads.
                for _ in range(REDELEGATE_AFTER_READS + 2):
                    assert len(client.get("alpha", MODEL, digests)) == 2
                yield WorkerTrace(running, client, out, digests, payloads)
            finally:
                first.close()
                client.close()


def _wait_for_lmdb(running: Running) -> None:
    for _ in range(300):
        if running.store.undrained_blocks == 0:
            return
        threading.Event().wait(0.1)
    raise AssertionError("the journaled blocks never reached LMDB")


def test_the_tour_lists_the_workers_hops(worker: WorkerTrace) -> None:
    """A warm GET a bulk worker answers (a worker answers reads only: a PUT it hands
    back to the server, whose hops are those of bulk-tcp)."""
    tour = documented()
    listed = tour.lists.get(("get", "bulk-worker"))
    assert listed is not None, "docs/architecture.md has no hop list for get bulk-worker"
    difference = compare(listed, hops(worker.get(), tour))
    assert difference is None, f"GET over a bulk worker: {difference}"


def test_the_tour_names_real_modules() -> None:
    """Every documented hop names a module or package that exists, and so does every
    named-inside pattern."""
    tour = documented()
    assert tour.lists and tour.inside and tour.packages
    for listed in tour.lists.values():
        for path in listed:
            assert (ROOT / path).is_file() or path in tour.packages, path
    for package in tour.packages:
        assert (ROOT / package / "__init__.py").is_file(), package
    for pattern in tour.inside:
        base = pattern.rstrip("/") if pattern.endswith("/") else pattern
        assert list(ROOT.glob(base)), pattern


def test_the_table_counts_the_lists() -> None:
    """The doc's table of counts says, after its arrow, how long each list is now."""
    tour = documented()
    columns = ("grpc", "bulk-tcp", "bulk-same-host", "bulk-worker")
    rows = [
        line.split("|")[1:-1]
        for line in DOC.read_text().splitlines()
        if re.match(r"^\| (GET|PUT) ", line)
    ]
    assert len(rows) == 2, "docs/architecture.md: the table of traced hops is not found"
    for cells in rows:
        verb = cells[0].strip().lower()
        for transport, cell in zip(columns, cells[1:], strict=True):
            now = cell.split("→")[-1].strip()
            if now.isdigit():
                assert int(now) == len(tour.lists[(verb, transport)]), (verb, transport, cell)
            else:
                assert (verb, transport) not in tour.lists, (verb, transport, cell)


def test_an_added_hop_is_named() -> None:
    """The comparison names an extra hop (the positive control of the check itself)."""
    traced_hops = [Hop("cacheserver/a.py", ["A.get"]), Hop("cacheserver/b.py", ["B.get"])]
    assert compare(["cacheserver/a.py", "cacheserver/b.py"], traced_hops) is None
    difference = compare(["cacheserver/a.py"], traced_hops)
    assert difference is not None and "cacheserver/b.py" in difference and "B.get" in difference
