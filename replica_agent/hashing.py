"""Block digests: the SHA-256 chain that names a prompt's full blocks (docs/design.md §4).

    d_0 = H(enc("kvshare/chain/v1", model, salt))
    d_i = H(enc(d_{i-1}, tokens of block i, enc(extra keys of block i)))

Invariant: the digest of block i commits to the model and layout, the salt, every
token of blocks 0..i and every extra key that applied to them, so equal digests mean
equal KV (prefix property: the digests of a prefix are a prefix of the digests).
Only full blocks get a digest; a partial tail is never stored.

Every field goes through `kvcommon.encoding.enc`, never plain concatenation, and each
extra key carries its kind as a tag: a LoRA id and a multimodal hash with the same
bytes hash differently (the collision vLLM once had between untagged fields).

No torch here; the hasher runs wherever the prompt's token ids are.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvcommon.encoding import enc

CHAIN_DOMAIN = "kvshare/chain/v1"
DIGEST_BYTES = 32
# Token ids are packed as little-endian u32: every vocabulary in use fits, and a fixed
# width keeps the hash input independent of how the caller stored the ids.
MAX_TOKEN_ID = 2**32 - 1


class ExtraKeyKind(StrEnum):
    """What an extra key means; the kind is hashed as a tag next to the value."""

    LORA = "lora"  # the adapter that produced the KV; applies to every block
    MM = "mm"  # multimodal content; applies to the blocks its placeholder tokens fall in


@dataclass(frozen=True)
class ExtraKey:
    """A typed, tagged input to one block's digest besides its tokens."""

    kind: ExtraKeyKind
    value: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ExtraKeyKind):
            raise TypeError(f"kind must be an ExtraKeyKind, not {self.kind!r}")
        if not isinstance(self.value, bytes):
            raise TypeError(f"value must be bytes, not {type(self.value).__name__}")


@dataclass(frozen=True)
class MultimodalSpan:
    """Placeholder tokens `[offset, offset + length)` of the prompt that stand for media.

    The placeholder ids are the same for every image, so the media itself must enter
    the digest: `content_hash` is the caller's hash of the media bytes (for example
    SHA-256 of the decoded image). The span's position is hashed too, so two images in
    one block keep their order.
    """

    offset: int
    length: int
    content_hash: bytes

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(
                f"multimodal span offset={self.offset} length={self.length} is empty or "
                "negative; give the first placeholder token index and a length of at least 1"
            )
        if not isinstance(self.content_hash, bytes) or not self.content_hash:
            raise ValueError("content_hash must be non-empty bytes (a hash of the media content)")

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and self.offset + self.length > start

    def extra_key(self) -> ExtraKey:
        return ExtraKey(ExtraKeyKind.MM, enc(self.offset, self.length, self.content_hash))


def chain_root(model: str, salt: bytes = b"") -> bytes:
    """`d_0`: seeds the chain with the model/layout name and the optional salt."""
    if not model:
        raise ValueError("model is empty; pass ModelSpec.wire_model()")
    if not isinstance(salt, bytes):
        raise TypeError(
            f"salt must be bytes (derived from the user's identity), not {type(salt).__name__}"
        )
    return hashlib.sha256(enc(CHAIN_DOMAIN, model, salt)).digest()


def chain_step(previous: bytes, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey]) -> bytes:
    """`d_i` from `d_{i-1}`, the tokens of block i and the extra keys that apply to it."""
    if len(previous) != DIGEST_BYTES:
        raise ValueError(f"previous digest is {len(previous)} bytes; it must be {DIGEST_BYTES}")
    keys = enc(*(field for key in extra_keys for field in (key.kind.value, key.value)))
    return hashlib.sha256(enc(previous, pack_token_ids(token_ids), keys)).digest()


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian u32; rejects ids outside `[0, 2**32)`."""
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error:
        for position, token in enumerate(token_ids):
            if isinstance(token, bool) or not hasattr(token, "__index__"):
                raise TypeError(
                    f"token id at {position} is a {type(token).__name__}; pass ints"
                ) from None
            if not 0 <= int(token) <= MAX_TOKEN_ID:
                raise ValueError(
                    f"token id {int(token)} at {position} is outside [0, 2**32); "
                    "pass the tokenizer's ids unchanged"
                ) from None
        raise


class BlockHasher:
    """Digests of a prompt's full blocks for one model, salt and LoRA adapter.

    `salt` isolates end users within a tenant. The caller derives it from the end
    user's *authenticated* identity (for example an HMAC of the user id under a
    tenant secret); it must never be a value the client chose, or one user could
    pick another's salt and read their prefixes. Empty means tenant-wide sharing.
    """

    def __init__(
        self, model: str, block_tokens: int, salt: bytes = b"", lora_id: str | None = None
    ) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens is {block_tokens}; use a positive block size")
        if lora_id == "":
            raise ValueError("lora_id is empty; pass None for the base model")
        self.model = model
        self.block_tokens = block_tokens
        self._root = chain_root(model, salt)
        self._lora_keys: tuple[ExtraKey, ...] = (
            (ExtraKey(ExtraKeyKind.LORA, lora_id.encode("utf-8")),) if lora_id is not None else ()
        )

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_tokens

    def digests(
        self, token_ids: Sequence[int], mm_spans: Sequence[MultimodalSpan] = ()
    ) -> list[bytes]:
        """One 32-byte digest per full block of `token_ids`, in order.

        A span applies to every block its placeholder tokens overlap; spans are hashed
        in order of offset, so the caller's order does not matter.
        """
        return self.digests_from(self._root, 0, token_ids, mm_spans)

    def digests_from(
        self,
        previous: bytes,
        first_block: int,
        token_ids: Sequence[int],
        mm_spans: Sequence[MultimodalSpan] = (),
    ) -> list[bytes]:
        """The digests of full blocks `first_block ..` of `token_ids`, chained from
        `previous` instead of this hasher's root (a private chain after a public
        prefix: replica_agent.public)."""
        return list(self.iter_digests_from(previous, first_block, token_ids, mm_spans))

    def iter_digests(
        self, token_ids: Sequence[int], mm_spans: Sequence[MultimodalSpan] = ()
    ) -> Iterator[bytes]:
        """`digests`, one at a time: a caller that stops early hashes no further."""
        return self.iter_digests_from(self._root, 0, token_ids, mm_spans)

    def iter_digests_from(
        self,
        previous: bytes,
        first_block: int,
        token_ids: Sequence[int],
        mm_spans: Sequence[MultimodalSpan] = (),
    ) -> Iterator[bytes]:
        ordered_spans = sorted(
            mm_spans, key=lambda span: (span.offset, span.length, span.content_hash)
        )
        for block in range(first_block, self.num_full_blocks(len(token_ids))):
            start, end = block * self.block_tokens, (block + 1) * self.block_tokens
            keys = self._lora_keys + tuple(
                span.extra_key() for span in ordered_spans if span.overlaps(start, end)
            )
            previous = chain_step(previous, token_ids[start:end], keys)
            yield previous
