"""policy/: the new config keys, certificate identities, and the admit rules (no server)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from cacheserver.config import load_config
from kvcommon.errors import ConfigError, InvalidArgument, PermissionDenied, Unauthenticated
from policy.access import AccessPolicy
from policy.config import AccessConfig, PublicConfig, TenantConfig
from policy.identity import (
    Action,
    Authenticator,
    CertCredential,
    Principal,
    TokenCredential,
    certificate_identities,
    hash_token,
)
from policy.types import PUBLIC, TenantId

TOKEN_HEX = hashlib.sha256(b"t").hexdigest()
BASE = f"""listen = "127.0.0.1:0"

[[tenants]]
id = "acme"
read_public = true

[[tenants]]
id = "other"
quota_bytes = 0

[[principals]]
name = "token-principal"
token_sha256 = "{TOKEN_HEX}"
tenants = ["acme"]
actions = ["read", "write"]
requests_per_s = 50

[[principals]]
name = "cert-principal"
cert_identity = "uri:spiffe://org/replica"
tenants = ["acme", "other"]
actions = ["read", "publish"]

[public]
quota_bytes = 1048576
"""


def load(tmp_path: Path, text: str) -> AccessConfig:
    path = tmp_path / "c.toml"
    path.write_text(text)
    access = load_config(path).access
    assert access is not None
    return access


def test_new_keys_parse(tmp_path: Path) -> None:
    access = load(tmp_path, BASE)
    assert access.tenants[0].read_public and not access.tenants[1].read_public
    assert access.public is not None and access.public.quota_bytes == 1 << 20
    assert access.quotas_bytes()[PUBLIC] == 1 << 20 and access.epochs()[PUBLIC] == 0
    assert access.credentials[0].principal.requests_per_s == 50
    cert = access.cert_credentials[0]
    assert cert.identity == "uri:spiffe://org/replica"
    assert cert.principal.actions == {Action.READ, Action.PUBLISH}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ('cert_identity = "uri:spiffe://org/replica"', ""),
            r"c.toml:18: principals\[1\].token_sha256: give exactly one of",
        ),
        (
            ('name = "cert-principal"', f'name = "cert-principal"\ntoken_sha256 = "{TOKEN_HEX}"'),
            r"c.toml:20: principals\[1\].token_sha256: give exactly one of",
        ),
        (("uri:spiffe", "spiffe"), r"c.toml:20: principals\[1\].cert_identity: must be 'uri:"),
        (("read_public = true", "read_public = 1"), r"c.toml:5: tenants\[0\].read_public: must"),
        (
            ("read_public = true", 'read_shared = ["x"]'),
            r"c.toml:5: tenants\[0\].read_shared: shared tenants are replaced by the public scope",
        ),
        (('id = "other"', 'id = "@public"'), r"c.toml:8: tenants\[1\].id: must match"),
        (("quota_bytes = 1048576", "quota = 1"), r"c.toml:\d+: public.quota: unknown key"),
        (("quota_bytes = 1048576", "epoch = 1"), r"c.toml:\d+: public: needs quota_bytes"),
        (("[public]\nquota_bytes = 1048576", ""), r"tenants\[0\].read_public: there is no"),
        (("requests_per_s = 50", "requests_per_s = -1"), r"c.toml:16: principals\[0\].requests"),
        (("requests_per_s = 50", "rate = 1"), r"c.toml:16: principals\[0\].rate: unknown key"),
    ],
)
def test_errors_name_the_key_and_line(tmp_path: Path, edit: tuple[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, BASE.replace(*edit))


def test_two_principals_with_one_cert_identity_is_an_error(tmp_path: Path) -> None:
    extra = BASE.split("[[principals]]")[-1].split("[public]")[0].replace("cert-principal", "twin")
    with pytest.raises(ConfigError, match=r"c.toml:\d+: principals\[2\].cert_identity: two"):
        load(tmp_path, BASE + "[[principals]]" + extra)


def test_server_tables_tls_and_audit_log(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        'audit_log = "/var/log/kv.audit"\n' + BASE + '[tls]\ncert = "c.pem"\nkey = "k.pem"\n'
    )
    config = load_config(path)
    assert config.audit_log_path == Path("/var/log/kv.audit")
    assert config.tls is not None and config.tls.client_ca is None
    path.write_text(BASE + '[tls]\ncert = "c.pem"\n')
    with pytest.raises(ConfigError, match="tls: give both cert and key"):
        load_config(path)


def _principal(name: str, tenants: set[str], actions: set[Action]) -> Principal:
    return Principal(name, frozenset(TenantId(t) for t in tenants), frozenset(actions))


def test_a_token_decides_alone_and_certificates_fill_in_without_one() -> None:
    by_token = _principal("tok", {"acme"}, {Action.READ})
    by_cert = _principal("crt", {"acme"}, {Action.READ})
    auth = Authenticator(
        [TokenCredential(hash_token("secret"), by_token)],
        [CertCredential("uri:spiffe://org/r", by_cert)],
    )
    ids = certificate_identities({"peer_uri": [b"spiffe://org/r"], "x509_common_name": [b"r"]})
    assert ids == {"uri:spiffe://org/r", "cn:r"}
    assert auth.authenticate("Bearer secret", ids) is by_token
    assert auth.authenticate(None, ids) is by_cert
    assert auth.authenticate("Bearer ", ids) is by_cert  # an empty token is no token
    for authorization in ("Bearer wrong", "secret", "Basic secret", "Bearer", None):
        with pytest.raises(Unauthenticated):
            auth.authenticate(authorization, ())
    with pytest.raises(Unauthenticated):
        auth.authenticate("Bearer wrong", ids)  # a wrong token is refused despite the cert
    with pytest.raises(Unauthenticated):
        auth.authenticate(None, {"cn:someone-else"})


def test_certificates_are_ignored_unless_the_server_verifies_them() -> None:
    access = AccessConfig(
        (TenantConfig(TenantId("acme")),),
        (),
        (CertCredential("cn:r", _principal("crt", {"acme"}, {Action.READ})),),
    )
    context = {"x509_common_name": [b"r"]}
    off = AccessPolicy.from_access(access, bytes(32))
    with pytest.raises(Unauthenticated):
        off.authenticate(None, context)
    on = AccessPolicy.from_access(access, bytes(32), accept_certificates=True)
    assert on.authenticate(None, context).name == "crt"


PUBLIC_TENANTS = (
    TenantConfig(TenantId("acme"), read_public=True),
    TenantConfig(TenantId("other")),
)


@pytest.mark.parametrize(
    ("tenants", "actions", "tenant", "action", "allowed"),
    [
        ({"acme"}, {Action.READ}, "@public", Action.READ, True),  # acme reads public
        ({"other"}, {Action.READ}, "@public", Action.READ, False),  # other does not
        ({"acme", "other"}, {Action.READ}, "@public", Action.READ, True),  # one tenant will do
        ({"acme"}, {Action.WRITE}, "@public", Action.READ, False),  # no read action
        ({"acme"}, {Action.READ, Action.WRITE}, "@public", Action.WRITE, False),  # no publish
        ({"acme"}, {Action.ADMIN}, "@public", Action.WRITE, False),  # admin is not publish
        ({"acme"}, {Action.ADMIN, Action.READ}, "@public", Action.ADMIN, False),
        (set(), {Action.PUBLISH}, "@public", Action.WRITE, True),  # needs no tenants
        (set(), {Action.PUBLISH}, "@public", Action.READ, True),  # and sees what it wrote
        (set(), {Action.PUBLISH}, "@public", Action.ADMIN, False),  # no namespace delete
        ({"acme"}, {Action.PUBLISH}, "acme", Action.WRITE, False),  # publish is not write
        ({"acme"}, {Action.READ}, "@Public", Action.READ, False),  # not the scope's id
        ({"acme"}, {Action.READ}, "acme", Action.READ, True),
        ({"acme"}, {Action.READ}, "other", Action.READ, False),
        ({"acme"}, {Action.READ}, "missing", Action.READ, False),
    ],
)
def test_admit_rules(
    tenants: set[str], actions: set[Action], tenant: str, action: Action, allowed: bool
) -> None:
    public = PublicConfig(quota_bytes=1 << 20)
    policy = AccessPolicy.from_access(AccessConfig(PUBLIC_TENANTS, (), public=public), bytes(32))
    principal = _principal("p", tenants, actions)
    if allowed:
        assert policy.admit(principal, tenant, action) == tenant
    else:
        with pytest.raises((PermissionDenied, InvalidArgument)) as info:
            policy.admit(principal, tenant, action)
        assert tenant not in str(info.value)


def test_without_a_public_table_nobody_reaches_the_scope() -> None:
    policy = AccessPolicy.from_access(AccessConfig(PUBLIC_TENANTS, ()), bytes(32))
    for actions in ({Action.PUBLISH}, {Action.READ, Action.PUBLISH, Action.ADMIN}):
        with pytest.raises(PermissionDenied):
            policy.admit(_principal("p", {"acme"}, actions), "@public", Action.READ)


def test_authn_failure_records_are_rate_limited_and_say_how_many_were_left_out() -> None:
    """A stranger must not fill the audit log's disk at network speed."""
    from policy.access import AuditGate

    now = [0.0]
    gate = AuditGate(per_s=10, burst=3, clock=lambda: now[0])
    assert [gate.admit() for _ in range(5)] == [0, 0, 0, None, None]  # burst, then gated
    now[0] = 0.1  # one token back
    assert gate.admit() == 2  # written, saying two were left out
    assert gate.admit() is None
    now[0] = 10.0  # refilled to the burst, not beyond
    assert [gate.admit() for _ in range(4)] == [1, 0, 0, None]


