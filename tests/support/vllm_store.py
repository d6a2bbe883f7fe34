"""A kvshare server for the vLLM suite (`start_store`), its handle (`Store`: address,
tokens, the connector's token and keyring files) and the contract tests' model config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cacheserver.config import load_config
from cacheserver.embedded import EmbeddedServer
from tests.support.servers import write_config, write_engine_files

# config.json only: the contract tests
CONFIG_DIR = Path(__file__).parents[1] / "vllm" / "tiny-llama"


@dataclass(frozen=True)
class Store:
    """A real kvshare server: tenants alpha and beta; principal `engine` reads and
    writes both, `only-alpha` only alpha. Token files are 0600, as the connector needs."""

    address: str
    data_dir: Path
    tokens: dict[str, str]
    token_files: dict[str, Path]
    keyring_file: Path


def start_store(directory: Path, *, require_sealed: bool = False) -> tuple[EmbeddedServer, Store]:
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
