"""The Redis Cluster's password, from `redis_cluster.password_file`: read once, when
the tier opens, and refused unless the file is owner-only (like the server secret), so
a readable or empty file stops the start-up with what to change. The password is never
logged and never put in an error message; only the file's path is.
"""

from __future__ import annotations

import stat

from cacheserver.tiers.cluster.config import RedisClusterConfig
from kvcommon.errors import ConfigError


def read_password(config: RedisClusterConfig) -> str | None:
    path = config.password_file
    if path is None:
        return None
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        text = path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise ConfigError(
            f"redis_cluster.password_file {path}: cannot read it ({error.strerror})"
        ) from None
    if mode & 0o077:
        raise ConfigError(
            f"redis_cluster.password_file {path} is readable by group or others; chmod 600 it"
        )
    if not text:
        raise ConfigError(f"redis_cluster.password_file {path} is empty")
    return text
