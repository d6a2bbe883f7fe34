"""The request core: every verb admitted and carried out once, for every transport.

`requests` holds `RequestCore` (the verbs), `admission` the one order of checks
(`checks`: its begin and name stages, which bulk read workers run too),
`transfers` a GET's reply and a put's blocks as transports see them, `values` what
crosses between a transport and the core. `readonly` is the core as a bulk read worker
runs it in its own process (admission on delegated grants, LMDB's read-only view), and
`served` counts what a worker served in the store's events, replayed by the server."""
