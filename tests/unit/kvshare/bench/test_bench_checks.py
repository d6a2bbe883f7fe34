"""The data-path targets read off a run's rows (kvshare.bench.checks)."""

from __future__ import annotations

from kvshare.bench.checks import MIN_BATCH_BLOCKS_PER_S_PER_CLIENT, evaluate
from kvshare.bench.config import MIB
from kvshare.bench.stats import Row


def _row(system: str, op: str, size: int, ratios: dict[str, float], **extra: float) -> Row:
    return Row(
        system=system,
        op=op,
        value_bytes=size,
        clients=1,
        blocks_per_call=int(extra.get("blocks", 1)),
        mb_per_s=100.0,
        p50_ms=1.0,
        p99_ms=2.0,
        blocks_per_s_per_client=extra.get("blocks_per_s", 0.0),
        mb_per_s_rounds=(100.0,),
        ratio_to=ratios,
    )


def test_targets_pass_fail_and_not_measured() -> None:
    rows = [
        _row("kvshare", "get", 2 * MIB, {"tcp": 0.6, "redis": 1.2, "lmcache": 0.9}),
        _row("kvshare", "put", 2 * MIB, {"tcp": 0.3, "redis": 0.8}),
        _row("kvshare-batch", "get", 64 * 1024, {}, blocks=64, blocks_per_s=6000.0),
        _row("kvshare-tls", "get", 2 * MIB, {"kvshare-tcp": 0.7}),
        _row("kvshare-tcp", "put", 2 * MIB, {"kvshare": 0.9, "redis": 1.1}),
    ]
    checks = {(c.name, c.clients): c for c in evaluate(rows, client_counts=(1, 4))}
    assert checks[("kvshare GET 2 MiB / Redis GET", 1)].passed is True
    assert checks[("kvshare GET 2 MiB / raw TCP", 1)].passed is True
    assert checks[("kvshare PUT 2 MiB / Redis SET (acknowledged)", 1)].passed is False
    batch = checks[("kvshare batched GET, 64 KiB blocks/s per client", 1)]
    assert batch.passed is True and batch.threshold == MIN_BATCH_BLOCKS_PER_S_PER_CLIENT
    # nothing measured at 4 clients: never a pass by default
    assert checks[("kvshare GET 2 MiB / Redis GET", 4)].passed is None
    assert checks[("kvshare GET 2 MiB / Redis GET", 4)].value is None
    tls = checks[("kvshare-tls / kvshare-tcp GET 2 MiB", 1)]  # TLS over TCP: its base
    assert tls.value == 0.7 and tls.passed is None and "TLS" in tls.note
    assert checks[("kvshare-tcp / kvshare PUT 2 MiB", 1)].value == 0.9
    assert checks[("kvshare-tcp / redis PUT 2 MiB", 1)].value == 1.1
    assert checks[("kvshare / lmcache GET 2 MiB", 1)].value == 0.9


def test_two_host_targets_are_the_cross_host_ones() -> None:
    rows = [
        _row("kvshare-tcp", "get", 2 * MIB, {"tcp": 0.85, "redis": 0.9}),
        _row("kvshare-tls-sealed", "get", 2 * MIB, {"tcp": 0.35}),
        _row("kvshare-tcp", "put", 2 * MIB, {"tcp": 0.5, "redis": 1.05}),
        _row("kvshare-tcp-batch", "get", 64 * 1024, {}, blocks=64, blocks_per_s=4000.0),
    ]
    checks = {(c.name, c.clients): c for c in evaluate(rows, (1,), two_host=True)}
    assert checks[("kvshare-tcp GET 2 MiB / raw TCP", 1)].passed is True
    assert checks[("kvshare-tcp GET 2 MiB / Redis GET", 1)].passed is False
    secure = checks[("kvshare-tls-sealed GET 2 MiB / raw TCP", 1)]
    assert secure.passed is False and secure.threshold == 0.5
    put = checks[("kvshare-tcp PUT 2 MiB / Redis SET (acknowledged)", 1)]
    assert put.value == 1.05 and put.passed is None  # reported beside the GET targets
    assert checks[("kvshare-tcp batched GET, 64 KiB blocks/s per client", 1)].passed is False
    assert not any(name.startswith("kvshare GET") for name, _ in checks)  # no same-host row
