"""The transports: each decodes its frames into the request core's verbs and encodes
the results, nothing more.

- `grpc`: the protobuf service, its authentication interceptor and its executor use;
- `bulk`: the bulk channel over TCP or TLS, and its sealed-payload variant;
- `arena`: the same-host transport's shared memory, used by the bulk listener.

No transport imports the store or a tier: they talk to `cacheserver.core`.
"""
