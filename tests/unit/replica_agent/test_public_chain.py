"""replica_agent.public: the catalogue's layout and the public/private chain split."""

from __future__ import annotations

import os
import struct

import pytest

from replica_agent.hashing import BlockHasher
from replica_agent.public import (
    MAX_CATALOGUE_DIGESTS,
    CatalogueError,
    CatalogueFull,
    decode_catalogue,
    encode_catalogue,
    plan_chain,
)

MODEL, BLOCK = "m@r1;fp32;L2;H2;D8;B4;tp0/1", 4
FRAMEWORK = list(range(100, 112))  # three public blocks
PROMPT = FRAMEWORK + list(range(500, 508))  # then two private ones


def published(tokens: list[int]) -> frozenset[bytes]:
    return frozenset(BlockHasher(MODEL, BLOCK).digests(tokens))


def test_without_a_catalogue_the_chain_is_the_ordinary_one() -> None:
    for salt in (b"", b"user-salt"):
        plan = plan_chain(MODEL, BLOCK, PROMPT, frozenset(), salt=salt)
        assert plan.public_blocks == 0
        assert list(plan.digests) == BlockHasher(MODEL, BLOCK, salt).digests(PROMPT)


def test_listed_leading_blocks_are_public_and_the_rest_binds_them_and_the_salt() -> None:
    catalogue = published(FRAMEWORK)
    plain = BlockHasher(MODEL, BLOCK).digests(PROMPT)
    one = plan_chain(MODEL, BLOCK, PROMPT, catalogue, salt=b"user-1")
    two = plan_chain(MODEL, BLOCK, PROMPT, catalogue, salt=b"user-2")
    assert one.public_blocks == two.public_blocks == 3
    assert one.digests[:3] == two.digests[:3] == tuple(plain[:3])  # what was published
    assert set(one.digests[3:]).isdisjoint(plain) and set(one.digests[3:]).isdisjoint(catalogue)
    assert one.digests[3:] != two.digests[3:]  # users stay apart after the public prefix
    # The first private digest commits to the public prefix it follows.
    other_prefix = list(range(200, 212)) + PROMPT[12:]
    other = plan_chain(MODEL, BLOCK, other_prefix, published(other_prefix[:12]), salt=b"user-1")
    assert other.public_blocks == 3 and other.digests[3:] != one.digests[3:]


def test_a_private_prompt_matches_nothing_and_stays_on_its_own_chain() -> None:
    """The only digests a request sends to the public scope are those the catalogue
    lists: a prompt that does not begin with published text sends none."""
    private = list(range(900, 920))
    plan = plan_chain(MODEL, BLOCK, private, published(FRAMEWORK), salt=b"s")
    assert plan.public_blocks == 0
    assert list(plan.digests) == BlockHasher(MODEL, BLOCK, b"s").digests(private)
    # A partly matching prompt is public only up to its first unlisted block.
    diverging = FRAMEWORK[:8] + [7] * 12
    assert plan_chain(MODEL, BLOCK, diverging, published(FRAMEWORK)).public_blocks == 2


def test_the_catalogue_round_trips_and_refuses_what_is_not_one() -> None:
    digests = [os.urandom(32) for _ in range(5)]
    encoded = encode_catalogue(digests + digests[:2])
    assert decode_catalogue(encoded) == frozenset(digests)
    assert len(encoded) == 9 + 5 * 32  # unique, each once
    bad = [
        b"",
        b"KVPC",
        encoded[:-1],
        b"XXXX" + encoded[4:],
        encoded[:4] + b"\x02" + encoded[5:],
        encoded[:5] + struct.pack(">I", 4) + encoded[9:],
    ]
    for payload in bad:
        with pytest.raises(CatalogueError):
            decode_catalogue(payload)
    with pytest.raises(ValueError, match="each must be 32"):
        encode_catalogue([b"short"])
    too_many = (i.to_bytes(32, "big") for i in range(MAX_CATALOGUE_DIGESTS + 1))
    with pytest.raises(CatalogueFull, match="retire old publications"):
        encode_catalogue(too_many)
