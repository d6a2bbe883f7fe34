"""The bulk listener as deployed: a fixed port (the gRPC port + 1 by default, or
`--bulk-listen`), the announced address (`--bulk-advertise`), and one-line start-up
errors. Loopback only; the same across real hosts is tests/twohost/."""

from __future__ import annotations

import os
import re
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cacheserver.config import ServerConfig
from cacheserver.embedded import EmbeddedServer
from cacheserver.server import TlsFiles
from cacheserver.store.journal import MIN_CAPACITY, Journal
from cacheserver.store.journal.files import JOURNAL_NAME, SHM, remove_journal
from replica_agent.client import BlockClient, ClientTls
from tests.support.certs import TestCA
from tests.support.scrape import Samples, parse, scrape_text, settled, value
from tests.support.servers import ServerProcess, free_port, one_line_error, run_cli

MODEL = "m"
BULK_RE = re.compile(r"kvshare bulk on (\S+) \(announced: (\S+)\)")
METRICS_RE = re.compile(r"metrics on (\S+)")


def free_port_pair() -> int:
    """A loopback port P with P + 1 free as well (a moment ago)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            if port == 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise AssertionError("no two adjacent free loopback ports")


@contextmanager
def serving(tmp_path: Path, *args: str) -> Iterator[tuple[ServerProcess, str, str, str]]:
    """`kvshare serve` (dev mode, metrics on): the server, its bulk line's bound and
    announced addresses, and its metrics address."""
    server = ServerProcess(
        "--data-dir", str(tmp_path / "data"), "--metrics-listen", "127.0.0.1:0", *args
    )
    try:
        assert server.proc.stdout is not None
        bulk_line = server.proc.stdout.readline()  # printed right after "serving on"
        bulk = BULK_RE.search(bulk_line)
        assert bulk, bulk_line
        metrics = [m.group(1) for line in server.startup_lines if (m := METRICS_RE.search(line))]
        yield server, bulk.group(1), bulk.group(2), metrics[0]
    finally:
        server.terminate()


def put_and_get(address: str, token: str) -> None:
    digests = [os.urandom(32) for _ in range(3)]
    payloads = [os.urandom(100_000) for _ in digests]
    with BlockClient(address, token, same_host=False) as client:
        assert client.put("dev", MODEL, digests, payloads) == [True] * 3
        assert client.get("dev", MODEL, digests) == payloads


def calls(samples: Samples, method: str) -> float:
    return value(samples, "kvshare_rpc_requests_total", method=method, status="OK")


def scrape_after(metrics: str, last: str) -> Samples:
    """The counts once the client's `last` call shows (counted after its reply)."""
    call = ("kvshare_rpc_requests_total", (("method", last), ("status", "OK")))
    return settled(lambda: parse(scrape_text(metrics)), {call: 1})


def test_the_default_bulk_port_is_the_grpc_port_plus_one(tmp_path: Path) -> None:
    port = free_port_pair()
    with serving(tmp_path, "--listen", f"127.0.0.1:{port}") as (server, bound, announced, m):
        assert bound == announced == f"127.0.0.1:{port + 1}"
        put_and_get(server.address, (tmp_path / "data" / "dev.token").read_text().strip())
        samples = scrape_after(m, "kvshare.bulk/Get")
        assert calls(samples, "kvshare.bulk/Put") == 1 and calls(samples, "kvshare.bulk/Get") == 1
        assert calls(samples, "kvshare.v1.BlockStore/Put") == 0
        assert calls(samples, "kvshare.v1.BlockStore/Get") == 0


@pytest.mark.slow
def test_a_wildcard_advertise_sends_clients_to_the_host_they_dialed(tmp_path: Path) -> None:
    port = free_port()
    args = ("--listen", "127.0.0.1:0", "--bulk-listen", f"127.0.0.1:{port}",
            "--bulk-advertise", f"0.0.0.0:{port}")  # fmt: skip
    with serving(tmp_path, *args) as (server, bound, announced, metrics):
        assert (bound, announced) == (f"127.0.0.1:{port}", f"0.0.0.0:{port}")
        put_and_get(server.address, (tmp_path / "data" / "dev.token").read_text().strip())
        samples = scrape_after(metrics, "kvshare.bulk/Get")
        assert calls(samples, "kvshare.bulk/Put") == 1 and calls(samples, "kvshare.bulk/Get") == 1
        assert calls(samples, "kvshare.v1.BlockStore/Get") == 0


