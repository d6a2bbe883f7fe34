"""The SGLang suite: runs only where SGLang is importable (the `.venv-sglang` that
scripts/setup_sglang_venv.sh builds; `.ci/run` runs it after the vLLM suite).

Where SGLang is absent (the main venv) nothing here is collected, so the main
`python -m pytest` neither imports SGLang nor fails on it.

Everything is real: SGLang's storage interface, its backend factory, its MHA device and
host KV pools (on the CPU) and its key hashing; a kvshare server on 127.0.0.1 with LMDB
in a tmp dir; the kvshare client, sealing and the codec.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

# pytest puts tests/ on sys.path, where this directory is a namespace package named
# `sglang`: only a real module (one with an origin) counts.
_SGLANG = importlib.util.find_spec("sglang")
HAS_SGLANG = _SGLANG is not None and _SGLANG.origin is not None
collect_ignore_glob = [] if HAS_SGLANG else ["test_*.py"]

if HAS_SGLANG:
    warnings.simplefilter("ignore", UserWarning)  # SGLang on a CPU: kernels it lacks
    from tests.support.servers import launch, write_engine_files
    from tests.support.sglang_hicache import Store, store_config

    @pytest.fixture
    def store(tmp_path: Path) -> Iterator[Store]:
        tenancy = store_config(tmp_path)
        running = launch(tenancy)
        token_files, keyring = write_engine_files(tmp_path, tenancy.tokens)
        try:
            yield Store(running.address, token_files, keyring, running.stop)
        finally:
            running.stop()
