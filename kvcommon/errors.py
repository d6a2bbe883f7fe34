"""The one exception tree for errors that cross the wire.

Each class names the gRPC status it becomes; the server turns it into
`context.abort(status, message)` in exactly one place (cacheserver/service.py) and the
client maps the status back (replica_agent/client.py). Messages say what to change and
never echo tokens, digests, payloads or another tenant's data. Anything else raised in a
handler is a bug: logged with a request id, returned as INTERNAL with a fixed message.
"""

from __future__ import annotations


class KvshareError(Exception):
    """Base class; `status` is the name of a `grpc.StatusCode` member."""

    status = "INTERNAL"


class Unauthenticated(KvshareError):
    status = "UNAUTHENTICATED"


class PermissionDenied(KvshareError):
    status = "PERMISSION_DENIED"


class InvalidArgument(KvshareError):
    status = "INVALID_ARGUMENT"


class ResourceExhausted(KvshareError):
    status = "RESOURCE_EXHAUSTED"


class Unavailable(KvshareError):
    status = "UNAVAILABLE"


class DataLoss(KvshareError):
    status = "DATA_LOSS"


class ConfigError(ValueError):
    """A configuration problem found at start-up; the message names the key to fix."""
