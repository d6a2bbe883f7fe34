"""The two-host rig itself: made, reachable only inside, removed, leftovers cleaned."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvshare.bench import netns
from kvshare.bench.netns import RigError, TwoHosts
from tests.support.repo import REPO
from tests.support.twohost import namespaces

ECHO_SERVER = (
    "import socket; s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(); "
    "print('ready', flush=True); c, _ = s.accept(); c.sendall(c.recv(5))"
)
ECHO_CLIENT = (
    "import socket; c = socket.create_connection(('198.18.0.1', 7000), timeout=5); "
    "c.sendall(b'hello'); print(c.recv(5).decode())"
)
HOLD_A_RIG = (
    "from kvshare.bench import netns; import time\n"
    "with netns.two_hosts() as rig:\n"
    "    print(rig.server.namespace, rig.client.namespace, flush=True); time.sleep(600)\n"
)


def test_the_client_reaches_the_server_over_the_veth_and_nothing_else(rig: TwoHosts) -> None:
    server = subprocess.Popen(
        rig.server.command([sys.executable, "-c", ECHO_SERVER]), stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        echoed = subprocess.run(
            rig.client.command([sys.executable, "-c", ECHO_CLIENT]),
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        assert echoed.stdout.strip() == "hello"
    finally:
        server.wait(timeout=30)
    for host in (rig.server, rig.client):  # no default route: nothing outside is reachable
        routes = subprocess.run(
            ["ip", "-n", host.namespace, "route", "show"], capture_output=True, text=True
        ).stdout
        assert routes.split() == [
            "198.18.0.0/24", "dev", host.namespace, "proto", "kernel", "scope", "link",
            "src", host.address,
        ]  # fmt: skip
    with pytest.raises(RigError, match="not inside namespace"):
        rig.client.require_current()  # this test process is in the machine's namespace


def test_everything_made_is_removed_with_the_processes_inside(tmp_path: Path) -> None:
    if netns.unavailable_reason() is not None:
        pytest.skip(netns.unavailable_reason() or "")
    with netns.two_hosts() as rig:
        made = {rig.server.namespace, rig.client.namespace}
        assert made <= namespaces()
        sleeper = subprocess.Popen(rig.server.command(["sleep", "600"]))
        deadline = time.monotonic() + 10
        while not rig.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rig.pids() == [sleeper.pid]  # `ip netns exec` became the command itself
    assert not made & namespaces()
    assert sleeper.wait(timeout=10) == -signal.SIGTERM


def test_leftovers_of_a_killed_run_are_removed_and_live_rigs_kept(rig: TwoHosts) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_RIG], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    left = set(holder.stdout.readline().split())
    assert len(left) == 2 and left <= namespaces()
    assert not left & set(netns.remove_leftovers())  # its creator still runs: kept
    holder.send_signal(signal.SIGKILL)  # no `finally` runs: the namespaces stay
    holder.wait(timeout=10)
    assert left <= namespaces()
    assert left <= set(netns.remove_leftovers())
    assert not left & namespaces()
    assert {rig.server.namespace, rig.client.namespace} <= namespaces()  # ours: alive


def test_without_root_or_iproute2_the_reason_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns._probe() == "network namespaces need root (CAP_NET_ADMIN); CI runs as root"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    assert "apt-get install -y iproute2" in (netns._probe() or "")
