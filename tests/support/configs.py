"""A minimal valid server config (TOML), for tests that vary one key of it."""

from __future__ import annotations

import hashlib

MINIMAL = f"""listen = "127.0.0.1:50051"
data_dir = "./kvshare-data"

[[tenants]]
id = "acme"
quota_bytes = 1073741824

[[principals]]
name = "replica-a"
token_sha256 = "{hashlib.sha256(b"t").hexdigest()}"
tenants = ["acme"]
actions = ["read", "write"]
"""
