"""Length-prefixed field encoding, the one way kvshare turns several fields into bytes.

Every hash, HMAC, HKDF `info` and AEAD associated-data input in kvshare is built with
`enc`, never with plain concatenation: `enc(b"ab", b"c")` and `enc(b"a", b"bc")` differ
because each field carries its own length. The field count is encoded too, so a
trailing empty field is never the same as a missing one.

Layout: u32 big-endian field count, then for each field a u64 big-endian length and
the field's bytes. `str` fields are UTF-8; `int` fields are a signed 64-bit
big-endian integer (tagged as such so `enc(1)` never equals `enc(b"\\x00...\\x01")`).
"""

from __future__ import annotations

import struct

Field = bytes | bytearray | memoryview | str | int

_COUNT = struct.Struct(">I")
_LENGTH = struct.Struct(">Q")
_INT = struct.Struct(">q")
# One tag byte per field kind keeps a str, bytes and int with equal raw bytes apart.
_TAG_BYTES = b"b"
_TAG_STR = b"s"
_TAG_INT = b"i"


def _encode_field(field: Field) -> bytes:
    if isinstance(field, bool):
        raise TypeError("enc() does not take bool fields; pass an int explicitly")
    if isinstance(field, int):
        return _TAG_INT + _INT.pack(field)
    if isinstance(field, str):
        return _TAG_STR + field.encode("utf-8")
    if isinstance(field, (bytes, bytearray, memoryview)):
        return _TAG_BYTES + bytes(field)
    raise TypeError(f"enc() takes bytes, str or int fields, not {type(field).__name__}")


def enc(*fields: Field) -> bytes:
    """Encode `fields` so that distinct field tuples always give distinct bytes."""
    parts = [_COUNT.pack(len(fields))]
    for field in fields:
        encoded = _encode_field(field)
        parts.append(_LENGTH.pack(len(encoded)))
        parts.append(encoded)
    return b"".join(parts)
