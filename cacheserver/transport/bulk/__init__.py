"""The bulk channel: block bytes over TCP/TLS or a same-host arena, beside gRPC.

`listener` accepts connections, `handshake` authenticates them (one-time tickets from
OpenBulk), `turns` says which process serves a plain-TCP one (this or a bulk read
worker: `readworker` is one, `readworkers` the server's side of them, `processes` their
processes, `delegation` what crosses between the two);
`handler` frames each request around the request core (cacheserver.core.requests);
`sealed` is the sealed-payload channel's framing (AEAD headers, tagged PUT payloads,
sealed-only GETs) for tenants that require sealed blocks; `arena` is the same-host
transport's shared memory. Framing: kvcommon.bulkwire.
"""

from cacheserver.transport.bulk.accepting import server_tls_context
from cacheserver.transport.bulk.listener import BulkServer

__all__ = ["BulkServer", "server_tls_context"]
