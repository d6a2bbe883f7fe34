"""policy/: a live reload of who may do what (AccessPolicy.reload_access and current,
policy.access_change, the rate limiter's new defaults, tickets dropped). No server."""

from __future__ import annotations

import pytest

from kvcommon.errors import PermissionDenied, Unauthenticated
from policy.access import AccessPolicy
from policy.access_change import diff_access
from policy.config import AccessConfig, TenantConfig
from policy.identity import Action, Principal, TokenCredential, hash_token
from policy.naming import BlockNamer
from policy.ratelimit import RateLimited, RequestRateLimiter
from policy.tickets import Route, TicketBook
from policy.types import TenantId

RW = frozenset({Action.READ, Action.WRITE})
ALPHA, BETA = TenantId("alpha"), TenantId("beta")


def principal(name: str, tenants: set[str], token: str, rate: int | None = None) -> Principal:
    return Principal(
        name,
        frozenset(TenantId(t) for t in tenants),
        RW,
        requests_per_s=rate,
        credential=hash_token(token),
    )


def access(
    *principals: tuple[Principal, str], tenants: tuple[str, ...] = ("alpha", "beta")
) -> AccessConfig:
    return AccessConfig(
        tuple(TenantConfig(TenantId(t)) for t in tenants),
        tuple(TokenCredential(hash_token(token), p) for p, token in principals),
    )


def policy_for(config: AccessConfig, limiter: RequestRateLimiter | None = None) -> AccessPolicy:
    return AccessPolicy.from_access(config, b"s" * 32, limiter=limiter)


def test_before_any_reload_every_principal_is_as_authenticated() -> None:
    a = principal("a", {"alpha"}, "ta")
    policy = policy_for(access((a, "ta")))
    assert policy.current(a) is a
    assert policy.admit(a, "alpha", Action.READ) == ALPHA


def test_a_removed_principal_is_refused_even_with_its_old_object() -> None:
    a, b = principal("a", {"alpha"}, "ta"), principal("b", {"beta"}, "tb")
    policy = policy_for(access((a, "ta"), (b, "tb")))
    assert policy.admit(b, "beta", Action.WRITE) == BETA  # positive control
    change = policy.reload_access(access((a, "ta")), requests_per_s=0, burst_s=1)
    assert change.closed == {"b": "removed"}
    with pytest.raises(Unauthenticated):
        policy.admit(b, "beta", Action.WRITE)  # a connection opened before the reload
    with pytest.raises(Unauthenticated):
        policy.check_rate(b)
    with pytest.raises(Unauthenticated):
        policy.authenticate("Bearer tb")
    assert policy.admit(a, "alpha", Action.READ) == ALPHA  # a principal that stays


def test_a_replaced_token_revokes_the_old_credential_and_the_new_one_serves() -> None:
    old = principal("a", {"alpha"}, "old")
    policy = policy_for(access((old, "old")))
    new = principal("a", {"alpha"}, "new")
    change = policy.reload_access(access((new, "new")), requests_per_s=0, burst_s=1)
    assert change.closed == {"a": "credential replaced"}
    with pytest.raises(Unauthenticated):
        policy.admit(old, "alpha", Action.READ)
    assert policy.admit(policy.authenticate("Bearer new"), "alpha", Action.READ) == ALPHA
    assert not policy.is_current(old)


def test_a_reduced_principal_loses_only_what_was_taken_and_a_widened_one_gains() -> None:
    both = principal("both", {"alpha", "beta"}, "t")
    one = principal("one", {"alpha"}, "u")
    policy = policy_for(access((both, "t"), (one, "u")))
    reduced = principal("both", {"alpha"}, "t")
    widened = principal("one", {"alpha", "beta"}, "u")
    change = policy.reload_access(
        access((reduced, "t"), (widened, "u")), requests_per_s=0, burst_s=1
    )
    assert change.closed == {"both": "grants reduced"}
    assert change.principals_widened == ("one",)
    with pytest.raises(PermissionDenied):
        policy.admit(both, "beta", Action.READ)  # the object authenticated before
    assert policy.admit(both, "alpha", Action.READ) == ALPHA
    assert policy.admit(one, "beta", Action.READ) == BETA  # judged by its new entry


