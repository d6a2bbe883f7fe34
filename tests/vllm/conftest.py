"""The vLLM suite: runs only where vLLM is importable (the `.venv-vllm` that
scripts/setup_vllm_venv.sh builds; `.ci/run` runs it after the main suite).

Where vLLM is absent (the main venv) nothing here is collected, so the main
`python -m pytest` neither imports vLLM nor fails on it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

# pytest puts tests/ on sys.path, where this directory is a namespace package named
# `vllm`: only a real module (one with an origin) counts.
_VLLM = importlib.util.find_spec("vllm")
HAS_VLLM = _VLLM is not None and _VLLM.origin is not None
collect_ignore_glob = [] if HAS_VLLM else ["test_*.py"]

if HAS_VLLM:
    from tests.support.vllm_store import Store, start_store

    @pytest.fixture
    def store(tmp_path: Path) -> Iterator[Store]:
        server, handle = start_store(tmp_path)
        try:
            yield handle
        finally:
            server.stop()
