"""`kvshare simulate`: replay a request trace through routing policies and KV caches.

It answers one question with numbers: how much prefix-cache benefit a round-robin
load balancer throws away, and how much a shared block store wins back, as replica
count, cache sizes, traffic shape, bursts and autoscaling vary.

Data flows one way: `options` turns flags into one frozen value (errors in `errors`);
`trace` parses the Mooncake-format file once into `Request`s; `scenarios` reshapes
traffic (bursts, unique prompts) and plans replica joins and leaves; `engine` replays
one configuration (policy x replicas x store) over a `cluster` of replicas with their
`caches`, the routing `policies` and the `timing` model (speeds from `presets`);
`sweep` runs many configurations; `report` and `plot` present them; `cli` wires it to
`kvshare simulate`. `public_prefix` is a second workload that needs no trace: tenants
sharing a framework prompt, replayed without and with the public scope. Pure Python:
no numpy, no torch; matplotlib only inside `plot`.
The hit-rate semantics are docs/design.md §8's contract; docs/round-robin.md has the study.
"""
