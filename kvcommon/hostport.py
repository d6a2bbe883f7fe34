"""`HOST:PORT` addresses: parsed once, and the one rule for a wildcard bulk address.

The server announces its bulk listener in OpenBulk. A listener bound to a wildcard
(`0.0.0.0`, `[::]`) has no address a client could dial, and a NAT or a Kubernetes
Service may put the store behind a name the server cannot know; so the server
announces `[bulk] advertise` when set, else what it bound, and a client that is told a
wildcard (or no host) dials the host it dialed for gRPC, at the announced port.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "*"})
_GRPC_SCHEMES = ("dns:///", "dns:", "ipv4:", "ipv6:")


@dataclass(frozen=True)
class HostPort:
    host: str  # without IPv6 brackets; "" when absent
    port: int

    @property
    def is_wildcard(self) -> bool:
        return self.host in WILDCARD_HOSTS

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def bracketed_host(self) -> str:
        """The host as it is written before `:PORT` (IPv6 in brackets)."""
        return f"[{self.host}]" if ":" in self.host else self.host

    def __str__(self) -> str:
        return f"{self.bracketed_host}:{self.port}"


def parse_host_port(text: str, *, what: str = "address") -> HostPort:
    """`host:port`, `[v6]:port` or `:port` -> HostPort; ValueError says what is wrong."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep:
        raise ValueError(f"{what} {text!r} is not HOST:PORT (e.g. 0.0.0.0:50052)")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"{what} {text!r}: unclosed [ around the IPv6 address")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{what} {text!r}: write an IPv6 address in brackets, [::1]:50052")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{what} {text!r}: the port must be a number from 0 to 65535")
    if any(c.isspace() for c in host):
        raise ValueError(f"{what} {text!r}: the host has a space in it")
    return HostPort(host, int(port_text))


def dialed_host(target: str) -> str:
    """The host of a gRPC target (`host:port`, `dns:///host:port`, `ipv4:a:p`...);
    `localhost` for a Unix socket target (`unix:...`), which is on this host."""
    if target.startswith(("unix:", "unix-abstract:")):
        return "localhost"
    for scheme in _GRPC_SCHEMES:
        if target.startswith(scheme):
            target = target[len(scheme) :].split(",", 1)[0]
            break
    if "/" in target:  # dns://authority/host:port
        target = target.rsplit("/", 1)[1]
    try:
        return parse_host_port(target).host
    except ValueError:
        return target  # a bare host name (gRPC's default port)


def bulk_dial_address(announced: str, grpc_target: str) -> str:
    """Where a client connects for the bulk channel: the announced address, with its
    host replaced by the gRPC target's host when the announced one is a wildcard or
    absent. An unreadable announcement is returned as it is (the connect then fails
    and the call falls back to gRPC)."""
    try:
        address = parse_host_port(announced)
    except ValueError:
        return announced
    if address.is_wildcard:
        address = HostPort(dialed_host(grpc_target), address.port)
    return str(address)
