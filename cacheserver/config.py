"""Server configuration, parsed once at start-up into frozen dataclasses.

The TOML keys `listen`, `data_dir`, `[[tenants]]` and `[[principals]]` are a contract
(DESIGN §8); `[storage]` and `[limits]` are optional with the defaults below.
Command-line flags override the file. Unknown keys anywhere are errors naming the key
and its line.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvshare.errors import ConfigError
from policy.config import AccessConfig, line_of, parse_access

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_DATA_DIR = "./kvshare-data"
TOP_KEYS = frozenset(
    {"listen", "data_dir", "allow_insecure_listen", "tenants", "principals", "storage", "limits"}
)


@dataclass(frozen=True)
class StorageConfig:
    memory_budget_bytes: int = 1 * GiB
    disk_budget_bytes: int = 8 * GiB
    # 0: derived from the disk budget with room for LMDB's page overhead and free lists.
    lmdb_map_bytes: int = 0
    # fsync every commit, so an acknowledged block survives a crash or power loss.
    sync_writes: bool = True

    def effective_map_bytes(self) -> int:
        if self.lmdb_map_bytes:
            return self.lmdb_map_bytes
        return self.disk_budget_bytes * 3 // 2 + 256 * MiB


@dataclass(frozen=True)
class LimitsConfig:
    # A 128k-token prompt is 512 digests at 256 tokens per block: one call takes it.
    max_digests_per_call: int = 8192
    # A 256-token block of a 70B model with 320 KiB of KV per token is 80 MiB.
    max_block_bytes: int = 128 * MiB
    # Largest gRPC message (one frame of chunks) either way.
    max_message_bytes: int = 16 * MiB
    # Get frames are filled to about this many payload bytes.
    get_frame_bytes: int = 4 * MiB


@dataclass(frozen=True)
class ServerConfig:
    listen: str = DEFAULT_LISTEN
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    allow_insecure_listen: bool = False
    storage: StorageConfig = field(default_factory=StorageConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    access: AccessConfig | None = None  # None: dev mode (tenant `dev`, token in data dir)

    @property
    def is_dev_mode(self) -> bool:
        return self.access is None


def _positive_ints(
    raw: Mapping[str, Any], cls: type[Any], table: str, source: str, text: str
) -> Any:
    defaults = cls()
    values: dict[str, Any] = {}
    for key, value in raw.items():
        line = line_of(text, key)
        where = f"{source}:{line}" if line else source
        if not hasattr(defaults, key):
            allowed = ", ".join(sorted(defaults.__dataclass_fields__))
            raise ConfigError(f"{where}: {table}.{key}: unknown key; allowed: {allowed}")
        expected = type(getattr(defaults, key))
        if type(value) is not expected or (expected is int and value < 0):
            raise ConfigError(
                f"{where}: {table}.{key}: must be {expected.__name__}"
                + (" >= 0" if expected is int else "")
            )
        values[key] = value
    return replace(defaults, **values)


def _table(raw: Mapping[str, Any], key: str, source: str, text: str) -> Mapping[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{source}:{line_of(text, key)}: {key}: must be a table [{key}]")
    return value


def load_config(path: Path) -> ServerConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read config {path}: {error.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    source = str(path)
    for key in raw:
        if key not in TOP_KEYS:
            raise ConfigError(
                f"{source}:{line_of(text, key)}: {key}: unknown key; "
                f"allowed: {', '.join(sorted(TOP_KEYS))}"
            )
    tenants = raw.get("tenants", [])
    principals = raw.get("principals", [])
    if not isinstance(tenants, list) or not isinstance(principals, list):
        raise ConfigError(
            f"{source}: tenants and principals must be arrays of tables "
            "([[tenants]], [[principals]])"
        )
    access = parse_access(tenants, principals, source=source, text=text)
    listen = raw.get("listen", DEFAULT_LISTEN)
    data_dir = raw.get("data_dir", DEFAULT_DATA_DIR)
    insecure = raw.get("allow_insecure_listen", False)
    if (
        not isinstance(listen, str)
        or not isinstance(data_dir, str)
        or not isinstance(insecure, bool)
    ):
        raise ConfigError(
            f"{source}: listen and data_dir must be strings, allow_insecure_listen a boolean"
        )
    return ServerConfig(
        listen=listen,
        data_dir=Path(data_dir),  # relative to the working directory, like --data-dir
        allow_insecure_listen=insecure,
        storage=_positive_ints(
            _table(raw, "storage", source, text), StorageConfig, "storage", source, text
        ),
        limits=_positive_ints(
            _table(raw, "limits", source, text), LimitsConfig, "limits", source, text
        ),
        access=access,
    )
