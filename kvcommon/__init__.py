"""The ground layer that the server, the agent and the tools share.

Nothing here imports `cacheserver`, `replica_agent`, `policy` or the apps in `kvshare`
(import-linter enforces it, see pyproject.toml): the exception tree of wire errors and
their status codes (`errors`), the length-prefixed field encoding (`encoding`), the
bulk channel's wire format (`bulkwire`), its socket I/O (`bulkio`) and same-host
helpers (`samehost`), trace-context propagation (`tracing`), request
ids and log rendering (`logs`), allocator tuning (`memtune`) and the generated gRPC
stubs of the `kvshare.v1` contract (`v1`).
"""
