"""Entries planted in the delete stream by whoever can write to Redis cannot make a
server allocate them, nor stop it following the real deletes after them
(cacheserver/tiers/cluster/follower.py, replies.py).

The entries are made inside Redis by a script (`string.rep`), so this process allocates
nothing for them; `tracemalloc` then sees what the servers' followers (threads of this
process) take in while they read past them.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import pytest

from kvshare.bench.redis_cluster import LocalRedisCluster
from policy.types import TenantId
from tests.support.cluster import MODEL, Servers, blocks, direct, eventually, tier_of

pytestmark = pytest.mark.slow  # every test here takes seconds

ALPHA = TenantId("alpha")
MiB = 1 << 20
PLANTED = 8
PLANTED_BYTES = 4 * MiB
# One entry per call (a script holds its node): an odd-sized keys field, a huge origin,
# three thousand fields, then fields of 4 MiB (the first reader took each in whole).
PLANT = """
local size, kind = tonumber(ARGV[1]), tonumber(ARGV[2])
local add = function(...) return redis.call('XADD', KEYS[1], '*', ...) end
if kind == 1 then return add('o', 'x', 'k', string.rep('k', size + 1)) end
if kind == 2 then return add('o', string.rep('o', size), 't', 'x') end
if kind == 3 then
  local fields = {}
  for i = 1, 3000 do fields[#fields + 1] = 'f' .. i; fields[#fields + 1] = 'v' end
  return add(unpack(fields))
end
return add('o', 'x', 'k', string.rep('k', size))
"""


def test_oversized_entries_are_read_past_and_the_deletes_after_them_applied(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    servers = start_servers(cluster)
    digests, payloads = blocks(4)
    holder = servers[1]
    holder.client("a", transport="grpc").put("alpha", MODEL, digests, payloads)
    servers.settle()
    assert holder.store.tenant_usage(ALPHA)[0] == 4  # its own copies
    stream = tier_of(holder).keys.deletes
    operator = direct(cluster)
    tracemalloc.start()
    try:
        for kind in range(1, PLANTED + 1):
            operator.eval(PLANT, 1, stream, PLANTED_BYTES, kind)
        assert servers[0].client("a", transport="grpc").delete("alpha", MODEL, digests[:2]) == 2
        # The holder applies the real delete behind the planted entries.
        assert eventually(lambda: holder.store.tenant_usage(ALPHA)[0] == 2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        operator.close()
    assert peak < 12 * MiB, peak  # two servers read past 8 x 4 MiB: neither held them
    assert tier_of(holder).counts()["stream_skipped"] >= PLANTED
    client = holder.client("a", transport="grpc")
    assert client.get("alpha", MODEL, digests[:2]) == []
    assert client.get("alpha", MODEL, digests[2:]) == payloads[2:]  # positive control
