"""`kvshare serve` reloads on SIGHUP (it used to die of the signal's default action) and
on `kvshare admin reload`, a real child process each time."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from replica_agent.client import BlockClient
from tests.support.reload import MODEL, Grant, LiveConfig, digest, seconds_until
from tests.support.repo import REPO
from tests.support.servers import ServerProcess


def three(directory: Path) -> LiveConfig:
    return LiveConfig(
        directory,
        {"alpha": 0},
        {
            "a": Grant(["alpha"], ["read", "write"]),
            "root": Grant(["alpha"], ["read", "admin"]),
        },
    )


def can_read(address: str, token: str) -> bool:
    with BlockClient(address, token, bulk=False, timeout_s=5) as c:
        try:
            c.lookup("alpha", MODEL, [digest("x", 0)])
        except Exception:
            return False
    return True


def admin_reload(address: str, token_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "admin", "reload", "--address", address,
         "--token-file", str(token_file)],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False,
    )  # fmt: skip


def test_sighup_reloads_and_never_kills_the_server(tmp_path: Path) -> None:
    live = three(tmp_path)
    live.write()
    server = ServerProcess("--config", str(live.path))
    try:
        assert can_read(server.address, live.principals["a"].token)
        live.principals["new"] = Grant(["alpha"], ["read"])
        live.write()
        server.proc.send_signal(signal.SIGHUP)
        seconds_until(lambda: can_read(server.address, live.principals["new"].token))
        assert server.proc.poll() is None
        # A broken file: refused, logged in one line, the server and its principals serve
        # on. (The admin call after the signal waits for the signal's reload to finish.)
        live.write(live.text() + "[[tenants]\n")
        server.proc.send_signal(signal.SIGHUP)
        root_token = tmp_path / "root.token"
        root_token.write_text(live.principals["root"].token)
        assert admin_reload(server.address, root_token).returncode == 1
        assert can_read(server.address, live.principals["new"].token)
        assert server.proc.poll() is None
    finally:
        server.proc.send_signal(signal.SIGTERM)
        _, log = server.proc.communicate(timeout=60)
    assert server.proc.returncode == 0
    refused = [line for line in log.splitlines() if "config reload refused" in line]
    assert len(refused) == 2, log
    assert all("kvshare.toml:" in line and "not valid TOML" in line for line in refused)


@pytest.mark.slow
def test_admin_reload_prints_the_outcome(tmp_path: Path) -> None:
    live = three(tmp_path)
    live.write()
    root_token = tmp_path / "root.token"
    root_token.write_text(live.principals["root"].token)
    a_token = tmp_path / "a.token"
    a_token.write_text(live.principals["a"].token)
    server = ServerProcess("--config", str(live.path))
    try:
        live.tenants["beta"] = 0
        live.write()
        done = admin_reload(server.address, root_token)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("reloaded: generation 2: tenants added: beta")
        live.write(live.text().replace("listen = ", 'listen = "127.0.0.1:1"\n#'))
        refused = admin_reload(server.address, root_token)
        assert refused.returncode == 1
        assert refused.stderr.count("\n") == 1
        assert "refused (generation 2 keeps serving)" in refused.stderr
        assert "kvshare.toml:2: listen: changed; needs a restart" in refused.stderr
        denied = admin_reload(server.address, a_token)  # not an admin
        assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
    finally:
        server.terminate()
