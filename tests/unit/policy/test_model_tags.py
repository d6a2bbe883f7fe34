"""Model tags are kept per (tenant, model) and are the same bytes as computed afresh."""

from __future__ import annotations

import hmac

from kvcommon.encoding import enc
from policy import naming
from policy.naming import MODEL_TAG_LABEL, BlockNamer, derive_naming_key
from policy.types import ModelName, TenantId

SECRET = bytes(range(32))
A, B = TenantId("alpha"), TenantId("beta")


def fresh(tenant: TenantId, model: str, epoch: int = 0) -> bytes:
    key = derive_naming_key(SECRET, tenant, epoch)
    return hmac.digest(key, enc(MODEL_TAG_LABEL, model), "sha256")[: naming.MODEL_TAG_BYTES]


def test_kept_tags_are_the_tenants_own_across_many_models() -> None:
    namer = BlockNamer(SECRET, {B: 3})
    models = [ModelName(f"org/model-{n};fp16;L{n % 7}") for n in range(naming.MODEL_TAGS_KEPT + 5)]
    for _ in range(2):  # the second pass reads kept tags (and the bound drops them once)
        for model in models[::97] + models[-3:]:
            assert namer.model_tag(A, model) == fresh(A, model)
            assert namer.model_tag(B, model) == fresh(B, model, epoch=3)
            assert namer.model_tag(A, model) != namer.model_tag(B, model)
    for model in models:  # past the bound: still right
        assert namer.model_tag(A, model) == fresh(A, model)
    assert len(namer._model_tags) <= naming.MODEL_TAGS_KEPT
