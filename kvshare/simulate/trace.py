"""Load a Mooncake-format request trace (JSON lines) into immutable `Request`s.

Each line holds `timestamp` (ms from the start), `input_length` (prompt tokens),
`output_length` and `hash_ids` (one id per prompt block; equal ids at equal positions
mean a reusable prefix, the last block may be partial). The file is parsed once and
the same tuple of requests is reused by every configuration of a sweep.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from kvshare.simulate.errors import SimulateInputError

_MS_PER_S = 1000.0


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt: when it arrives, how long it is, and its prefix-block ids in order."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]


def load_trace(path: Path) -> tuple[Request, ...]:
    """Parse every non-blank line of `path`; raise `SimulateInputError` on the first bad one."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SimulateInputError(
            f"trace file {path} does not exist; pass --trace with a Mooncake-format .jsonl file"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise SimulateInputError(
            f"cannot read trace file {path} ({error.__class__.__name__}); "
            "pass --trace with a readable UTF-8 .jsonl file"
        ) from None
    requests = tuple(
        parse_trace_line(line, f"{path}:{number}")
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    )
    if not requests:
        raise SimulateInputError(f"trace file {path} holds no requests; pass a non-empty trace")
    return requests


def parse_trace_line(line: str, where: str) -> Request:
    """Parse one JSON line; `where` (file:line) prefixes any error message."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise SimulateInputError(
            f"{where}: not valid JSON ({error.msg}); each line must be one JSON object"
        ) from None
    if not isinstance(record, dict):
        raise SimulateInputError(
            f"{where}: expected a JSON object per line, got {type(record).__name__}"
        )
    timestamp_ms = _number(record, "timestamp", where)
    input_tokens = _count(record, "input_length", where)
    output_tokens = _count(record, "output_length", where) if "output_length" in record else 0
    block_ids = record.get("hash_ids")
    if not isinstance(block_ids, list) or not all(_is_int(item) for item in block_ids):
        raise SimulateInputError(f"{where}: 'hash_ids' must be a list of integers (one per block)")
    return Request(timestamp_ms / _MS_PER_S, input_tokens, output_tokens, tuple(block_ids))


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(record: dict[str, Any], key: str, where: str) -> int:
    value = record.get(key)
    if not _is_int(value) or value < 0:
        raise SimulateInputError(f"{where}: '{key}' must be a non-negative integer, got {value!r}")
    return value


def _number(record: dict[str, Any], key: str, where: str) -> float:
    value = record.get(key)
    if not (_is_int(value) or isinstance(value, float)) or not 0 <= value < math.inf:
        raise SimulateInputError(
            f"{where}: '{key}' must be a non-negative number of milliseconds, got {value!r}"
        )
    return float(value)
