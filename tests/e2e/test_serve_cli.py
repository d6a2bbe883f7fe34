"""`kvshare serve` as a user runs it: dev mode, flags, one-line start-up errors, SIGTERM."""

from __future__ import annotations

import argparse
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cacheserver import cli as serve_cli
from replica_agent.client import BlockClient
from tests.support.repo import REPO
from tests.support.servers import SERVING_RE, ServerProcess, one_line_error, run_cli, write_config


def test_dev_mode_defaults(tmp_path: Path) -> None:
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 50051)) == 0:
            pytest.skip("port 50051 is taken on this machine")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvshare.cli", "serve"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None
        match = SERVING_RE.search(proc.stdout.readline())
        assert match and match.group(1) == "127.0.0.1:50051"
        token_file = tmp_path / "kvshare-data" / "dev.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        with BlockClient("127.0.0.1:50051", token_file.read_text().strip()) as client:
            assert client.put("dev", "m", [b"d" * 32], [b"payload"]) == [True]
            assert client.get("dev", "m", [b"d" * 32]) == [b"payload"]
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_dev_token_is_created_once(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(data_dir))
    token = (data_dir / "dev.token").read_text()
    assert first.terminate()[0] == 0
    second = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(data_dir))
    assert (data_dir / "dev.token").read_text() == token
    second.terminate()


def test_sigterm_drains_and_closes_cleanly(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    server = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(data_dir))
    token = (data_dir / "dev.token").read_text().strip()
    with BlockClient(server.address, token) as client:
        client.put("dev", "m", [b"a" * 32], [b"x" * 100_000])
    code, out = server.terminate()
    assert code == 0 and "stopped cleanly" in out
    server = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(data_dir))
    with BlockClient(server.address, token) as client:
        assert client.get("dev", "m", [b"a" * 32]) == [b"x" * 100_000]
    server.terminate()


def test_non_loopback_listen_without_tls_is_refused(tmp_path: Path) -> None:
    line = one_line_error(
        run_cli("serve", "--listen", "0.0.0.0:0", "--data-dir", str(tmp_path / "d"))
    )
    assert "without TLS" in line and "--allow-insecure-listen" in line


def test_port_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    server = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "one"))
    try:
        line = one_line_error(
            run_cli("serve", "--listen", server.address, "--data-dir", str(tmp_path / "two"))
        )
        assert "port is in use" in line and "--listen" in line
    finally:
        server.terminate()


def test_data_dir_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    server = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"))
    try:
        line = one_line_error(
            run_cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"))
        )
        assert "in use by another kvshare server" in line
    finally:
        server.terminate()


def test_unwritable_data_dir_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    line = one_line_error(
        run_cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(blocker / "data"))
    )
    assert "not writable" in line and "--data-dir" in line


def test_bad_config_names_the_key_and_its_line(tmp_path: Path) -> None:
    tenancy = write_config(tmp_path)
    text = tenancy.path.read_text().replace(
        'actions = ["read", "write"]', 'acions = ["read", "write"]', 1
    )
    tenancy.path.write_text(text)
    line_no = text.splitlines().index('acions = ["read", "write"]') + 1
    line = one_line_error(run_cli("serve", "--config", str(tenancy.path)))
    assert f"kvshare.toml:{line_no}: principals[0].acions: unknown key" in line


def test_help_documents_every_flag() -> None:
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help text"
            assert action.option_strings[0] in result.stdout


def test_the_naming_secret_is_owner_only_and_can_live_outside_the_data_dir(
    tmp_path: Path,
) -> None:
    from tests.support.servers import launch

    secret = tmp_path / "keys" / "kvshare.secret"
    secret.parent.mkdir()
    tenancy = write_config(tmp_path, extra=f'secret_file = "{secret}"\n')
    digest = b"s" * 32
    with launch(tenancy) as running, running.client("a") as client:
        client.put("alpha", "m", [digest], [b"payload"])
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not (running.data_dir / "server.secret").exists()  # not in the data dir's backups
    with launch(tenancy) as running, running.client("a") as client:  # control: same names
        assert client.get("alpha", "m", [digest]) == [b"payload"]
    secret.chmod(0o640)
    line = one_line_error(run_cli("serve", "--config", str(tenancy.path)))
    assert "readable by group or others; chmod 600" in line


def test_the_default_secret_file_is_owner_only(tmp_path: Path) -> None:
    server = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"))
    try:
        assert stat.S_IMODE((tmp_path / "d" / "server.secret").stat().st_mode) == 0o600
    finally:
        server.terminate()