def test_a_full_ticket_book_drops_expired_tickets_then_the_oldest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full book used to scan all 65,536 tickets on every OpenBulk. Tickets
    are now kept oldest first: expired ones leave from the front, then the oldest."""
    from policy import tickets
    from policy.identity import Principal

    monkeypatch.setattr(tickets, "MAX_OUTSTANDING", 4)
    now = [0.0]
    book = tickets.TicketBook(ttl_s=10, clock=lambda: now[0])
    who = Principal("p", frozenset({TenantId("t")}), frozenset({Action.READ}))
    first = [book.issue(who, TenantId("t")) for _ in range(2)]
    now[0] = 5.0
    later = [book.issue(who, TenantId("t")) for _ in range(2)]
    now[0] = 12.0  # the first two expired; the book is full
    newest = book.issue(who, TenantId("t"))
    assert len(book) == 3  # both expired ones left, nothing live was dropped
    book.issue(who, TenantId("t"))
    book.issue(who, TenantId("t"))  # full again, nothing expired: the oldest goes
    assert len(book) == 4
    for ticket in first + later[:1]:
        with pytest.raises(Unauthenticated):
            book.redeem(ticket, tickets.Route.TLS)
    assert book.redeem(later[1], tickets.Route.TLS).tenant == "t"  # positive control
    assert book.redeem(newest, tickets.Route.TLS).principal == who


def test_peek_leaves_a_ticket_unspent_and_its_channel_secret_is_never_printed() -> None:
    """The sealed channel checks the hello's proof with the grant's secret before it
    redeems the ticket (policy.tickets.TicketBook.peek)."""
    from policy import tickets
    from policy.identity import Principal

    now = [0.0]
    book = tickets.TicketBook(ttl_s=10, clock=lambda: now[0])
    who = Principal("p", frozenset({TenantId("t")}), frozenset({Action.READ}))
    secret = bytes(range(32))
    ticket = book.issue(who, TenantId("t"), channel_secret=secret)
    peeked = book.peek(ticket)
    assert peeked is not None and peeked.channel_secret == secret
    assert secret.hex() not in repr(peeked) and repr(secret) not in repr(peeked)
    assert book.peek(b"x" * 32) is None
    assert book.redeem(ticket, tickets.Route.SEALED) == peeked  # still there after the peek
    assert book.peek(ticket) is None  # used
    expiring = book.issue(who, TenantId("t"))
    now[0] = 11.0
    assert book.peek(expiring) is None


def test_a_ticket_opens_only_the_route_it_was_issued_for_and_stays_unspent_elsewhere() -> None:
    """A sealed-channel ticket crosses the network in clear: an on-path copier who
    presents it inside a TLS connection of its own must be refused, and the victim's
    sealed hello must still redeem it. An ordinary ticket does not open the sealed
    channel, and under mutual TLS only the certificate that asked for it redeems it."""
    from policy import tickets
    from policy.identity import Principal, certificate_fingerprint

    book = tickets.TicketBook(ttl_s=10, clock=lambda: 0.0)
    who = Principal("p", frozenset({TenantId("t")}), frozenset({Action.READ}))
    sealed = book.issue(who, TenantId("t"), channel_secret=bytes(32))
    with pytest.raises(Unauthenticated):
        book.redeem(sealed, tickets.Route.TLS)
    assert book.redeem(sealed, tickets.Route.SEALED).principal == who  # still unspent
    same_host = book.issue(who, TenantId("t"), channel_secret=bytes(32))
    assert book.redeem(same_host, tickets.Route.LOCAL).principal == who  # not on the wire

    plain = book.issue(who, TenantId("t"))
    with pytest.raises(Unauthenticated):
        book.redeem(plain, tickets.Route.SEALED)
    assert book.redeem(plain, tickets.Route.TLS).tenant == "t"

    mine, theirs = certificate_fingerprint(b"my cert"), certificate_fingerprint(b"their cert")
    bound = book.issue(who, TenantId("t"), peer_certificate=mine)
    for presented in (theirs, b""):
        with pytest.raises(Unauthenticated):
            book.redeem(bound, tickets.Route.TLS, presented)
    assert book.redeem(bound, tickets.Route.TLS, mine).principal == who
    unbound = book.issue(who, TenantId("t"))
    with pytest.raises(Unauthenticated):  # a certificate the OpenBulk call did not show
        book.redeem(unbound, tickets.Route.TLS, theirs)
