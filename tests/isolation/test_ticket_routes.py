"""A bulk ticket opens only the path it was issued for (control C65).

The sealed-payload channel sends its ticket in clear over plain TCP, guarded by a proof
of the channel secret. An on-path attacker who copies that ticket and presents it as an
ordinary ticket inside a TLS connection of its own must get nothing: not the victim's
blocks, not a connection under the victim's principal to write junk with. Under mutual
TLS a ticket is redeemed only by the certificate whose OpenBulk call got it. Each
refusal has its positive control: the same ticket, on its own path, still opens.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import grpc

from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.errors import Unauthenticated
from replica_agent.client import ClientTls
from replica_agent.grpc_calls import GrpcCalls, Ticket
from tests.support.certs import Certs
from tests.support.isolation import MODEL, isolation_config
from tests.support.servers import Running, launch

TIMEOUT_S = 30.0  # only failures wait on it


def _require_sealed(running_dir: Path, certs: Certs, *, mtls: bool = False) -> Running:
    tenancy = isolation_config(running_dir, certs, mtls=mtls)
    text = tenancy.path.read_text()
    tenancy.path.write_text(text.replace('id = "alpha"', 'id = "alpha"\nrequire_sealed = true', 1))
    return launch(tenancy, certs)


def _open_bulk(
    running: Running, who: str, tenant: str, *, cert: str | None = None, sealed: bool
) -> Ticket:
    tls = running.tls(cert)
    assert tls is not None
    token = running.tokens[who] if who else ""
    with grpc.secure_channel(running.address, tls.credentials()) as channel:
        calls = GrpcCalls(
            channel, running.address, token, TIMEOUT_S, 1 << 20, sealed_channel=sealed
        )
        return calls.open_bulk(tenant)


def _bulk_address(running: Running) -> tuple[str, int]:
    assert running.server.server is not None and running.server.server.bulk is not None
    host, _, port = running.server.server.bulk.address.rpartition(":")
    return host, int(port)


def _tls_hello_status(running: Running, ticket: bytes, tls: ClientTls) -> int:
    """The status an ordinary hello with `ticket` gets inside a TLS connection (0: OK)."""
    context = tls.ssl_context()
    context.check_hostname = False
    raw = socket.create_connection(_bulk_address(running), timeout=TIMEOUT_S)
    with raw, context.wrap_socket(raw) as conn:
        conn.sendall(w.HELLO.pack(w.MAGIC, ticket))
        return int(bulkio.recv_bytes(conn, 1)[0])


def _sealed_hello_status(running: Running, ticket: bytes, secret: bytes) -> int:
    """The status the sealed channel's hello gets with the ticket's real proof (0: OK)."""
    from policy.bulkchannel import client_side

    sender, _ = client_side(secret, ticket)
    hello = w.HELLO_SEALED.pack(w.MAGIC_SEALED, ticket, sender.hello_proof())
    with socket.create_connection(_bulk_address(running), timeout=TIMEOUT_S) as sock:
        sock.sendall(hello)
        return int(bulkio.recv_bytes(sock, 1)[0])


def test_a_sealed_channel_ticket_copied_off_the_wire_opens_no_tls_connection(
    tmp_path: Path, certs: Certs
) -> None:
    with _require_sealed(tmp_path, certs) as running:
        offer = _open_bulk(running, "a", "alpha", sealed=True)
        assert len(offer.channel_secret) == 32  # the victim got the sealed channel
        attacker_tls = running.tls()
        assert attacker_tls is not None
        status = _tls_hello_status(running, offer.ticket, attacker_tls)
        assert status == Unauthenticated.wire_code
        # Positive control: the victim's own hello, with the proof, still opens the
        # ticket (the copier's attempt did not spend it).
        assert _sealed_hello_status(running, offer.ticket, offer.channel_secret) == w.OK


def test_an_ordinary_ticket_does_not_open_the_sealed_channel(tmp_path: Path, certs: Certs) -> None:
    with _require_sealed(tmp_path, certs) as running:
        plain = _open_bulk(running, "b", "beta", sealed=True)  # beta does not require sealing
        assert plain.channel_secret == b""
        forged = w.HELLO_SEALED.pack(w.MAGIC_SEALED, plain.ticket, os.urandom(16))
        with socket.create_connection(_bulk_address(running), timeout=TIMEOUT_S) as sock:
            sock.sendall(forged)
            assert int(bulkio.recv_bytes(sock, 1)[0]) == Unauthenticated.wire_code
        tls = running.tls()
        assert tls is not None
        assert _tls_hello_status(running, plain.ticket, tls) == w.OK  # its own path


def test_under_mutual_tls_only_the_certificate_that_asked_redeems_the_ticket(
    tmp_path: Path, certs: Certs
) -> None:
    with _require_sealed(tmp_path, certs, mtls=True) as running:
        offer = _open_bulk(running, "", "beta", cert="cert-b", sealed=False)
        for other in ("cert-a", "stranger"):  # valid certificates of someone else
            other_tls = running.tls(other)
            assert other_tls is not None
            assert _tls_hello_status(running, offer.ticket, other_tls) == Unauthenticated.wire_code
        own = running.tls("cert-b")
        assert own is not None
        assert _tls_hello_status(running, offer.ticket, own) == w.OK  # positive control
        # And the client as a replica uses it: its bulk calls go over the channel.
        with running.client("", cert="cert-b", transport="bulk-tcp") as client:
            digest, payload = os.urandom(32), os.urandom(4096)
            assert client.put("beta", MODEL, [digest], [payload]) == [True]
            assert client.get("beta", MODEL, [digest]) == [payload]
            assert client.transport_stats.bulk_fallbacks == 0
