"""Server-side block names: keyed, per tenant, never the client's digest.

    k_name(tenant, epoch) = HKDF-SHA256(server_secret, info=enc("kvshare/name/v1", tenant, epoch))
    storage_key           = HMAC-SHA256(k_name, enc(model, digest))

The same digest in two tenants gives unrelated names, so a cross-tenant probe is an
ordinary miss; stored names reveal nothing about prompts; bumping a tenant's epoch
makes all of its blocks unreachable at once (crypto-shredding on off-boarding).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvcommon.encoding import enc
from kvcommon.errors import ConfigError
from policy.shared_values import ValueMac
from policy.types import DIGEST_BYTES, BlockDigest, ModelName, ModelTag, StorageKey, TenantId

SERVER_SECRET_BYTES = 32
SECRET_FILE = "server.secret"  # noqa: S105 (a file name)
NAME_INFO_LABEL = "kvshare/name/v1"
MODEL_TAG_LABEL = "kvshare/model-tag/v1"
MODEL_TAG_BYTES = 16
CLUSTER_TAG_LABEL = "kvshare/cluster-tenant/v1"
CLUSTER_TAG_BYTES = 16
USER_SALT_LABEL = "kvshare/user-salt/v1"
SHA256_BLOCK_BYTES = 64


def derive_naming_key(server_secret: bytes, tenant: TenantId, epoch: int) -> bytes:
    hkdf = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=None,
        info=enc(NAME_INFO_LABEL, tenant, epoch),
    )
    return hkdf.derive(server_secret)


MODEL_TAGS_KEPT = 4096  # (tenant, model) tags a namer keeps computed


class _Hmac:
    """HMAC-SHA256 under one key, its two padded key blocks hashed once: the same bytes
    as `hmac.digest(key, message, "sha256")` (RFC 2104), for a fraction of the cost of
    a short message (a 64-digest Lookup names 64 blocks: the request path's largest
    per-digest cost). The inner state after a model's part of the message is kept per
    model too (one tenant's key, so nothing is shared across tenants), so a request
    hashes only its digests. Thread-safe: the states are only copied, never updated."""

    def __init__(self, key: bytes) -> None:
        if len(key) > SHA256_BLOCK_BYTES:
            key = hashlib.sha256(key).digest()
        padded = key.ljust(SHA256_BLOCK_BYTES, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in padded))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in padded))
        self._models: dict[ModelName, Any] = {}  # model -> inner state after its head

    def names(self, model: ModelName, digests: Sequence[BlockDigest]) -> list[StorageKey]:
        """The MAC of `enc(model, digest)` for each digest: the model's encoding (all
        but the digest's field, as every digest is 32 bytes) hashed once per model."""
        head = self._models.get(model)
        if head is None:
            if len(self._models) >= MODEL_TAGS_KEPT:
                self._models.clear()  # many models: start over rather than grow
            head = self._inner.copy()
            head.update(enc(model, bytes(DIGEST_BYTES))[:-DIGEST_BYTES])
            self._models[model] = head
        names = []
        for digest in digests:
            inner = head.copy()
            inner.update(digest)
            outer = self._outer.copy()
            outer.update(inner.digest())
            names.append(StorageKey(outer.digest()))
        return names


class BlockNamer:
    """Maps (tenant, model, digest) to the storage key under the tenant's current epoch."""

    def __init__(self, server_secret: bytes, epochs: Mapping[TenantId, int]) -> None:
        if len(server_secret) < SERVER_SECRET_BYTES:
            raise ConfigError(f"server secret must be at least {SERVER_SECRET_BYTES} bytes")
        self._secret = server_secret
        self._epochs = dict(epochs)
        self._keys: dict[TenantId, bytes] = {}
        self._macs: dict[TenantId, _Hmac] = {}
        self._cluster_tags: dict[TenantId, bytes] = {}
        # Every put's and delete's model tag (an HMAC, ~4 µs), kept: a tenant has a few
        # models. Bounded, as model names come from callers; dropped whole when full.
        self._model_tags: dict[tuple[TenantId, ModelName], ModelTag] = {}

    def epoch(self, tenant: TenantId) -> int:
        return self._epochs.get(tenant, 0)

    def _naming_key(self, tenant: TenantId) -> bytes:
        key = self._keys.get(tenant)
        if key is None:
            key = derive_naming_key(self._secret, tenant, self.epoch(tenant))
            self._keys[tenant] = key
        return key

    def model_tag(self, tenant: TenantId, model: ModelName) -> ModelTag:
        """A 16-byte keyed tag of the model, stored beside each block for namespace deletes."""
        tag = self._model_tags.get((tenant, model))
        if tag is None:
            mac = hmac.digest(self._naming_key(tenant), enc(MODEL_TAG_LABEL, model), "sha256")
            tag = ModelTag(mac[:MODEL_TAG_BYTES])
            if len(self._model_tags) >= MODEL_TAGS_KEPT:
                self._model_tags.clear()
            self._model_tags[(tenant, model)] = tag
        return tag

    def cluster_tag(self, tenant: TenantId) -> bytes:
        """A keyed 16-byte name of the tenant, the same at every epoch, for a shared
        tier's per-tenant keys (cacheserver.tiers.cluster): whoever runs the tier sees which
        keys belong to one tenant, never which tenant."""
        tag = self._cluster_tags.get(tenant)
        if tag is None:
            hkdf = HKDF(
                algorithm=hashes.SHA256(),
                length=CLUSTER_TAG_BYTES,
                salt=None,
                info=enc(CLUSTER_TAG_LABEL, tenant),
            )
            tag = self._cluster_tags[tenant] = hkdf.derive(self._secret)
        return tag

    def shared_value_mac(self) -> ValueMac:
        """The MAC of values in a shared tier, keyed by this secret (policy.shared_values)."""
        return ValueMac(self._secret)

    def storage_key(self, tenant: TenantId, model: ModelName, digest: BlockDigest) -> StorageKey:
        return self.storage_keys(tenant, model, [digest])[0]

    def storage_keys(
        self, tenant: TenantId, model: ModelName, digests: Sequence[BlockDigest]
    ) -> list[StorageKey]:
        """`storage_key` of each digest: `enc(model, digest)` is the model's encoding
        (made once) followed by the digest's, since every digest is 32 bytes."""
        mac = self._macs.get(tenant)
        if mac is None:
            mac = self._macs[tenant] = _Hmac(self._naming_key(tenant))
        return _names(mac, model, digests)

    def tenant_namer(self, tenant: TenantId) -> TenantNamer:
        """The names of one tenant's blocks alone, for a bulk worker process that serves
        that tenant's connections (cacheserver.transport.bulk.readworker): it holds this
        tenant's naming key, never the server secret, so it can name no other tenant's
        blocks."""
        return TenantNamer(tenant, self._naming_key(tenant))


class TenantNamer:
    """`BlockNamer.storage_keys` for one tenant, from that tenant's naming key alone
    (`naming_key`: what crosses to a bulk worker; `BlockNamer.tenant_namer`)."""

    def __init__(self, tenant: TenantId, naming_key: bytes) -> None:
        self.tenant = tenant
        self.naming_key = naming_key
        self._mac = _Hmac(naming_key)

    def storage_keys(self, model: ModelName, digests: Sequence[BlockDigest]) -> list[StorageKey]:
        return _names(self._mac, model, digests)


def _names(mac: _Hmac, model: ModelName, digests: Sequence[BlockDigest]) -> list[StorageKey]:
    for digest in digests:
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"a digest is {len(digest)} bytes; names take {DIGEST_BYTES}")
    return mac.names(model, digests)


