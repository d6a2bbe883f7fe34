"""Dev mode: one tenant `dev` and one principal whose token lives in the data dir.

`kvshare serve` with no config creates, once, `<data-dir>/dev.token` (mode 0600) and
grants its holder `read` and `write` on tenant `dev`. Later starts reuse the token.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from kvcommon.errors import ConfigError
from policy.config import AccessConfig, TenantConfig
from policy.identity import Action, Principal, TokenCredential, hash_token
from policy.types import TenantId

DEV_TENANT = TenantId("dev")
DEV_TOKEN_FILE = "dev.token"  # noqa: S105 (a file name)


def load_or_create_dev_token(data_dir: Path) -> str:
    path = data_dir / DEV_TOKEN_FILE
    if path.exists():
        token = path.read_text(encoding="utf-8").strip()
        if not token:
            raise ConfigError(f"{path} is empty; delete it to have a new dev token generated")
        return token
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return token


def dev_access(data_dir: Path) -> AccessConfig:
    token = load_or_create_dev_token(data_dir)
    # Unlimited rate: dev mode is one local user on loopback (and `kvshare bench`).
    principal = Principal(
        "dev", frozenset({DEV_TENANT}), frozenset({Action.READ, Action.WRITE}), requests_per_s=0
    )
    return AccessConfig(
        tenants=(TenantConfig(DEV_TENANT),),
        credentials=(TokenCredential(hash_token(token), principal),),
    )
