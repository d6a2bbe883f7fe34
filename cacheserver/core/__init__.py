"""The request core: every verb admitted and carried out once, for every transport.

`requests` holds `RequestCore` (the verbs), `admission` the one order of checks
(`checks`: those that need no server state, which bulk workers run too),
`transfers` a GET's reply and a put's blocks as transports see them, `values` what
crosses between a transport and the core."""
