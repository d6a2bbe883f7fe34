"""The model spec: which model a block belongs to and the exact layout of its bytes.

Invariant: two specs that could give different KV bytes for the same tokens never
share a `wire_model()` string, so their blocks never share a digest chain or a
storage name. The string therefore names the model (id and revision) *and* the layout
(dtype, layers, KV heads, head dim, block size, tensor-parallel rank and size).

No torch here: the spec is plain data, shared by the hasher, the codec and the client.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Short names keep `wire_model()` compact; the codec maps the long names to torch dtypes.
_DTYPE_SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_DTYPE_ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SUPPORTED_DTYPES = tuple(_DTYPE_SHORT_NAMES)

# `@` and `;` separate the parts of `wire_model()`; keeping them (and whitespace) out
# of ids and revisions means the string splits back into its parts one way only.
_ID_RE = re.compile(r"[A-Za-z0-9._/:+-]+")
MAX_MODEL_ID_CHARS = 256
MAX_REVISION_CHARS = 128  # a 40-hex commit or a branch name; the server caps the whole at 512
# Header fields of the block codec are u32; larger values are a configuration mistake.
_MAX_U32 = 2**32 - 1


class BlockFormatError(ValueError):
    """The bytes are not a block of the expected spec (any header or length mismatch);
    raised by the codec (replica_agent/codec.py)."""


@dataclass(frozen=True)
class ModelSpec:
    """A model and the canonical layout of one KV block.

    `num_kv_heads` is the number of KV heads *in this rank's blocks*: with tensor
    parallelism each rank stores its own shard, named by `tp_rank`/`tp_size`.
    A block's tensor is `[num_layers, 2 (k, v), num_kv_heads, block_tokens, head_dim]`.
    """

    model_id: str
    revision: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int = 256
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        _check_id("model_id", self.model_id, MAX_MODEL_ID_CHARS)
        _check_id("revision", self.revision, MAX_REVISION_CHARS)
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            _check_count(name, getattr(self, name))
        if self.dtype not in _DTYPE_SHORT_NAMES:
            raise ValueError(
                f"dtype {self.dtype!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}"
            )
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int):
            raise TypeError(f"tp_rank must be an int, not {type(self.tp_rank).__name__}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"tp_rank {self.tp_rank} is outside [0, tp_size={self.tp_size}); "
                "set tp_rank to this replica's tensor-parallel rank"
            )

    def wire_model(self) -> str:
        """The model name sent to the store and hashed into the chain: model and layout.

        Example: ``meta/llama@rev;fp32;L8;H4;D64;B256;tp0/1``.
        """
        return (
            f"{self.model_id}@{self.revision};{_DTYPE_SHORT_NAMES[self.dtype]};"
            f"L{self.num_layers};H{self.num_kv_heads};D{self.head_dim};"
            f"B{self.block_tokens};tp{self.tp_rank}/{self.tp_size}"
        )

    @property
    def dtype_item_bytes(self) -> int:
        return _DTYPE_ITEM_BYTES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """`[layers, 2 (k, v), kv_heads, block_tokens, head_dim]`, the canonical layout."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_payload_bytes(self) -> int:
        """Bytes of one block's tensor data (the codec adds a fixed header)."""
        elements = 1
        for dim in self.block_shape:
            elements *= dim
        return elements * self.dtype_item_bytes


def _check_id(name: str, value: object, max_chars: int) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} is empty; set it (a revision may be a commit hash or 'main')")
    if len(value) > max_chars:
        raise ValueError(f"{name} is {len(value)} characters; shorten it to {max_chars} or fewer")
    if _ID_RE.fullmatch(value) is None:
        raise ValueError(
            f"{name} {value!r} has characters outside [A-Za-z0-9._/:+-]; "
            "remove them ('@', ';' and whitespace separate the parts of the wire model name)"
        )


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 1 <= value <= _MAX_U32:
        raise ValueError(f"{name} is {value}; it must be a positive count below 2**32")
