"""Where a client sends its calls: one server, or several that share one store.

Servers over one Redis Cluster (docs/scale-out.md) serve the same blocks, so a client
may name several: a list of HOST:PORT (IP addresses), a gRPC target that lists them
(`ipv4:10.0.0.7:50051,10.0.0.8:50051`), or a `dns:///name:port` that resolves to all of
them. Calls then round-robin across the servers that answer, and a call refused because
its server went away (UNAVAILABLE before any reply) is sent again to another one: a
server that dies costs at most the calls it was in the middle of.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from typing import Any

from kvcommon.hostport import parse_host_port

SERVICE = "kvshare.v1.BlockStore"
# Every call is safe to send again after UNAVAILABLE: puts are idempotent (first writer
# wins), reads and lookups have no effect, deletes of deleted blocks delete nothing.
_BALANCED = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [
        {
            "name": [{"service": SERVICE}],
            "retryPolicy": {
                "maxAttempts": 3,
                "initialBackoff": "0.05s",
                "maxBackoff": "0.5s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
}


def grpc_target(address: str | Sequence[str]) -> str:
    """One gRPC target for `address`: itself, or a list of servers as `ipv4:`/`ipv6:`."""
    if isinstance(address, str):
        return address
    servers = list(address)
    if not servers:
        raise ValueError("no server address given; name at least one HOST:PORT")
    if len(servers) == 1:
        return servers[0]
    versions = set()
    for server in servers:
        try:
            versions.add(ipaddress.ip_address(parse_host_port(server).host).version)
        except ValueError:
            raise ValueError(
                f"{server!r}: to balance across servers name each by IP address, or give "
                "one dns:///NAME:PORT that resolves to all of them"
            ) from None
    if len(versions) > 1:
        raise ValueError("mix of IPv4 and IPv6 servers; name them all in one family")
    scheme = "ipv4:" if versions == {4} else "ipv6:"
    return scheme + ",".join(str(parse_host_port(s)) for s in servers)


def is_balanced(target: str) -> bool:
    """Whether `target` may name several servers."""
    if target.startswith("dns:"):
        return True
    return target.startswith(("ipv4:", "ipv6:")) and "," in target


def balancing_options(target: str) -> list[tuple[str, Any]]:
    """Channel options for `target`: round robin and retries when it names several."""
    if not is_balanced(target):
        return []
    return [("grpc.service_config", json.dumps(_BALANCED)), ("grpc.enable_retries", 1)]
