"""Two hosts on one machine: network namespaces joined by a veth pair.

Used by `kvshare bench --two-host` and by the two-host tests. `two_hosts()` makes a
`server` and a `client` namespace, each with its own loopback and one end of a veth
pair, addressed from 198.18.0.0/15 (RFC 2544's range for benchmarking). Neither
namespace has a route anywhere else, so nothing outside the pair is ever reached.

Everything made carries one token, `kv<creator pid, hex>x<4 hex>`, in its names (the
namespaces `<token>s` and `<token>c`, the veth ends likewise; 14 characters, within
Linux's 15 for an interface name). The context manager removes it all on the way out,
processes still running inside included; `remove_leftovers()` removes what a run
that was killed left behind (its creator pid no longer runs). Parallel runs never
share a name.

Root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2's `ip` are needed; `unavailable_reason()`
says what is missing, so tests can skip and the bench can refuse with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SERVER_ADDRESS = "198.18.0.1"
CLIENT_ADDRESS = "198.18.0.2"
PREFIX_LENGTH = 24
BENCHMARK_NETWORK = ipaddress.ip_network("198.18.0.0/15")
NAME_RE = re.compile(r"^kv([0-9a-f]{1,6})x[0-9a-f]{4}[sc]$")
CLONE_NEWNET = 0x40000000
IP_TIMEOUT_S = 30.0
NETNS_DIR = Path("/run/netns")  # where `ip netns add` mounts named namespaces
_probe_result: list[str | None] = []  # memo of unavailable_reason()


class RigError(RuntimeError):
    """The namespaces could not be made (the message says why)."""


@dataclass(frozen=True)
class Host:
    """One side: a network namespace and its address on the veth."""

    namespace: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def is_current(self) -> bool:
        """Whether the calling thread is inside this namespace."""
        here = Path("/proc/thread-self/ns/net").stat()
        try:
            there = (NETNS_DIR / self.namespace).stat()
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)

    def require_current(self) -> None:
        """Refuse to go on outside this namespace: the machine's own namespace may route
        198.18.0.0/15 somewhere real, and a test or benchmark must never reach it."""
        if not self.is_current():
            raise RigError(f"this thread is not inside namespace {self.namespace}")

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Move the calling thread into this namespace, and back on exit. Sockets this
        thread opens meanwhile, and processes it starts, live in the namespace. Use it
        only on a thread that owns its sockets (not one shared with gRPC's threads)."""
        libc = _libc()
        original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(NETNS_DIR / self.namespace, os.O_RDONLY)
            try:
                if libc.setns(target, CLONE_NEWNET) != 0:
                    raise RigError(
                        f"setns into {self.namespace}: {os.strerror(ctypes.get_errno())}"
                    )
            finally:
                os.close(target)
            self.require_current()
            try:
                yield
            finally:
                if libc.setns(original, CLONE_NEWNET) != 0:
                    raise RigError(f"setns back: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(original)


@dataclass(frozen=True)
class TwoHosts:
    server: Host
    client: Host

    def pids(self) -> list[int]:
        """Processes running inside either namespace now."""
        return [pid for host in (self.server, self.client) for pid in _pids_in(host.namespace)]


def unavailable_reason() -> str | None:
    """Why two-host rigs cannot be made here, or None. Probed once per process by
    making (and removing) a namespace pair."""
    if not _probe_result:
        _probe_result.append(_probe())
    return _probe_result[0]


def _probe() -> str | None:
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); CI runs as root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (Debian: apt-get install -y iproute2)"
    try:
        with two_hosts():
            pass
    except RigError as error:
        return f"cannot make network namespaces here: {error}"
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """A server and a client namespace joined by a veth pair; removed on exit."""
    remove_leftovers()
    token = f"kv{os.getpid():x}x{secrets.token_hex(2)}"
    rig = TwoHosts(Host(f"{token}s", SERVER_ADDRESS), Host(f"{token}c", CLIENT_ADDRESS))
    try:
        _create(rig)
        yield rig
    finally:
        _remove(token)


def _create(rig: TwoHosts) -> None:
    server, client = rig.server, rig.client
    for host in (server, client):
        _ip("netns", "add", host.namespace)
    # The veth ends are made inside the namespaces at once, so none is ever in the
    # caller's namespace (where a killed run would leave it).
    _ip(
        "link", "add", server.namespace, "netns", server.namespace, "type", "veth",
        "peer", "name", client.namespace, "netns", client.namespace,
    )  # fmt: skip
    for host in (server, client):
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/{PREFIX_LENGTH}",
            "dev", host.namespace)  # fmt: skip
        _ip("-n", host.namespace, "link", "set", host.namespace, "up")
    _wait_until_reachable(rig)


def _wait_until_reachable(rig: TwoHosts, timeout_s: float = 10.0) -> None:
    """IPv4 addresses are usable at once, but the link needs a moment to come up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _ip("-n", rig.client.namespace, "-o", "link", "show", rig.client.namespace)
        if "LOWER_UP" in state and ",UP" in state:
            return
        time.sleep(0.05)
    raise RigError("the veth pair did not come up within 10 s")


def add_address(host: Host, address: str) -> None:
    """A further address for `host` on its veth (e.g. a second interface's address)."""
    if ipaddress.ip_address(address) not in BENCHMARK_NETWORK:
        raise ValueError(f"{address} is outside 198.18.0.0/15")
    _ip("-n", host.namespace, "addr", "add", f"{address}/{PREFIX_LENGTH}", "dev", host.namespace)
    _ip("-n", host.namespace, "route", "replace", f"{address}/32", "dev", host.namespace)


def _remove(token: str) -> None:
    """End the processes inside the namespaces of `token`, then remove them (which
    removes the veth ends in them)."""
    names = [f"{token}s", f"{token}c"]
    existing = [name for name in names if (NETNS_DIR / name).exists()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [pid for name in existing for pid in _pids_in(name)]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if _wait_gone(pids, timeout_s=5.0):
            break
    for name in existing:
        _ip("netns", "delete", name, check=False)


def remove_leftovers() -> list[str]:
    """Remove the namespaces (and stray veth ends) of rigs whose creator no longer
    runs; return their names. Rigs of live processes are left alone."""
    removed = []
    listing = _ip("netns", "list", check=False)
    links = _ip("-o", "link", "show", "type", "veth", check=False)
    names = {line.split()[0] for line in listing.splitlines() if line.strip()}
    names |= {m.group(1) for m in re.finditer(r"^\d+: ([^:@\s]+)", links, re.MULTILINE)}
    for name in sorted(names):
        match = NAME_RE.match(name)
        if match is None or _is_running(int(match.group(1), 16)):
            continue
        if (NETNS_DIR / name).exists():
            _remove(name[:-1])
        else:
            _ip("link", "delete", name, check=False)
        removed.append(name)
    return removed


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_gone(pids: Sequence[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_is_running(pid) and not _is_zombie(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _pids_in(namespace: str) -> list[int]:
    output = _ip("netns", "pids", namespace, check=False)
    return [int(word) for word in output.split() if word.isdigit()]


def _ip(*args: str, check: bool = True) -> str:
    try:
        result = subprocess.run(
            ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RigError(f"ip {' '.join(args)}: {error}") from None
    if check and result.returncode != 0:
        raise RigError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
