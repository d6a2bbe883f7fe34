"""Types that carry the trust boundary.

A `BlockDigest` is what a client sent; a `StorageKey` is what the server stores under.
Only `policy.naming` makes a `StorageKey`, so handing a client digest straight to the
store is a type error under `mypy --strict`.
"""

from __future__ import annotations

import re
from typing import NewType

from kvcommon.errors import InvalidArgument

TenantId = NewType("TenantId", str)
ModelName = NewType("ModelName", str)
BlockDigest = NewType("BlockDigest", bytes)
StorageKey = NewType("StorageKey", bytes)
# A keyed 16-byte tag of (tenant, model): lets the store find a model's blocks for a
# namespace delete without ever holding the model string.
ModelTag = NewType("ModelTag", bytes)

DIGEST_BYTES = 32
MAX_MODEL_CHARS = 512  # a model id plus its layout string; longer is a client bug
_TENANT_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
# The public scope's id on the wire and in BlockClient (policy.access, `[public]`): a
# configured tenant id cannot start with "@", so no tenant can take it.
PUBLIC = TenantId("@public")


def is_valid_tenant_id(value: str) -> bool:
    """Whether `value` may name a configured tenant (never the public scope)."""
    return _TENANT_RE.fullmatch(value) is not None


def parse_tenant_id(value: str) -> TenantId:
    """A request's tenant: a configured tenant's id, or the public scope `@public`."""
    if value == PUBLIC:
        return PUBLIC
    if not is_valid_tenant_id(value):
        raise InvalidArgument(
            "tenant must match [a-z0-9][a-z0-9._-]{0,62} or be the public scope "
            f"{PUBLIC!r}; set `tenant` to a configured tenant id"
        )
    return TenantId(value)


def parse_model(value: str) -> ModelName:
    if not value:
        raise InvalidArgument("model is empty; name the model and its KV layout in `model`")
    if len(value) > MAX_MODEL_CHARS:
        raise InvalidArgument(f"model is {len(value)} characters; the limit is {MAX_MODEL_CHARS}")
    return ModelName(value)


def parse_digest(value: bytes, position: int) -> BlockDigest:
    if len(value) != DIGEST_BYTES:
        raise InvalidArgument(
            f"digest {position} is {len(value)} bytes; every digest must be "
            f"{DIGEST_BYTES} bytes (SHA-256 of the block chain)"
        )
    return BlockDigest(value)
