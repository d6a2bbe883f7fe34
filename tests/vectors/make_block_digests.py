"""Writes block_digests.json: known-answer vectors for the block digest chain (docs/design.md §4).

Run once, by hand, when the chain format changes on purpose (and bump the chain's
version string then): `python tests/vectors/make_block_digests.py`. The digests are
computed here from the written-out formula, not with `replica_agent.hashing`, so
the test compares two independent readings of the design.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from kvcommon.encoding import enc

OUTPUT = Path(__file__).with_name("block_digests.json")


def chain(
    model: str,
    block_tokens: int,
    token_ids: list[int],
    salt: bytes,
    lora_id: str | None,
    mm_spans: list[tuple[int, int, bytes]],
) -> list[str]:
    digest = hashlib.sha256(enc("kvshare/chain/v1", model, salt)).digest()
    out = []
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        end = start + block_tokens
        keys: list[str | bytes] = []
        if lora_id is not None:
            keys += ["lora", lora_id.encode()]
        for offset, length, content in sorted(mm_spans):
            if offset < end and offset + length > start:
                keys += ["mm", enc(offset, length, content)]
        tokens = b"".join(struct.pack("<I", t) for t in token_ids[start:end])
        digest = hashlib.sha256(enc(digest, tokens, enc(*keys))).digest()
        out.append(digest.hex())
    return out


def case(
    name: str,
    model: str,
    block_tokens: int,
    token_ids: list[int],
    salt: bytes = b"",
    lora_id: str | None = None,
    mm_spans: tuple[tuple[int, int, bytes], ...] = (),
) -> dict[str, Any]:
    return {
        "name": name,
        "model": model,
        "block_tokens": block_tokens,
        "salt_hex": salt.hex(),
        "lora_id": lora_id,
        "mm_spans": [
            {"offset": o, "length": n, "content_hash_hex": h.hex()} for o, n, h in mm_spans
        ],
        "token_ids": token_ids,
        "root_hex": hashlib.sha256(enc("kvshare/chain/v1", model, salt)).digest().hex(),
        "digests_hex": chain(model, block_tokens, token_ids, salt, lora_id, list(mm_spans)),
    }


def main() -> None:
    model = "kvshare/tiny-llama@seed0;fp32;L8;H4;D64;B4;tp0/1"
    image = hashlib.sha256(b"image-a").digest()
    cases = [
        case("empty prompt", model, 4, []),
        case("partial block only", model, 4, [1, 2, 3]),
        case("three blocks and a tail", model, 4, list(range(14))),
        case("extreme token ids", model, 4, [0, 2**32 - 1, 2**31, 1, 7, 7, 7, 7]),
        case("salted", model, 4, list(range(14)), salt=b"user-salt-0123"),
        case("lora", model, 4, list(range(14)), lora_id="adapter-7"),
        case("lora bytes equal an mm hash", model, 4, list(range(8)), lora_id="abc"),
        case(
            "multimodal span across blocks 1 and 2",
            model,
            4,
            list(range(14)),
            mm_spans=((6, 4, image),),
        ),
        case("other model", "other/model@main;bf16;L2;H1;D8;B4;tp0/1", 4, list(range(14))),
        case("block of 16", model.replace("B4", "B16"), 16, list(range(40))),
    ]
    OUTPUT.write_text(json.dumps({"chain": "kvshare/chain/v1", "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
