"""The timing audit: can one tenant tell, by timing, what another tenant has cached?

Invariants the measurement keeps, so that a difference means a channel:
- Every arm of a comparison makes the same client call with the same shapes (one
  digest for `get`, LOOKUP_RUN digests for `lookup`) from digest pools made before any
  timing, cycled the same way: the only difference between the cross-tenant arm and
  the random-miss arm is that the victim stored the cross-tenant arm's digests.
- The arms run interleaved, in a fresh random order every round, on one client per
  transport; the first rounds (WARMUP_CALLS calls) are discarded; the garbage
  collector is off while timing; only the call itself is inside the timer, every check
  of its outcome comes after.
- A transport is reported only when the client really used it: a bulk transport whose
  calls fell back to gRPC, or a same-host transport that got no arena, is skipped with
  the reason, never measured under a name it did not have.
- A positive control (the attacker's own hits against the same random misses) must
  separate (auc >= CONTROL_AUC), or the harness is blind at this noise level and the
  audit cannot vouch for anything.
- Nothing secret is reported or logged: no token, digest or payload, only tenant ids,
  transport names and statistics.

The audit's parts: `setup` (what it is given and plants), `parties` (its clients,
planting and deleting), `probing` (one transport's arms and report), `public` (the
public scope's check), `verdicts` and `stats` (what the timings mean). Blocks are
planted under a model name of their own ("kvshare-audit/<random>"), never colliding
with real data, and deleted afterwards.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from kvshare.audit.parties import delete_pool, is_local_target, open_client, plant_pool, preflight
from kvshare.audit.probing import probe_transport
from kvshare.audit.public import audit_public
from kvshare.audit.setup import AuditError, Planted, Setup, Transport, transports
from kvshare.audit.verdicts import CHANNEL, INCONCLUSIVE, PASS, Report, weakest, worst


@dataclass
class Audit:
    """The report of the CLI's contract (kvshare.audit.cli), and what the clean-up did."""

    report: Report
    cleanup: list[str]


def run_audit(setup: Setup, rng: random.Random | None = None) -> Audit:
    """Plant, probe every transport, probe the public scope, clean up."""
    if setup.attacker.tenant == setup.victim.tenant:
        raise AuditError(
            "--attacker-tenant and --victim-tenant are the same tenant; give two tenants"
        )
    rng = rng or random.Random(os.urandom(16))
    planted = Planted.fresh()
    cleanup: list[str] = []
    grpc_only = Transport("grpc", bulk=False, same_host=False)
    with (
        open_client(setup, setup.attacker, grpc_only) as attacker,
        open_client(setup, setup.victim, grpc_only) as victim,
    ):
        preflight(setup, attacker, victim, planted.model)
        try:
            plant_pool(setup, victim, setup.victim, planted.model, planted.victim)
            plant_pool(setup, attacker, setup.attacker, planted.model, planted.own)
            local = is_local_target(setup.target)
            entries = {
                t.name: probe_transport(t, setup, planted, rng, local=local)
                for t in transports(tls=setup.tls is not None)
            }
            public = audit_public(setup, planted, rng, cleanup)
        finally:
            cleanup.append(delete_pool(victim, setup.victim.tenant, planted.model, planted.victim))
            cleanup.append(delete_pool(attacker, setup.attacker.tenant, planted.model, planted.own))
    return Audit(summarize(entries, public), cleanup)


def summarize(entries: dict[str, Report], public: Report) -> Report:
    """The top level: the worst transport's cross-tenant comparison, the weakest
    control, and the overall verdict (a channel anywhere, else a blind control
    anywhere, else pass)."""
    measured = [e for e in entries.values() if "skipped" not in e]
    if not measured:
        reasons = "; ".join(f"{name}: {e['skipped']}" for name, e in entries.items())
        raise AuditError(f"no transport could be audited ({reasons})")
    verdicts = [e["verdict"] for e in measured]
    if "verdict" in public:
        verdicts.append(public["verdict"])
    verdict = PASS
    if CHANNEL in verdicts:
        verdict = CHANNEL
    elif INCONCLUSIVE in verdicts:
        verdict = INCONCLUSIVE
    return {
        "cross_tenant": worst([e["cross_tenant"] for e in measured]),
        "control": weakest([e["control"] for e in measured]),
        "verdict": verdict,
        "transports": entries,
        "public": public,
    }
