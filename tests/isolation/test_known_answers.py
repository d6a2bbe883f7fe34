"""Known-answer vectors for storage names and sealed blocks (tests/vectors/*.json).

The vectors were written by generator scripts that re-implement the formulas without
`policy`; a format change therefore fails here instead of silently orphaning every
stored block or every sealed payload.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from policy.naming import BlockNamer, derive_naming_key
from policy.sealing import BlockSealer, Keyring, SealError, TenantKeys
from policy.types import BlockDigest, ModelName, TenantId

VECTORS = Path(__file__).resolve().parents[1] / "vectors"
NAMES = json.loads((VECTORS / "storage_names.json").read_text())["cases"]
SEALED = json.loads((VECTORS / "sealed_blocks.json").read_text())["cases"]


@pytest.mark.parametrize("case", NAMES, ids=lambda c: c["name"])
def test_storage_names_match_the_vectors(case: dict[str, Any]) -> None:
    secret = bytes.fromhex(case["server_secret_hex"])
    tenant = TenantId(case["tenant"])
    key = derive_naming_key(secret, tenant, case["epoch"])
    assert key.hex() == case["naming_key_hex"]
    namer = BlockNamer(secret, {tenant: case["epoch"]})
    name = namer.storage_key(
        tenant, ModelName(case["model"]), BlockDigest(bytes.fromhex(case["digest_hex"]))
    )
    assert name.hex() == case["storage_name_hex"]


def test_the_name_vectors_are_pairwise_distinct() -> None:
    names = [c["storage_name_hex"] for c in NAMES]
    assert len(set(names)) == len(names)


def _sealer(case: dict[str, Any]) -> BlockSealer:
    keys = TenantKeys({case["key_version"]: bytes.fromhex(case["key_hex"])})
    return BlockSealer(Keyring({case["tenant"]: keys}))


@pytest.mark.parametrize("case", SEALED, ids=lambda c: c["name"])
def test_sealed_blocks_match_the_vectors(case: dict[str, Any]) -> None:
    sealer = _sealer(case)
    digest = bytes.fromhex(case["digest_hex"])
    plaintext = bytes.fromhex(case["plaintext_hex"])
    sealed = sealer.seal(
        case["tenant"], case["model"], digest, plaintext, nonce=bytes.fromhex(case["nonce_hex"])
    )
    assert sealed.hex() == case["sealed_hex"]
    assert sealer.open(
        case["tenant"], case["model"], digest, bytes.fromhex(case["sealed_hex"])
    ) == (plaintext)


@pytest.mark.parametrize("case", SEALED, ids=lambda c: c["name"])
def test_a_vector_opened_under_the_wrong_binding_fails(case: dict[str, Any]) -> None:
    sealer = _sealer(case)
    sealed = bytes.fromhex(case["sealed_hex"])
    digest = bytes.fromhex(case["digest_hex"])
    assert sealer.open(case["tenant"], case["model"], digest, sealed) is not None  # control
    with pytest.raises(SealError):
        sealer.open(case["tenant"], case["model"] + "x", digest, sealed)
    with pytest.raises(SealError):
        sealer.open(case["tenant"], case["model"], bytes(a ^ 1 for a in digest), sealed)
