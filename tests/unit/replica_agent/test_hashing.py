"""Block digest chain: known-answer vectors (tests/vectors/block_digests.json) and properties."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica_agent.hashing import (
    DIGEST_BYTES,
    BlockHasher,
    ExtraKey,
    ExtraKeyKind,
    MultimodalSpan,
    chain_root,
    chain_step,
)
from tests.support.repo import VECTORS_DIR

VECTORS = json.loads((VECTORS_DIR / "block_digests.json").read_text())["cases"]
MODEL = "kvshare/tiny-llama@seed0;fp32;L8;H4;D64;B4;tp0/1"
BLOCK = 4

token_ids = st.lists(st.integers(0, 2**32 - 1), max_size=6 * BLOCK)


def hasher(**kwargs: Any) -> BlockHasher:
    return BlockHasher(kwargs.pop("model", MODEL), BLOCK, **kwargs)


@pytest.mark.parametrize("case", VECTORS, ids=[c["name"] for c in VECTORS])
def test_known_answer_vectors(case: dict[str, Any]) -> None:
    salt = bytes.fromhex(case["salt_hex"])
    spans = [
        MultimodalSpan(s["offset"], s["length"], bytes.fromhex(s["content_hash_hex"]))
        for s in case["mm_spans"]
    ]
    h = BlockHasher(case["model"], case["block_tokens"], salt=salt, lora_id=case["lora_id"])
    assert [d.hex() for d in h.digests(case["token_ids"], mm_spans=spans)] == case["digests_hex"]
    assert chain_root(case["model"], salt).hex() == case["root_hex"]


def test_vectors_cover_every_kind_of_input() -> None:
    names = {c["name"] for c in VECTORS}
    assert {"salted", "lora", "multimodal span across blocks 1 and 2", "empty prompt"} <= names


@given(token_ids, st.integers(0, 6 * BLOCK))
def test_digests_of_a_prefix_are_a_prefix(tokens: list[int], cut: int) -> None:
    h = hasher()
    full = h.digests(tokens)
    assert h.digests(tokens[:cut]) == full[: min(cut, len(tokens)) // BLOCK]
    assert len(full) == len(tokens) // BLOCK
    assert all(len(d) == DIGEST_BYTES for d in full)


@given(st.lists(st.integers(0, 2**32 - 1), min_size=BLOCK, max_size=6 * BLOCK), st.data())
def test_changing_a_token_changes_its_block_and_all_later(tokens: list[int], data: Any) -> None:
    num_full = len(tokens) // BLOCK
    position = data.draw(st.integers(0, num_full * BLOCK - 1))
    new_value = data.draw(st.integers(0, 2**32 - 1).filter(lambda v: v != tokens[position]))
    changed = [*tokens[:position], new_value, *tokens[position + 1 :]]
    h = hasher()
    before, after = h.digests(tokens), h.digests(changed)
    block = position // BLOCK
    assert before[:block] == after[:block]
    assert all(b != a for b, a in zip(before[block:], after[block:], strict=True))


@settings(max_examples=50)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=BLOCK, max_size=4 * BLOCK))
def test_salt_lora_and_model_each_change_every_digest(tokens: list[int]) -> None:
    base = hasher().digests(tokens)
    variants = [
        hasher(salt=b"user-a").digests(tokens),
        hasher(lora_id="adapter").digests(tokens),
        hasher(model=MODEL.replace("fp32", "bf16")).digests(tokens),
    ]
    for other in variants:
        assert all(b != o for b, o in zip(base, other, strict=True))
    assert hasher(salt=b"user-a").digests(tokens) != hasher(salt=b"user-b").digests(tokens)


@given(st.binary(max_size=40), st.lists(st.integers(0, 2**32 - 1), max_size=BLOCK))
def test_lora_key_never_equals_mm_key_of_same_bytes(value: bytes, block: list[int]) -> None:
    previous = chain_root(MODEL)
    lora = chain_step(previous, block, [ExtraKey(ExtraKeyKind.LORA, value)])
    mm = chain_step(previous, block, [ExtraKey(ExtraKeyKind.MM, value)])
    assert lora != mm
    assert chain_step(previous, block, []) not in (lora, mm)


def test_multimodal_span_applies_only_to_blocks_it_overlaps() -> None:
    tokens = list(range(4 * BLOCK))
    span = MultimodalSpan(offset=BLOCK + 2, length=BLOCK, content_hash=b"\x01" * 32)
    other_image = MultimodalSpan(offset=BLOCK + 2, length=BLOCK, content_hash=b"\x02" * 32)
    plain = hasher().digests(tokens)
    with_image = hasher().digests(tokens, mm_spans=[span])
    # The span covers tokens 6..9: blocks 1 and 2; block 0 keeps its digest.
    assert with_image[0] == plain[0]
    assert all(p != w for p, w in zip(plain[1:], with_image[1:], strict=True))
    assert hasher().digests(tokens, mm_spans=[other_image])[1] != with_image[1]


def test_span_order_given_by_caller_does_not_matter() -> None:
    tokens = list(range(2 * BLOCK))
    a = MultimodalSpan(0, 2, b"a")
    b = MultimodalSpan(2, 2, b"b")
    assert hasher().digests(tokens, mm_spans=[a, b]) == hasher().digests(tokens, mm_spans=[b, a])
    swapped = [MultimodalSpan(0, 2, b"b"), MultimodalSpan(2, 2, b"a")]
    assert hasher().digests(tokens, mm_spans=swapped) != hasher().digests(tokens, mm_spans=[a, b])


def test_accepts_tuples_and_other_int_sequences() -> None:
    tokens = list(range(3 * BLOCK))
    assert hasher().digests(tuple(tokens)) == hasher().digests(tokens)
    assert hasher().digests(range(3 * BLOCK)) == hasher().digests(tokens)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_rejects_token_ids_outside_u32(bad: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        hasher().digests([1, 2, bad, 3])


def test_rejects_non_int_token_ids() -> None:
    with pytest.raises(TypeError, match="pass ints"):
        hasher().digests([1, 2, 3.0, 4])  # type: ignore[list-item]


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        BlockHasher(MODEL, 0)
    with pytest.raises(ValueError, match="model is empty"):
        BlockHasher("", BLOCK)
    with pytest.raises(ValueError, match="lora_id is empty"):
        BlockHasher(MODEL, BLOCK, lora_id="")
    with pytest.raises(ValueError, match="span"):
        MultimodalSpan(offset=0, length=0, content_hash=b"x")
    with pytest.raises(ValueError, match="content_hash"):
        MultimodalSpan(offset=0, length=1, content_hash=b"")
    with pytest.raises(ValueError, match="previous digest"):
        chain_step(b"short", [1], [])


def test_salt_must_be_bytes() -> None:
    with pytest.raises(TypeError, match="salt must be bytes"):
        BlockHasher(MODEL, BLOCK, salt="user-a")  # type: ignore[arg-type]
