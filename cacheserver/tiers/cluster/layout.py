"""What kvshare keeps in the Redis Cluster: key names, the block value's header, and the
Lua scripts that keep each tenant's accounting.

Keys (P is `key_prefix`; nothing in them is a client digest, a tenant id or a secret):

    P b:<hex storage key>             one block: header | payload. No hash tag: blocks
                                      spread over every slot, one key per block.
    P t{<hex tenant tag>}:lru:<e>     zset: the tenant's blocks of epoch e (raw storage
                                      keys), scored by the tenant's access clock
    P t{<tag>}:sizes:<e>              hash: block -> payload bytes
    P t{<tag>}:used:<e>               counter: the sum of those sizes
    P t{<tag>}:clock                  counter: the tenant's access clock
    P t{<tag>}:epochs                 set: epochs with blocks (retired ones get reclaimed)
    P t{<tag>}:doomed                 set: blocks evicted whose key may still exist
    P t{<tag>}:writing                zset: blocks being written, by the (Redis) second
                                      their write began; admitting one takes it out
    P deletes                         stream: deletes every server applies to its copies

A tenant's keys share one hash tag (the tenant tag, `policy.naming.cluster_tag`: keyed,
the same at every epoch), so each script below touches one slot, atomically; blocks never
share a slot on purpose, and no hot-path operation spans two slots.

The header says what LMDB's metadata says of a block (tenant, epoch, model tag, size),
with the tenant as its keyed tag instead of its id, and ends with a keyed MAC over the
key name, the header and the payload (policy.shared_values): whoever can write to Redis
but holds no server secret can delete values, never make one a server serves.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cacheserver.tiers import Payload
from policy.shared_values import SALT_BYTES, TAG_BYTES, ValueMac
from policy.types import ModelTag, StorageKey

# The value format's version: a value of another version (an older server's) is a
# miss, deleted so that a put writes it again (SET NX would keep it otherwise).
MAGIC = b"KVC2"
OLD_MAGICS = (b"KVC1",)
# magic | tenant tag | epoch | model tag | payload bytes | salt; then the MAC's tag
_HEAD = struct.Struct(f">4s16sI16sQ{SALT_BYTES}s")
HEADER_BYTES = _HEAD.size + TAG_BYTES


@dataclass(frozen=True, slots=True)
class BlockHeader:
    tenant_tag: bytes
    epoch: int
    model_tag: ModelTag
    size: int


def pack_header(
    mac: ValueMac, name: bytes, tenant_tag: bytes, epoch: int, model_tag: bytes, payload: Payload
) -> bytes:
    """The header of `payload` stored under the key `name`, its MAC tag last: the tag
    binds the key name, the header and the payload (policy.shared_values)."""
    head = _HEAD.pack(MAGIC, tenant_tag, epoch, model_tag, len(payload), mac.new_salt())
    return head + mac.tag(name, head, payload)


def unpack_header(raw: bytes | bytearray | memoryview) -> BlockHeader | None:
    """The header at the start of `raw`, or None when it is not one of ours. Not yet
    checked: what it says is only a hint (which accounting a delete releases)."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, tenant_tag, epoch, model_tag, size, _ = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        return None
    return BlockHeader(tenant_tag, epoch, ModelTag(model_tag), size)


def is_old_format(raw: bytes | bytearray | memoryview) -> bool:
    return bytes(raw[:4]) in OLD_MAGICS


def open_value(
    mac: ValueMac, name: bytes, raw: bytes | bytearray, tenant_tag: bytes
) -> tuple[memoryview, ModelTag] | None:
    """The payload of the value stored under `name` (a view, no copy) and its model
    tag, or None unless a server holding the secret wrote exactly these bytes under this
    name for this tenant: torn, corrupt, moved from another key, re-headed to another
    tenant, or forged are all None."""
    header = unpack_header(raw)
    if header is None or header.tenant_tag != tenant_tag:
        return None
    view = memoryview(raw)
    payload = view[HEADER_BYTES:]
    if len(payload) != header.size:
        return None
    if not mac.verify(name, view[: _HEAD.size], payload, view[_HEAD.size : HEADER_BYTES]):
        return None
    return payload, header.model_tag


