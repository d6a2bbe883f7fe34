"""Sealed blocks: AES-256-GCM per block under per-tenant data keys the server never sees.

Sealed layout (all integers big-endian):

    magic "KVSL" | format u8 (1) | key_version u32 | nonce (24 bytes) | ciphertext || tag

Nonces: AES-GCM with random 96-bit nonces must stay well under 2^32 messages per key,
which a busy fleet reaches in hours. Each block therefore gets a 24-byte random nonce:
its first 12 bytes select a per-message subkey
`HMAC-SHA256(data_key, enc("kvshare/seal/subkey/v1", nonce[:12]))` and its last 12 are
the GCM nonce under that subkey (the XAES-256-GCM idea), so a (key, nonce) pair repeats
only with probability ~2^-192 per pair of blocks: no practical message limit per key.

Associated data binds the ciphertext to where it belongs:
`enc("kvshare/seal/v1", tenant, model, digest, key_version)`; `model` names the model
and its KV layout. A block moved to another name or tenant, altered, truncated, or
sealed under a retired key version fails to open with the one error `SealError`, so a
caller learns nothing from which check failed, and the plaintext never exists.

`seal_into` and `open_into` seal and open into a buffer the caller owns and reuses (a
save's send buffer, a restore's staging), which saves the fresh allocation (and, for
`seal`, the copy that puts the header before the ciphertext) made per block. AES-GCM
writes the plaintext there before it checks the tag (cryptography's `decrypt_into`
does), so a block that fails to open has that region zeroed before `SealError` is
raised: nothing unverified is left to be taken for a block.

`opening` opens a block as its bytes arrive (`BlockOpening`: `feed` each piece in
order, then `finish`), so a reader decrypts what came while the rest is still on the
wire. The same rule holds: `finish` is the only way to the plaintext, and it zeroes
the region and raises `SealError` unless every check passed.
"""

from __future__ import annotations