def derive_user_salt(salt_key: bytes, tenant: str, user_id: str) -> bytes:
    """The per-user salt that seeds a digest chain (`BlockHasher(..., salt=...)`).

    `user_id` must be the end user's *authenticated* identity (from the caller's auth
    layer, never a request field), and `salt_key` a secret of the caller's (at least 32
    bytes): a user cannot compute another user's salt, so prefixes never match across
    users of one tenant. Salting is optional: without it a tenant shares prefixes
    among all of its users.
    """
    if len(salt_key) < 32:
        raise ValueError("salt_key must be at least 32 random bytes; generate it once and keep it")
    if not user_id:
        raise ValueError("user_id is empty; pass the authenticated end-user identity")
    return hmac.new(salt_key, enc(USER_SALT_LABEL, tenant, user_id), hashlib.sha256).digest()


def load_or_create_server_secret(path: Path) -> bytes:
    """The server's naming secret, generated once at `path` (mode 0600).

    An existing file readable by group or others is refused: it names every block.
    """
    if path.exists():
        if path.stat().st_mode & 0o077:
            raise ConfigError(f"{path} is readable by group or others; chmod 600 it")
        secret = path.read_bytes()
        if len(secret) != SERVER_SECRET_BYTES:
            raise ConfigError(
                f"{path} is {len(secret)} bytes, expected {SERVER_SECRET_BYTES}; "
                "restore it from backup (a new secret makes every stored block unreachable)"
            )
        return secret
    secret = secrets.token_bytes(SERVER_SECRET_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        raise ConfigError(f"cannot create the server secret {path}: {error.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
        f.flush()
        os.fsync(f.fileno())
    return secret
