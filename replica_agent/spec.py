"""The model spec: which model a block belongs to and the exact layout of its bytes.

Invariant: two specs that could give different KV bytes for the same tokens never
share a `wire_model()` string, so their blocks never share a digest chain or a
storage name. The string therefore names the model (id and revision) *and* the layout
(dtype, layers, KV heads, head dim, block size, tensor-parallel rank and size), and
the version of the weights that computed the blocks when one is given
(`weight_version`): weights updated in place under the same id and revision (a
fine-tune pushed again, an RL weight sync) give other KV for the same tokens, so a
replica of another weight version finds none of these blocks (a miss, never a load).

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
# A commit hash or a fingerprint (`sha256:` and 32 hex digits) fits; the longest id,
# revision, layout and version stay within the server's 512.
MAX_WEIGHT_VERSION_CHARS = 48
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
    # The weights' version ("": not versioned; such blocks are a namespace of their own)
    weight_version: str = ""

    def __post_init__(self) -> None:
        _check_id("model_id", self.model_id, MAX_MODEL_ID_CHARS)
        _check_id("revision", self.revision, MAX_REVISION_CHARS)
        if self.weight_version:
            check_weight_version(self.weight_version)
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

        Example: ``meta/llama@rev;fp32;L8;H4;D64;B256;tp0/1``, and with a weight
        version ``...;tp0/1;Wv7`` (without one the name is as it always was).
        """
        versioned = f";W{self.weight_version}" if self.weight_version else ""
        return (
            f"{self.model_id}@{self.revision};{_DTYPE_SHORT_NAMES[self.dtype]};"
            f"L{self.num_layers};H{self.num_kv_heads};D{self.head_dim};"
            f"B{self.block_tokens};tp{self.tp_rank}/{self.tp_size}{versioned}"
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


# The tail `wire_model()` ends with: the tensor-parallel shard, then the weight version.
MAX_TP_SHARDS = 1024  # namespaces an operator's delete names at most
_NAMESPACE_RE = re.compile(r"(?P<head>[^@;]+@.+);tp[0-9]+/(?P<size>[0-9]+)(?:;W[^;]+)?")


def namespaces_of_version(namespace: str, weight_version: str) -> list[str]:
    """Every tensor-parallel shard's namespace of the model `namespace` names (one
    shard's `wire_model()`), for weights `weight_version` ("": not versioned): what an
    operator deletes when that version is retired. ValueError saying what to pass."""
    if weight_version:
        check_weight_version(weight_version)
    parts = _NAMESPACE_RE.fullmatch(namespace)
    if parts is None or not 1 <= int(parts["size"]) <= MAX_TP_SHARDS:
        raise ValueError(
            f"not a replica's namespace (MODEL@REVISION;...;tpR/N with N <= {MAX_TP_SHARDS}, "
            "maybe ending ;WVERSION): copy it from a replica (ReplicaAgent.model, the vLLM "
            "connector's or the SGLang backend's namespace)"
        )
    head, size = parts["head"], int(parts["size"])
    versioned = f";W{weight_version}" if weight_version else ""
    return [f"{head};tp{rank}/{size}{versioned}" for rank in range(size)]


def check_weight_version(value: object) -> None:
    """ValueError (TypeError) saying what to change when `value` cannot be a weight
    version: the characters of ids, at most MAX_WEIGHT_VERSION_CHARS of them."""
    _check_id("weight_version", value, MAX_WEIGHT_VERSION_CHARS)


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