def test_a_changed_rate_applies_to_the_next_request() -> None:
    clock = [0.0]
    limiter = RequestRateLimiter(0, 1, clock=lambda: clock[0])
    a = principal("a", {"alpha"}, "t")
    policy = policy_for(access((a, "t")), limiter)
    for _ in range(50):
        policy.check_rate(a)  # unlimited
    slow = principal("a", {"alpha"}, "t", rate=2)
    change = policy.reload_access(access((slow, "t")), requests_per_s=0, burst_s=1)
    assert change.closed == {"a": "rate changed"}
    policy.check_rate(a)
    policy.check_rate(a)
    with pytest.raises(RateLimited):
        policy.check_rate(a)


def test_new_default_rates_apply_to_principals_without_their_own() -> None:
    clock = [0.0]
    limiter = RequestRateLimiter(100, 1, clock=lambda: clock[0])
    a = principal("a", {"alpha"}, "t")
    policy = policy_for(access((a, "t")), limiter)
    policy.check_rate(a)
    policy.reload_access(access((a, "t")), requests_per_s=1, burst_s=1)
    policy.check_rate(a)  # the bucket keeps what it holds, within the new capacity: 1
    with pytest.raises(RateLimited):
        policy.check_rate(a)
    clock[0] += 1.0
    policy.check_rate(a)


def test_tenants_added_and_removed() -> None:
    a = principal("a", {"alpha"}, "t")
    policy = policy_for(access((a, "t")))
    change = policy.reload_access(
        access((a, "t"), tenants=("alpha", "gamma")), requests_per_s=0, burst_s=1
    )
    assert change.tenants_added == ("gamma",) and change.tenants_removed == ("beta",)
    assert set(policy.quotas_bytes) == {ALPHA, TenantId("gamma")}
    assert "tenants added: gamma" in change.summary()


def test_diff_names_each_reason() -> None:
    a = principal("a", {"alpha"}, "t")
    assert diff_access([a], [a], [], []).closed == {}
    assert diff_access([a], [], [], []).closed == {"a": "removed"}
    assert diff_access([a], [principal("a", {"beta"}, "t")], [], []).closed == {
        "a": "grants reduced"
    }


def test_revoked_tickets_open_nothing_and_others_still_open() -> None:
    book = TicketBook()
    a, b = principal("a", {"alpha"}, "ta"), principal("b", {"beta"}, "tb")
    ticket_a, ticket_b = book.issue(a, ALPHA), book.issue(b, BETA)
    assert book.revoke({"b"}) == 1
    with pytest.raises(Unauthenticated):
        book.redeem(ticket_b, Route.TLS)
    assert book.redeem(ticket_a, Route.TLS).principal is a  # positive control


def test_the_namer_is_unchanged_by_a_reload() -> None:
    a = principal("a", {"alpha"}, "t")
    namer = BlockNamer(b"s" * 32, {ALPHA: 0})
    policy = policy_for(access((a, "t")))
    before = policy.storage_key(ALPHA, "m", b"\x01" * 32)  # type: ignore[arg-type]
    policy.reload_access(access((a, "t"), tenants=("alpha",)), requests_per_s=0, burst_s=1)
    assert policy.storage_key(ALPHA, "m", b"\x01" * 32) == before  # type: ignore[arg-type]
    assert namer.epoch(ALPHA) == 0


def test_a_principal_the_reload_leaves_alone_stays_current() -> None:
    a, b = principal("a", {"alpha"}, "ta"), principal("b", {"beta"}, "tb")
    policy = policy_for(access((a, "ta"), (b, "tb")))
    # The same entries, parsed again (new objects), and b removed.
    again = principal("a", {"alpha"}, "ta")
    policy.reload_access(access((again, "ta")), requests_per_s=0, burst_s=1)
    assert policy.is_current(a)  # what a opened before the reload may go to a worker
    assert policy.authenticate("Bearer ta") is a
    assert not policy.is_current(b)