@pytest.mark.slow
def test_clients_go_where_advertise_says_and_fall_back_to_grpc_when_it_is_wrong(
    tmp_path: Path,
) -> None:
    closed = free_port()  # nothing listens there: the bulk connect is refused
    args = ("--listen", "127.0.0.1:0", "--bulk-advertise", f"127.0.0.1:{closed}")
    with serving(tmp_path, *args) as (server, _bound, announced, metrics):
        assert announced == f"127.0.0.1:{closed}"
        put_and_get(server.address, (tmp_path / "data" / "dev.token").read_text().strip())
        samples = scrape_after(metrics, "kvshare.v1.BlockStore/Get")
        assert calls(samples, "kvshare.v1.BlockStore/OpenBulk") >= 1  # it was told, tried
        assert calls(samples, "kvshare.bulk/Hello") == 0  # ... and never reached the listener
        assert calls(samples, "kvshare.v1.BlockStore/Put") == 1  # nothing lost: over gRPC
        assert calls(samples, "kvshare.v1.BlockStore/Get") == 1


@pytest.fixture
def stale_journal(tmp_path: Path) -> Iterator[Path]:
    """A put journal on /dev/shm whose data dir is gone (a server killed, its data dir
    removed): the next server to open its store removes it and logs that it did, at
    info, before anything else can fail. Removed here if no server took it first."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    gone = tmp_path / "removed-data-dir"
    gone.mkdir()
    directory = Path(tempfile.mkdtemp(prefix=f"kvshare-{os.getuid()}-", dir=SHM))
    journal = Journal(directory / JOURNAL_NAME, MIN_CAPACITY, owner=gone)
    journal.close(remove=False)
    gone.rmdir()
    yield journal.path
    remove_journal(journal.path)


@pytest.mark.slow
@pytest.mark.usefixtures("stale_journal")
@pytest.mark.parametrize("flag", ["--bulk-listen", "default"])
def test_a_bulk_port_in_use_is_a_one_line_error(tmp_path: Path, flag: str) -> None:
    """The error is the one line the server writes at its own log level `warning`: at
    `info` (the default) the lines of start-up's housekeeping come first, whatever the
    machine holds (the removal of a stale journal on /dev/shm: the fixture leaves one)."""
    port = free_port_pair()
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port + 1))
        holder.listen()
        args = ["--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "d")]
        if flag != "default":
            args = ["--listen", "127.0.0.1:0", flag, f"127.0.0.1:{port + 1}", *args[2:]]
        line = one_line_error(run_cli("serve", "--log-level", "warning", *args))
    assert f"127.0.0.1:{port + 1} for the bulk channel: the port is in use" in line
    assert "--bulk-listen" in line


@pytest.mark.slow
def test_bad_bulk_addresses_and_plaintext_off_loopback_are_one_line_errors(
    tmp_path: Path,
) -> None:
    data = ("--data-dir", str(tmp_path / "d"))
    line = one_line_error(run_cli("serve", "--bulk-listen", "localhost", *data))
    assert "--bulk-listen: listen 'localhost' is not HOST:PORT" in line
    line = one_line_error(run_cli("serve", "--bulk-advertise", "store:0", *data))
    assert "port 0 is not a port clients can reach" in line
    # Refused before anything binds: no traffic leaves loopback.
    line = one_line_error(run_cli("serve", "--bulk-listen", "198.18.0.1:0", *data))
    assert "non-loopback 198.18.0.1:0 for the bulk channel without TLS" in line


def test_the_tls_bulk_channel_reaches_an_ipv6_literal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca = TestCA(tmp_path / "ca")
    cert = ca.server_cert()  # names ::1
    config = ServerConfig(listen="[::1]:0", data_dir=tmp_path / "data")
    with EmbeddedServer(config, TlsFiles(cert.cert, cert.key)) as server:
        token = (tmp_path / "data" / "dev.token").read_text().strip()
        tls = ClientTls(root_ca=ca.cert_path)
        with BlockClient(server.address, token, tls=tls, same_host=False) as client:
            assert client.put("dev", MODEL, [os.urandom(32)], [b"x" * 1000]) == [True]
            assert client.transport_stats.bulk_fallbacks == 0  # TLS to [::1] verified
    assert "bulk channel failed" not in caplog.text
