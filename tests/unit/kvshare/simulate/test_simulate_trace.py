"""Parsing Mooncake-format traces: good lines become Requests, bad ones one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshare.simulate.errors import SimulateInputError
from kvshare.simulate.trace import Request, load_trace


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_parses_fields_and_converts_milliseconds_to_seconds(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 4, "hash_ids": [7]},
    ]
    path = _write(tmp_path, [json.dumps(rows[0]), "", json.dumps(rows[1])])
    assert load_trace(path) == (
        Request(arrival_s=0.0, input_tokens=10, output_tokens=3, block_ids=(1, 2, 3)),
        Request(arrival_s=1.5, input_tokens=4, output_tokens=0, block_ids=(7,)),
    )


def test_missing_file_says_which_flag_to_fix(tmp_path: Path) -> None:
    with pytest.raises(SimulateInputError, match=r"does not exist; pass --trace"):
        load_trace(tmp_path / "absent.jsonl")


def test_empty_trace_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(SimulateInputError, match="holds no requests"):
        load_trace(_write(tmp_path, ["", "  "]))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 4}', "'hash_ids' must be a list of integers"),
        ('{"timestamp": 0, "input_length": 4, "hash_ids": [1, "2"]}', "'hash_ids' must be"),
        ('{"timestamp": 0, "input_length": -1, "hash_ids": []}', "'input_length' must be"),
        ('{"timestamp": 0, "input_length": true, "hash_ids": []}', "'input_length' must be"),
        ('{"timestamp": NaN, "input_length": 1, "hash_ids": [1]}', "'timestamp' must be"),
        ('{"input_length": 1, "hash_ids": [1]}', "'timestamp' must be"),
        (
            '{"timestamp": 0, "input_length": 1, "output_length": 1.5, "hash_ids": [1]}',
            "'output_length' must be",
        ),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    good = json.dumps({"timestamp": 0, "input_length": 1, "hash_ids": [1]})
    path = _write(tmp_path, [good, line])
    with pytest.raises(SimulateInputError, match=message) as caught:
        load_trace(path)
    assert str(caught.value).startswith(f"{path}:2: ")
    assert "\n" not in str(caught.value)
