"""Writes block_codec.json: known-answer vectors for the block codec's header and payload.

Run by hand only when the block format changes on purpose (and bump FORMAT_VERSION):
`python tests/vectors/make_block_codec.py`. Bytes are packed here with `struct` from
the format described in `replica_agent/codec.py`, without importing it or torch, so
the test compares two independent readings of the format.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).with_name("block_codec.json")
HEADER_BYTES = 64
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}
ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def header(spec: dict[str, Any]) -> bytes:
    elements = spec["num_layers"] * 2 * spec["num_kv_heads"] * spec["block_tokens"]
    elements *= spec["head_dim"]
    packed = struct.pack(
        "<8sHHIIIIIIQ",
        b"KVSBLOCK",
        1,
        DTYPE_CODES[spec["dtype"]],
        spec["num_layers"],
        spec["num_kv_heads"],
        spec["block_tokens"],
        spec["head_dim"],
        spec["tp_rank"],
        spec["tp_size"],
        elements * ITEM_BYTES[spec["dtype"]],
    )
    return packed + bytes(HEADER_BYTES - len(packed))


def element_bytes(value: float, dtype: str) -> bytes:
    if dtype == "float32":
        return struct.pack("<f", value)
    if dtype == "float16":
        return struct.pack("<e", value)
    # bfloat16 is the top half of a float32; the values used are exact in it.
    return struct.pack("<f", value)[2:]


def spec(dtype: str, **overrides: Any) -> dict[str, Any]:
    base = {
        "model_id": "kvshare/vector",
        "revision": "v1",
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 2,
        "dtype": dtype,
        "block_tokens": 2,
        "tp_rank": 0,
        "tp_size": 1,
    }
    return base | overrides


def main() -> None:
    # [layers=1, 2 (k, v), heads=1, tokens=2, dim=2] in C order; exact in all three dtypes.
    values = [-2.0, -1.5, -0.25, 0.0, 0.5, 1.0, 1.75, 3.0]
    blocks = []
    for dtype in DTYPE_CODES:
        s = spec(dtype)
        payload = b"".join(element_bytes(v, dtype) for v in values)
        blocks.append({"spec": s, "values": values, "block_hex": (header(s) + payload).hex()})
    large = spec(
        "bfloat16",
        model_id="meta/llama",
        revision="main",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        block_tokens=256,
        tp_rank=1,
        tp_size=2,
    )
    document = {
        "format_version": 1,
        "header_bytes": HEADER_BYTES,
        "headers": [{"spec": large, "header_hex": header(large).hex()}],
        "blocks": blocks,
    }
    OUTPUT.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