import base64
import hmac
import secrets
import struct
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import (
    AEADDecryptionContext,
    Cipher,
    algorithms,
    modes,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvcommon.encoding import enc
from kvcommon.errors import ConfigError

MAGIC = b"KVSL"
FORMAT = 1
_HEADER = struct.Struct(">4sBI24s")
HEADER_BYTES = _HEADER.size
TAG_BYTES = 16
KEY_BYTES = 32
AAD_LABEL = "kvshare/seal/v1"
SUBKEY_LABEL = "kvshare/seal/subkey/v1"
KEYRING_ENV = "KVSHARE_KEYRING"
# AESGCM.encrypt_into/decrypt_into are in the cryptography releases this was written
# against (48) but not in the oldest the project allows (42): there seal_into encrypts,
# and open_into decrypts, then copies.
ENCRYPT_INTO = hasattr(AESGCM, "encrypt_into")
DECRYPT_INTO = hasattr(AESGCM, "decrypt_into")


class SealError(Exception):
    """The block could not be opened. Deliberately says no more than that."""


@dataclass(frozen=True)
class TenantKeys:
    """A tenant's data keys by version; new blocks are sealed under the newest."""

    keys: Mapping[int, bytes]

    @property
    def primary_version(self) -> int:
        return max(self.keys)


class Keyring:
    """Per-tenant data keys. Load with `from_file` / `from_env`; never logged."""

    def __init__(self, tenants: Mapping[str, TenantKeys]) -> None:
        self._tenants = dict(tenants)

    def __repr__(self) -> str:
        return f"Keyring(tenants={sorted(self._tenants)})"  # never the keys

    def tenants(self) -> list[str]:
        return sorted(self._tenants)

    def primary(self, tenant: str) -> tuple[int, bytes]:
        keys = self._tenants.get(tenant)
        if keys is None:
            raise ConfigError(
                f"no data key for tenant {tenant!r} in the keyring; add one with "
                "`kvshare admin keyring --tenant` or seal nothing for it"
            )
        version = keys.primary_version
        return version, keys.keys[version]

    def key(self, tenant: str, version: int) -> bytes | None:
        keys = self._tenants.get(tenant)
        return keys.keys.get(version) if keys else None

    @classmethod
    def parse_toml(cls, text: str, source: str) -> Keyring:
        """`[[keys]]` tables with `tenant`, `version` (>= 1) and `key` (base64 of 32 bytes)."""
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{source}: not valid TOML: {error}") from None
        if set(raw) - {"keys"}:
            raise ConfigError(
                f"{source}: unknown top-level keys {sorted(set(raw) - {'keys'})}; "
                "a keyring has only [[keys]] tables"
            )
        tenants: dict[str, dict[int, bytes]] = {}
        for i, entry in enumerate(raw.get("keys", [])):
            tenant, version, key = _parse_key_entry(entry, f"{source}: keys[{i}]")
            if version in tenants.setdefault(tenant, {}):
                raise ConfigError(
                    f"{source}: keys[{i}]: tenant {tenant!r} has version {version} twice"
                )
            tenants[tenant][version] = key
        return cls({t: TenantKeys(v) for t, v in tenants.items()})

    @classmethod
    def from_file(cls, path: Path) -> Keyring:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"cannot read keyring {path}: {error.strerror}") from None
        if path.stat().st_mode & 0o077:
            raise ConfigError(f"keyring {path} is readable by group or others; chmod 600 it")
        return cls.parse_toml(text, str(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Keyring | None:
        text = environ.get(KEYRING_ENV)
        return cls.parse_toml(text, f"${KEYRING_ENV}") if text else None


def _parse_key_entry(entry: object, where: str) -> tuple[str, int, bytes]:
    if not isinstance(entry, dict) or set(entry) != {"tenant", "version", "key"}:
        raise ConfigError(f"{where}: needs exactly tenant, version and key")
    tenant, version, key_b64 = entry["tenant"], entry["version"], entry["key"]
    if not isinstance(tenant, str) or not tenant:
        raise ConfigError(f"{where}.tenant: must be a tenant id")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version < 2**32:
        raise ConfigError(f"{where}.version: must be an integer from 1 to 2^32-1")
    try:
        key = base64.b64decode(str(key_b64), validate=True)
    except ValueError:
        raise ConfigError(f"{where}.key: not valid base64") from None
    if len(key) != KEY_BYTES:
        raise ConfigError(f"{where}.key: must decode to {KEY_BYTES} bytes")
    return tenant, version, key


def new_key_entry(tenant: str, version: int) -> str:
    """A fresh `[[keys]]` stanza for a keyring file (the key is random)."""
    key = base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode("ascii")
    return f'[[keys]]\ntenant = "{tenant}"\nversion = {version}\nkey = "{key}"\n'


def looks_sealed(payload: bytes | bytearray | memoryview) -> bool:
    """Whether `payload` has the sealed format's header and room for a tag (not opened)."""
    head = bytes(payload[:5])
    return len(payload) >= HEADER_BYTES + TAG_BYTES and head == MAGIC + bytes([FORMAT])


def associated_data(tenant: str, model: str, digest: bytes, version: int) -> bytes:
    return enc(AAD_LABEL, tenant, model, digest, version)


def _subkey(data_key: bytes, nonce: bytes) -> AESGCM:
    return AESGCM(_subkey_bytes(data_key, nonce))


def _subkey_bytes(data_key: bytes, nonce: bytes) -> bytes:
    return hmac.digest(data_key, enc(SUBKEY_LABEL, nonce[:12]), "sha256")


class BlockSealer:
    """Seals and opens block payloads for the tenants of one keyring."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring

    def seal(
        self,
        tenant: str,
        model: str,
        digest: bytes,
        plaintext: bytes | bytearray | memoryview,
        *,
        nonce: bytes | None = None,
    ) -> bytes:
        """`nonce` is for known-answer tests only; leave it None."""
        version, nonce, aead, ad = self._sealing(tenant, model, digest, nonce)
        body = aead.encrypt(nonce[12:], plaintext, ad)
        return _HEADER.pack(MAGIC, FORMAT, version, nonce) + body

    def seal_into(
        self,
        tenant: str,
        model: str,
        digest: bytes,
        plaintext: bytes | bytearray | memoryview,
        out: bytearray | memoryview,
        *,
        nonce: bytes | None = None,
    ) -> memoryview:
        """`seal` into the caller's writable `out`: the view of its first
        `sealed_bytes(len(plaintext))` bytes holding the sealed block (the same bytes
        `seal` returns). ValueError, before anything is written, when `out` is read-only
        or shorter than that. `nonce` is for known-answer tests only; leave it None."""
        target = memoryview(out).cast("B")
        if target.readonly:
            raise ValueError("out is read-only; pass a writable buffer to seal into")
        size = sealed_bytes(memoryview(plaintext).nbytes)
        if target.nbytes < size:
            raise ValueError(
                f"out holds {target.nbytes} bytes, a sealed block of this plaintext needs "
                f"{size} (sealed_bytes); pass a larger buffer"
            )
        version, nonce, aead, ad = self._sealing(tenant, model, digest, nonce)
        target = target[:size]
        _HEADER.pack_into(target, 0, MAGIC, FORMAT, version, nonce)
        if ENCRYPT_INTO:
            aead.encrypt_into(nonce[12:], plaintext, ad, target[HEADER_BYTES:])
        else:  # cryptography releases before encrypt_into
            target[HEADER_BYTES:] = aead.encrypt(nonce[12:], plaintext, ad)
        return target

    def _sealing(
        self, tenant: str, model: str, digest: bytes, nonce: bytes | None
    ) -> tuple[int, bytes, AESGCM, bytes]:
        """The tenant's primary key version, the block's 24-byte nonce (random unless
        given), its subkey and associated data: what `seal` and `seal_into` share."""
        version, key = self.keyring.primary(tenant)
        nonce = secrets.token_bytes(24) if nonce is None else nonce
        return version, nonce, _subkey(key, nonce), associated_data(tenant, model, digest, version)

    def open(self, tenant: str, model: str, digest: bytes, sealed: bytes | memoryview) -> bytes:
        """The plaintext, or SealError for anything wrong (never a partial result)."""
        aead, nonce, body, ad = self._opening(tenant, model, digest, sealed)
        try:
            return aead.decrypt(nonce, body, ad)  # decrypted in place: no copy first
        except InvalidTag:
            raise SealError("block cannot be opened") from None

    def open_into(
        self,
        tenant: str,
        model: str,
        digest: bytes,
        sealed: bytes | memoryview,
        out: bytearray | memoryview,
    ) -> memoryview:
        """Open `sealed` into the caller's writable `out`: the view of its first
        `opened_bytes(sealed)` bytes holding the plaintext, or SealError for anything
        wrong, `open`'s checks and a plaintext longer than `out` included. On SealError
        after decryption started that view is zeroed (module docstring)."""
        target = memoryview(out).cast("B")
        if target.readonly:
            raise ValueError("out is read-only; pass a writable buffer to open into")
        aead, nonce, body, ad = self._opening(tenant, model, digest, sealed)
        size = body.nbytes - TAG_BYTES
        if size > target.nbytes:
            raise SealError("block cannot be opened")
        target = target[:size]
        try:
            if DECRYPT_INTO:
                aead.decrypt_into(nonce, body, ad, target)
            else:  # cryptography releases before decrypt_into
                target[:] = aead.decrypt(nonce, body, ad)
        except InvalidTag:
            target[:] = bytes(size)
            raise SealError("block cannot be opened") from None
        return target

    def opening(
        self, tenant: str, model: str, digest: bytes, sealed_bytes: int, out: bytearray | memoryview
    ) -> BlockOpening:
        """Open a sealed block of `sealed_bytes` into `out` as its bytes arrive: feed
        each piece, in order, to the returned `BlockOpening`, then `finish` it. The
        same checks as `open_into`, the same result and the same error."""
        return BlockOpening(self.keyring, tenant, model, digest, sealed_bytes, out)

    def _opening(
        self, tenant: str, model: str, digest: bytes, sealed: bytes | memoryview
    ) -> tuple[AESGCM, bytes, memoryview, bytes]:
        """The subkey, GCM nonce, ciphertext with tag and associated data of `sealed`,
        or SealError when its header does not name a key of the tenant."""
        if len(sealed) < HEADER_BYTES + TAG_BYTES:
            raise SealError("block cannot be opened")
        named = _header_key(self.keyring, tenant, sealed)
        if named is None:
            raise SealError("block cannot be opened")
        key, version, nonce = named
        ad = associated_data(tenant, model, digest, version)
        body = memoryview(sealed).cast("B")[HEADER_BYTES:]
        return _subkey(key, nonce), nonce[12:], body, ad


def _header_key(
    keyring: Keyring, tenant: str, sealed: bytes | bytearray | memoryview
) -> tuple[bytes, int, bytes] | None:
    """The tenant's key the sealed header at the start of `sealed` names, its version
    and the block's nonce; None when the header is not this format's or names no key
    of the tenant (what `open` and `BlockOpening` refuse alike)."""
    magic, fmt, version, nonce = _HEADER.unpack_from(sealed)
    key = keyring.key(tenant, version)
    if magic != MAGIC or fmt != FORMAT or key is None:
        return None
    return key, version, nonce


class BlockOpening:
    """One sealed block opened as it arrives (`BlockSealer.opening`).

    `feed` takes the block's bytes in order, in pieces of any size: its header first
    (the key version and nonce, from which the subkey is made), then the ciphertext,
    decrypted into `out` as it comes, then the tag. Nothing is raised while feeding, so
    a reader keeps its framing whatever the bytes say: a header that names no key of the
    tenant, a plaintext longer than `out`, or more bytes than announced only make
    `finish` fail. `finish` checks the tag and returns the plaintext's view of `out`;
    on any failure it zeroes what was written there and raises `SealError`."""

    def __init__(
        self,
        keyring: Keyring,
        tenant: str,
        model: str,
        digest: bytes,
        sealed_bytes: int,
        out: bytearray | memoryview,
    ) -> None:
        target = memoryview(out).cast("B")
        if target.readonly:
            raise ValueError("out is read-only; pass a writable buffer to open into")
        self._keyring = keyring
        self._tenant, self._model, self._digest = tenant, model, digest
        self._size = sealed_bytes - HEADER_BYTES - TAG_BYTES  # the plaintext's
        self._ok = 0 <= self._size <= target.nbytes
        self._out = target[: max(self._size, 0)]
        self._head = bytearray()
        self._tag = bytearray()
        self._at = 0  # bytes fed so far
        self._written = 0  # plaintext bytes written into `out`
        self._decryptor: AEADDecryptionContext | None = None

    def feed(self, piece: bytes | bytearray | memoryview) -> None:
        """The block's next bytes."""
        data = memoryview(piece).cast("B")
        start, self._at = self._at, self._at + data.nbytes
        if not self._ok:
            return
        body_end = HEADER_BYTES + self._size
        if start < HEADER_BYTES:
            take = min(HEADER_BYTES - start, data.nbytes)
            self._head += data[:take]
            data, start = data[take:], start + take
            if len(self._head) == HEADER_BYTES:
                self._begin()
                if not self._ok:
                    return
        if data.nbytes and start < body_end:
            take = min(body_end - start, data.nbytes)
            self._decrypt(data[:take])
            data = data[take:]
        self._tag += data  # past the ciphertext: the tag (anything beyond fails `finish`)

    def finish(self) -> memoryview:
        """The plaintext's view of `out`, or SealError (the view zeroed)."""
        whole = self._at == HEADER_BYTES + max(self._size, 0) + TAG_BYTES
        if self._ok and whole and self._decryptor is not None:
            try:
                self._decryptor.finalize_with_tag(bytes(self._tag))
                return self._out
            except InvalidTag:
                pass
        self._out[: self._written] = bytes(self._written)
        raise SealError("block cannot be opened")

    def _begin(self) -> None:
        named = _header_key(self._keyring, self._tenant, self._head)
        if named is None:
            self._ok = False
            return
        key, version, nonce = named
        ad = associated_data(self._tenant, self._model, self._digest, version)
        mode = modes.GCM(nonce[12:])
        self._decryptor = Cipher(algorithms.AES(_subkey_bytes(key, nonce)), mode).decryptor()
        self._decryptor.authenticate_additional_data(ad)

    def _decrypt(self, ciphertext: memoryview) -> None:
        """Decrypt into `out` where it goes. cryptography documents `update_into` as
        needing a cipher block's room (15 bytes) past the piece: where `out` has none
        left (the block's last piece), the piece is decrypted into a fresh buffer and
        copied."""
        assert self._decryptor is not None, "the header came first"
        at, size = self._written, ciphertext.nbytes
        if self._out.nbytes - at >= size + 15:
            self._decryptor.update_into(ciphertext, self._out[at:])
        else:
            self._out[at : at + size] = self._decryptor.update(ciphertext)
        self._written = at + size


def sealed_bytes(plaintext_bytes: int) -> int:
    """How many bytes a block of `plaintext_bytes` seals to (what `BlockSealer.seal_into`
    needs): its header, the ciphertext and the tag."""
    return HEADER_BYTES + plaintext_bytes + TAG_BYTES


def opened_bytes(sealed: bytes | bytearray | memoryview) -> int:
    """How many bytes `sealed` opens to (what `BlockSealer.open_into` needs); 0 for
    what is too short to be a sealed block (it does not open)."""
    return max(memoryview(sealed).nbytes - HEADER_BYTES - TAG_BYTES, 0)
