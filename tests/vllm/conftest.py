"""The vLLM suite: runs only where vLLM is importable (the `.venv-vllm` that
scripts/setup_vllm_venv.sh builds; `.ci/run` runs it after the main suite).

Where vLLM is absent (the main venv) nothing here is collected, so the main
`python -m pytest` neither imports vLLM nor fails on it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# pytest puts tests/ on sys.path, where this directory is a namespace package named
# `vllm`: only a real module (one with an origin) counts.
_VLLM = importlib.util.find_spec("vllm")
HAS_VLLM = _VLLM is not None and _VLLM.origin is not None
collect_ignore_glob = [] if HAS_VLLM else ["test_*.py"]

CONFIG_DIR = Path(__file__).parent / "tiny-llama"  # config.json only: the contract tests


@dataclass(frozen=True)
class Store:
    """A real kvshare server: tenants alpha and beta; principal `engine` reads and
    writes both, `only-alpha` only alpha. Token files are 0600, as the connector needs."""

    address: str
    data_dir: Path
    tokens: dict[str, str]
    token_files: dict[str, Path]
    keyring_file: Path


if HAS_VLLM:
    from cacheserver.config import load_config
    from cacheserver.embedded import EmbeddedServer
    from tests.conftest import write_config, write_engine_files

    def start_store(
        directory: Path, *, require_sealed: bool = False
    ) -> tuple[EmbeddedServer, Store]:
        extra = ""
        tenancy = write_config(
            directory,
            extra=extra,
            principals={
                "engine": (["alpha", "beta"], ["read", "write"]),
                "only-alpha": (["alpha"], ["read", "write"]),
            },
        )
        if require_sealed:
            text = tenancy.path.read_text().replace(
                "quota_bytes = 0", "quota_bytes = 0\nrequire_sealed = true"
            )
            tenancy.path.write_text(text)
        config = load_config(tenancy.path)
        server = EmbeddedServer(config)
        server.start()
        token_files, keyring = write_engine_files(directory, tenancy.tokens)
        return server, Store(server.address, config.data_dir, tenancy.tokens, token_files, keyring)

    @pytest.fixture
    def store(tmp_path: Path) -> Iterator[Store]:
        server, handle = start_store(tmp_path)
        try:
            yield handle
        finally:
            server.stop()
