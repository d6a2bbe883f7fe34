"""Where a benchmarked server runs and how its clients reach it.

`LOOPBACK`: server and clients on this host, over 127.0.0.1 (the default run).
`two_host(rig)`: each server inside the rig's server namespace, started with
`ip netns exec`, and the harness with its client processes inside the client
namespace, dialing the server's address across the veth (kvshare.bench.netns). Every
result row carries the placement's `topology` (docs/design.md §8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvshare.bench.netns import Host, TwoHosts

LOOPBACK_TOPOLOGY = "loopback"
TWO_HOST_TOPOLOGY = "two-host"


@dataclass(frozen=True)
class Placement:
    topology: str
    server_host: str  # where servers listen and clients dial
    server_namespace: str = ""  # "": this process's namespace
    client_namespace: str = ""

    @property
    def is_two_host(self) -> bool:
        return self.topology == TWO_HOST_TOPOLOGY

    def server_command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as it runs on the server's host."""
        if not self.server_namespace:
            return list(argv)
        return Host(self.server_namespace, self.server_host).command(argv)

    def check_client_side(self) -> None:
        """Raise unless the calling thread is where clients belong (netns.RigError)."""
        if self.client_namespace:
            Host(self.client_namespace, "").require_current()


LOOPBACK = Placement(LOOPBACK_TOPOLOGY, "127.0.0.1")


def two_host(rig: TwoHosts) -> Placement:
    return Placement(
        TWO_HOST_TOPOLOGY, rig.server.address, rig.server.namespace, rig.client.namespace
    )