class Keys:
    """Key names under one prefix (module docstring)."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix.encode()
        self.deletes = self._prefix + b"deletes"

    def block(self, key: StorageKey) -> bytes:
        return self._prefix + b"b:" + key.hex().encode()

    def tenant(self, tag: bytes) -> TenantKeys:
        return TenantKeys(self._prefix + b"t{" + tag.hex().encode() + b"}:")

    def is_block(self, name: bytes) -> bool:
        return name.startswith(self._prefix + b"b:")


class TenantKeys:
    def __init__(self, base: bytes) -> None:
        self.base = base
        self.clock = base + b"clock"
        self.epochs = base + b"epochs"
        self.doomed = base + b"doomed"
        self.writing = base + b"writing"

    def lru(self, epoch: int) -> bytes:
        return self.base + b"lru:%d" % epoch

    def sizes(self, epoch: int) -> bytes:
        return self.base + b"sizes:%d" % epoch

    def used(self, epoch: int) -> bytes:
        return self.base + b"used:%d" % epoch

    def of_epoch(self, epoch: int) -> list[bytes]:
        """lru, sizes, used: the keys every epoch-scoped script takes first."""
        return [self.lru(epoch), self.sizes(epoch), self.used(epoch)]


# -- scripts: each runs atomically on the one node that holds the tenant's slot --------

# KEYS: lru sizes used clock epochs doomed writing; ARGV: block size quota epoch.
# Returns {1, victims...} (accounted: store it, delete the victims), {0} (listed
# already: only touched), or {-1} (larger than the quota: not stored).
ADMIT = """
redis.call('ZREM', KEYS[7], ARGV[1])
local now = redis.call('INCR', KEYS[4])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], 'XX', now, ARGV[1])
  return {0}
end
local size, quota = tonumber(ARGV[2]), tonumber(ARGV[3])
if quota > 0 and size > quota then return {-1} end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], size)
redis.call('SADD', KEYS[5], ARGV[4])
redis.call('SREM', KEYS[6], ARGV[1])
local used = redis.call('INCRBY', KEYS[3], size)
local out = {1}
while quota > 0 and used > quota do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if oldest == nil or oldest == ARGV[1] then break end
  redis.call('ZREM', KEYS[1], oldest)
  used = redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[2], oldest) or '0'))
  redis.call('HDEL', KEYS[2], oldest)
  redis.call('SADD', KEYS[6], oldest)
  out[#out + 1] = oldest
end
return out
"""

# KEYS: lru sizes used; ARGV: blocks. Stops accounting them; returns how many were listed.
RELEASE = """
local n = 0
for i = 1, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[2], ARGV[i]) or '0'))
    redis.call('HDEL', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return n
"""

# KEYS: lru clock; ARGV: blocks. Moves the listed ones to the recent end, in order.
TOUCH = """
for i = 1, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', redis.call('INCR', KEYS[2]), ARGV[i])
  end
end
return 0
"""

# KEYS: lru sizes used epochs; ARGV: count epoch. Takes up to `count` blocks out of the
# epoch's accounting, oldest first, and returns them (the caller deletes their keys);
# once none is left, removes the epoch's keys and returns {}.
TAKE = """
local popped = redis.call('ZPOPMIN', KEYS[1], tonumber(ARGV[1]))
local out = {}
for i = 1, #popped, 2 do
  local block = popped[i]
  redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[2], block) or '0'))
  redis.call('HDEL', KEYS[2], block)
  out[#out + 1] = block
end
if #out == 0 then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
  redis.call('SREM', KEYS[4], ARGV[2])
end
return out
"""

# KEYS: doomed lru writing; ARGV: count age_s. Up to `count` evicted blocks whose keys
# may still exist, and blocks whose write began `age_s` or more ago and was never
# admitted (its server stopped in between): both left out if listed in lru.
SWEEP = """
local out = {}
for _, block in ipairs(redis.call('SPOP', KEYS[1], tonumber(ARGV[1]))) do
  if not redis.call('ZSCORE', KEYS[2], block) then out[#out + 1] = block end
end
local cutoff = tonumber(redis.call('TIME')[1]) - tonumber(ARGV[2])
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', cutoff, 'LIMIT', 0, tonumber(ARGV[1]))
for _, block in ipairs(stale) do
  redis.call('ZREM', KEYS[3], block)
  if not redis.call('ZSCORE', KEYS[2], block) then out[#out + 1] = block end
end
return out
"""

# KEYS: writing; ARGV: blocks. Notes that their writes begin now (SWEEP's second part).
WRITING = """
local now = tonumber(redis.call('TIME')[1])
for i = 1, #ARGV do redis.call('ZADD', KEYS[1], now, ARGV[i]) end
return 0
"""

# KEYS: the block; ARGV: header payload. First writer wins: SET NX of the whole value.
PUT_BLOCK = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('APPEND', KEYS[1], ARGV[2])
return 1
"""

# KEYS: the delete stream. {first id, last id, last generated id} ("" where the stream
# is empty), or {} when there is no stream: ids only, never an entry, so what a writer
# to Redis planted in the stream stays there.
STREAM_ENDS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
local generated = last and last[1] or ''
if not last then
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then generated = info[i + 1] end
  end
end
return {first and first[1] or '', last and last[1] or '', generated}
"""
