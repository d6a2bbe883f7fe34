"""The timing audit's clients and the blocks they plant: a client per party and
transport, the pre-flight check (both tokens work, and there is isolation to audit),
planting blocks and deleting them afterwards. A failed set-up call is an AuditError
that says what to change; a failed deletion is reported in words, never raised.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from kvcommon.errors import KvshareError, PermissionDenied
from kvshare.audit.setup import (
    BLOCK_BYTES,
    DIGEST_BYTES,
    LOOKUP_RUN,
    PLANTED,
    PUBLIC_TENANT,
    RUN_BLOCK_BYTES,
    AuditError,
    Party,
    Pool,
    Setup,
    Transport,
)
from replica_agent.client import BlockClient

PUT_BATCH_BYTES = 4 << 20


def explain(error: KvshareError, setup: Setup, party: Party, doing: str) -> AuditError:
    """The usage or connection error a failed set-up call means, saying what to change."""
    status = getattr(error, "status", type(error).__name__)
    if status == "UNAUTHENTICATED":
        return AuditError(
            f"the server refused the token in {party.flag} ({status}) while {doing}: "
            f"give the file of a valid token for tenant {party.tenant!r}"
        )
    if status == "PERMISSION_DENIED" and party.tenant == PUBLIC_TENANT:
        return AuditError(
            f"the principal of {party.flag} may not publish ({status}) while {doing}: "
            "give a token whose principal has the `publish` action"
        )
    if status == "PERMISSION_DENIED":
        return AuditError(
            f"the principal of {party.flag} may not act for tenant {party.tenant!r} "
            f"({status}) while {doing}: give a token whose principal lists that tenant "
            "with read and write, or the tenant it does list"
        )
    if status in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        hint = "check --tls-ca" if setup.tls else "if the server uses TLS, give --tls-ca"
        return AuditError(
            f"cannot reach {setup.target} ({status}) while {doing}: check --target "
            f"(HOST:PORT of the server's gRPC listener); {hint}"
        )
    if status == "RESOURCE_EXHAUSTED":
        return AuditError(
            f"tenant {party.tenant!r} has no room ({status}) while {doing}: the audit "
            f"stores {PLANTED} blocks of {BLOCK_BYTES >> 10} KiB per tenant; raise its "
            "quota or its request rate, or free room, and run again"
        )
    return AuditError(f"{doing} failed: {error}")


@contextmanager
def open_client(setup: Setup, party: Party, transport: Transport) -> Iterator[BlockClient]:
    try:
        client = BlockClient(
            setup.target,
            party.token,
            tls=setup.tls,
            timeout_s=setup.timeout_s,
            bulk=transport.bulk,
            same_host=transport.same_host,
        )
    except OSError as error:  # a TLS file that cannot be read
        raise AuditError(f"cannot read a TLS file: {error}; check --tls-ca") from None
    try:
        yield client
    finally:
        client.close()


def preflight(setup: Setup, attacker: BlockClient, victim: BlockClient, model: str) -> None:
    """Both tokens work for their tenants, and the attacker's does not for the
    victim's (else there is no isolation to audit: a usage error)."""
    probe = [os.urandom(DIGEST_BYTES)]
    for client, party in ((attacker, setup.attacker), (victim, setup.victim)):
        try:
            client.lookup(party.tenant, model, probe)
        except KvshareError as error:
            raise explain(error, setup, party, f"checking {party.flag}") from None
    try:
        attacker.lookup(setup.victim.tenant, model, probe)
    except PermissionDenied:
        return
    except KvshareError as error:
        raise explain(error, setup, setup.attacker, "checking isolation") from None
    raise AuditError(
        f"the principal of {setup.attacker.flag} may read tenant {setup.victim.tenant!r}: "
        "there is no isolation between them to audit; give an attacker token whose "
        "principal does not list the victim tenant"
    )


def plant(
    setup: Setup, client: BlockClient, party: Party, model: str, digests: list[bytes], size: int
) -> None:
    """Store a random payload of `size` bytes under each digest, in puts of about
    PUT_BATCH_BYTES."""
    step = max(1, PUT_BATCH_BYTES // size)
    try:
        for start in range(0, len(digests), step):
            batch = digests[start : start + step]
            client.put(party.tenant, model, batch, [os.urandom(size) for _ in batch])
    except KvshareError as error:
        raise explain(error, setup, party, f"planting blocks in {party.tenant!r}") from None


def plant_pool(setup: Setup, client: BlockClient, party: Party, model: str, pool: Pool) -> None:
    plant(setup, client, party, model, pool.blocks, BLOCK_BYTES)
    plant(setup, client, party, model, pool.runs, RUN_BLOCK_BYTES)


def delete_planted(client: BlockClient, tenant: str, model: str, digests: list[bytes]) -> str:
    """Delete planted blocks; what happened, in words (never an exception)."""
    step = LOOKUP_RUN  # a call names at most [limits] max_digests_per_call (8192 by default)
    try:
        deleted = sum(
            client.delete(tenant, model, digests[start : start + step])
            for start in range(0, len(digests), step)
        )
    except KvshareError as error:
        status = getattr(error, "status", type(error).__name__)
        return f"not deleted from {tenant!r} ({status}): its principal lacks the right"
    return f"deleted {deleted} of {len(digests)} from {tenant!r}"


def delete_pool(client: BlockClient, tenant: str, model: str, pool: Pool) -> str:
    return delete_planted(client, tenant, model, pool.blocks + pool.runs)


def is_local_target(target: str) -> bool:
    """Whether HOST of HOST:PORT is an address of this host (one it can bind to)."""
    host = target.rpartition(":")[0].strip("[]") or target
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        ip = ipaddress.ip_address(address[0])
        if ip.is_loopback:
            return True
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False
