"""The keyed MAC of values kept in a shared tier (the Redis Cluster): only a server
holding the deployment's server secret can make a value another server will serve.

    k_value = HKDF-SHA256(server_secret, info=enc("kvshare/shared-value/v1"))
    k_once  = HMAC-SHA256(k_value, enc(name, header))   # header: with a random salt
    tag     = Poly1305(k_once, payload)

The one-time key binds the value's key name (so a value moved to another key fails)
and its header (tenant tag, epoch, model tag, size and a fresh 16-byte salt, so a value
re-headed to another tenant fails and no two values share a one-time key, as Poly1305
requires); Poly1305 then covers the payload at memory speed (an HMAC over megabytes
would cost a cold read several times what reading it does). Every server of one
deployment holds the same secret already: without it they would name blocks differently
(policy.naming).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.poly1305 import Poly1305

from kvcommon.encoding import enc

SHARED_VALUE_LABEL = "kvshare/shared-value/v1"
SALT_BYTES = 16
TAG_BYTES = 16

Buffer = bytes | bytearray | memoryview


class ValueMac:
    """Tags and checks shared-tier values (module docstring); one per server."""

    def __init__(self, server_secret: bytes) -> None:
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=enc(SHARED_VALUE_LABEL))
        self._key = hkdf.derive(server_secret)

    @staticmethod
    def new_salt() -> bytes:
        """A fresh salt for a header: each value gets a one-time key of its own."""
        return os.urandom(SALT_BYTES)

    def _once(self, name: bytes, header: Buffer) -> bytes:
        return hmac.digest(self._key, enc(name, bytes(header)), hashlib.sha256)

    def tag(self, name: bytes, header: Buffer, payload: Buffer) -> bytes:
        """The tag of a value stored under `name` (its key in the tier); `header` must
        hold a salt from `new_salt`, never reused."""
        mac = Poly1305(self._once(name, header))
        mac.update(payload)
        return mac.finalize()

    def verify(self, name: bytes, header: Buffer, payload: Buffer, tag: Buffer) -> bool:
        """Whether `tag` was made by `tag(name, header, payload)` under this secret
        (constant time; untrusted inputs)."""
        if len(tag) != TAG_BYTES:
            return False
        mac = Poly1305(self._once(name, header))
        mac.update(payload)
        try:
            mac.verify(bytes(tag))
        except InvalidSignature:
            return False
        return True
