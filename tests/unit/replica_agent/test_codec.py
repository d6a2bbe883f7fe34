"""Block codec and model spec: known-answer vectors, exact round trips, malformed input."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replica_agent import codec
from replica_agent.codec import (
    HEADER_BYTES,
    MAGIC,
    TORCH_DTYPES,
    BlockFormatError,
    decode_block,
    encode_block,
    encode_header,
    is_finite,
    tensor_bytes,
)
from replica_agent.spec import ModelSpec
from tests.support.repo import VECTORS_DIR

VECTORS = json.loads((VECTORS_DIR / "block_codec.json").read_text())
DTYPES = ["float32", "bfloat16", "float16"]


def make_spec(dtype: str = "float32", **overrides: Any) -> ModelSpec:
    fields: dict[str, Any] = {
        "model_id": "kvshare/test",
        "revision": "r1",
        "num_layers": 2,
        "num_kv_heads": 3,
        "head_dim": 4,
        "dtype": dtype,
        "block_tokens": 5,
    }
    return ModelSpec(**(fields | overrides))


def random_block(spec: ModelSpec, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(spec.block_shape, generator=generator).to(TORCH_DTYPES[spec.dtype])


def bits(tensor: torch.Tensor) -> torch.Tensor:
    # Compare bit patterns, so -0.0 vs 0.0 or NaN payloads would show.
    return tensor.contiguous().view(torch.uint8)


# --- known answers -------------------------------------------------------------------


@pytest.mark.parametrize("case", VECTORS["headers"])
def test_header_vector(case: dict[str, Any]) -> None:
    assert encode_header(ModelSpec(**case["spec"])).hex() == case["header_hex"]


@pytest.mark.parametrize("case", VECTORS["blocks"], ids=lambda c: c["spec"]["dtype"])
def test_block_vector(case: dict[str, Any]) -> None:
    spec = ModelSpec(**case["spec"])
    kv = torch.tensor(case["values"], dtype=TORCH_DTYPES[spec.dtype]).reshape(spec.block_shape)
    assert encode_block(spec, kv).hex() == case["block_hex"]
    decoded = decode_block(spec, bytes.fromhex(case["block_hex"]))
    assert torch.equal(bits(decoded), bits(kv))


def test_header_is_aligned_and_payload_follows() -> None:
    spec = make_spec()
    data = encode_block(spec, random_block(spec))
    assert HEADER_BYTES % 64 == 0
    assert len(data) == HEADER_BYTES + spec.block_payload_bytes
    assert data.startswith(MAGIC)


# --- round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact(dtype: str) -> None:
    spec = make_spec(dtype)
    kv = random_block(spec)
    extreme = torch.finfo(kv.dtype).max  # infinities are refused (the test after next)
    kv.view(-1)[:3] = torch.tensor([extreme, -extreme, -0.0])
    decoded = decode_block(spec, encode_block(spec, kv))
    assert decoded.dtype == kv.dtype and decoded.shape == kv.shape
    assert torch.equal(bits(decoded), bits(kv))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_into_out_buffer(dtype: str) -> None:
    spec = make_spec(dtype)
    kv = random_block(spec, seed=1)
    out = torch.zeros(spec.block_shape, dtype=TORCH_DTYPES[dtype])
    data = bytearray(encode_block(spec, kv))
    assert decode_block(spec, memoryview(data), out=out) is out
    assert torch.equal(bits(out), bits(kv))
    data[HEADER_BYTES] ^= 0xFF  # the result must not alias the caller's buffer
    assert torch.equal(bits(out), bits(kv))


def test_encode_accepts_non_contiguous_and_inference_tensors() -> None:
    spec = make_spec()
    kv = random_block(spec)
    strided = kv.transpose(3, 4).contiguous().transpose(3, 4)
    assert not strided.is_contiguous()
    with torch.inference_mode():
        inference = kv.clone()
    expected = encode_block(spec, kv)
    assert encode_block(spec, strided) == expected
    assert encode_block(spec, inference) == expected


def test_encode_rejects_wrong_shape_or_dtype() -> None:
    spec = make_spec()
    with pytest.raises(ValueError, match="shape"):
        encode_block(spec, torch.zeros(2, 2, 3, 5, 5))
    with pytest.raises(ValueError, match="dtype"):
        encode_block(spec, torch.zeros(spec.block_shape, dtype=torch.float16))


def test_decode_rejects_bad_out_buffer() -> None:
    spec = make_spec()
    data = encode_block(spec, random_block(spec))
    with pytest.raises(ValueError, match="allocate"):
        decode_block(spec, data, out=torch.empty(spec.block_shape, dtype=torch.float16))
    strided = torch.empty(2, 2, 3, 4, 5).transpose(3, 4)
    with pytest.raises(ValueError, match="contiguous"):
        decode_block(spec, data, out=strided)


# --- malformed input -----------------------------------------------------------------


def _patched(data: bytes, offset: int, fmt: str, value: int | bytes) -> bytes:
    patched = bytearray(data)
    struct.pack_into(fmt, patched, offset, value)
    return bytes(patched)


def _malformed_cases() -> dict[str, tuple[bytes, str]]:
    spec = make_spec()
    good = encode_block(spec, random_block(spec))
    # Field offsets in the header: see the layout in replica_agent/codec.py.
    return {
        "empty": (b"", "shorter than"),
        "header only, cut": (good[:40], "shorter than"),
        "bad magic": (_patched(good, 0, "<8s", b"NOTABLOK"), "magic"),
        "future version": (_patched(good, 8, "<H", 2), "version"),
        "dtype": (_patched(good, 10, "<H", 3), "dtype_code"),
        "unknown dtype": (_patched(good, 10, "<H", 99), "dtype_code"),
        "layers": (_patched(good, 12, "<I", 3), "num_layers"),
        "heads": (_patched(good, 16, "<I", 1), "kv_heads"),
        "block tokens": (_patched(good, 20, "<I", 6), "block_tokens"),
        "head dim": (_patched(good, 24, "<I", 8), "head_dim"),
        "tp rank": (_patched(good, 28, "<I", 1), "tp_rank"),
        "tp size": (_patched(good, 32, "<I", 2), "tp_size"),
        "payload length field": (_patched(good, 36, "<Q", 8), "payload_bytes"),
        "reserved bytes": (_patched(good, 60, "<I", 1), "reserved"),
        "truncated payload": (good[:-1], "truncated"),
        "extra bytes": (good + b"\x00", "truncated or padded"),
    }


@pytest.mark.parametrize("name", sorted(_malformed_cases()))
def test_decode_rejects_malformed(name: str) -> None:
    data, message = _malformed_cases()[name]
    with pytest.raises(BlockFormatError, match=message):
        decode_block(make_spec(), data)


@pytest.mark.parametrize("other", [make_spec("bfloat16"), make_spec(num_layers=3)])
def test_decode_rejects_block_of_another_spec(other: ModelSpec) -> None:
    data = encode_block(other, random_block(other))
    with pytest.raises(BlockFormatError, match="does not match the model spec"):
        decode_block(make_spec(), data)


def test_malformed_input_leaves_out_untouched() -> None:
    spec = make_spec()
    out = torch.full(spec.block_shape, 7.0)
    data = encode_block(spec, random_block(spec))
    with pytest.raises(BlockFormatError):
        decode_block(spec, data[:-4], out=out)
    assert bool((out == 7.0).all())


@settings(max_examples=300)
@given(st.binary(max_size=HEADER_BYTES + 1200))
def test_random_bytes_raise_only_block_format_error(data: bytes) -> None:
    with pytest.raises(BlockFormatError):
        decode_block(make_spec(), data)


@settings(max_examples=300)
@given(st.data())
def test_corrupted_header_raises_only_block_format_error(data: st.DataObject) -> None:
    spec = make_spec("bfloat16")
    block = bytearray(encode_block(spec, random_block(spec)))
    position = data.draw(st.integers(0, HEADER_BYTES - 1))
    block[position] ^= data.draw(st.integers(1, 255))
    length = data.draw(st.integers(0, len(block)))
    with pytest.raises(BlockFormatError):
        decode_block(spec, bytes(block[:length]))


# --- model spec ----------------------------------------------------------------------


def test_wire_model_names_model_and_layout() -> None:
    spec = ModelSpec("meta/llama", "rev", 8, 4, 64, "float32", block_tokens=256)
    assert spec.wire_model() == "meta/llama@rev;fp32;L8;H4;D64;B256;tp0/1"
    assert spec.block_payload_bytes == 8 * 2 * 4 * 256 * 64 * 4


def test_every_layout_field_changes_wire_model() -> None:
    base = make_spec()
    variants = [
        make_spec(model_id="kvshare/other"),
        make_spec(revision="r2"),
        make_spec(num_layers=3),
        make_spec(num_kv_heads=1),
        make_spec(head_dim=8),
        make_spec(dtype="bfloat16"),
        make_spec(block_tokens=6),
        make_spec(tp_rank=1, tp_size=2),
        make_spec(tp_size=2),
    ]
    names = {spec.wire_model() for spec in variants}
    assert base.wire_model() not in names and len(names) == len(variants)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model_id": ""}, "model_id is empty"),
        ({"model_id": "a@b"}, "characters outside"),
        ({"revision": "main;fp16"}, "characters outside"),
        ({"revision": "x" * 129}, "shorten"),
        ({"dtype": "float64"}, "not supported"),
        ({"num_layers": 0}, "positive"),
        ({"block_tokens": -1}, "positive"),
        ({"tp_rank": 1}, "tp_rank"),
    ],
)
def test_spec_validation_says_what_to_change(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_spec(**overrides)


def test_spec_rejects_non_int_counts() -> None:
    with pytest.raises(TypeError, match="head_dim"):
        make_spec(head_dim=4.0)
    with pytest.raises(TypeError, match="num_layers"):
        make_spec(num_layers=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_block_with_a_non_finite_value_is_refused_before_it_is_copied(
    dtype: str, value: float
) -> None:
    """Anywhere in the block (a piece boundary of the check included); the largest
    finite values and negative zeros pass."""
    spec = ModelSpec("m", "r", num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype)
    extreme = torch.finfo(TORCH_DTYPES[spec.dtype]).max
    kv = torch.full(spec.block_shape, -extreme).to(TORCH_DTYPES[spec.dtype])
    kv.view(-1)[::7] = extreme
    kv.view(-1)[1] = -0.0
    data = encode_block(spec, kv)
    assert torch.equal(decode_block(spec, data), kv)  # positive control
    out = torch.zeros(spec.block_shape, dtype=TORCH_DTYPES[spec.dtype])
    for position in (0, kv.numel() // 2, kv.numel() - 1):
        bad = kv.clone()
        bad.view(-1)[position] = value
        with pytest.raises(BlockFormatError, match="NaN or infinite"):
            decode_block(spec, encode_block(spec, bad), out=out)
        with pytest.raises(BlockFormatError):
            tensor_bytes(spec, encode_block(spec, bad))
    assert not out.any()  # nothing was copied


@pytest.mark.slow
def test_the_finite_check_covers_every_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "FINITE_CHECK_ELEMENTS", 5)  # blocks of many pieces
    spec = ModelSpec("m", "r", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")
    kv = torch.ones(spec.block_shape)
    for position in range(0, kv.numel(), 3):
        bad = kv.clone()
        bad.view(-1)[position] = float("nan")
        assert not is_finite(spec, memoryview(encode_block(spec, bad))[64:])
    assert is_finite(spec, memoryview(encode_block(spec, kv))[64:])
