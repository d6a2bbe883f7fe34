"""Where the bulk channel listens and what OpenBulk tells clients: `[bulk] listen` and
`advertise` (or `--bulk-listen` / `--bulk-advertise`), checked by the same specs
(`BULK_ADDRESSES`) for the file and the flags (docs/deploy.md)."""

from __future__ import annotations

from typing import Protocol

from kvcommon.errors import ConfigError
from kvcommon.hostport import HostPort, parse_host_port
from policy.config_text import (
    Address,
)


# What these helpers read of ServerConfig and its BulkConfig, as protocols (a
# ServerConfig is a ListenSettings): the package that defines ServerConfig imports this
# module's specs, so naming it here would make the two import each other.
class BulkAddresses(Protocol):
    @property
    def listen(self) -> str: ...
    @property
    def advertise(self) -> str: ...


class ListenSettings(Protocol):
    @property
    def listen(self) -> str: ...
    @property
    def allow_insecure_listen(self) -> bool: ...
    @property
    def bulk(self) -> BulkAddresses: ...


# A listener may bind port 0 (any free port); an announced address is dialed, so not.
BULK_ADDRESSES = {
    "listen": Address("listen", 0, empty="the gRPC listen host at its port + 1"),
    "advertise": Address("advertise", 1, empty="the bound address"),
}


def bulk_listen_address(config: ListenSettings) -> HostPort:
    """Where the bulk channel's TCP/TLS listener binds: `[bulk] listen`, else the gRPC
    listen host at the gRPC port + 1 (0 stays 0)."""
    if config.bulk.listen:
        return parse_host_port(config.bulk.listen)
    try:
        grpc = parse_host_port(config.listen, what="listen")
    except ValueError as error:
        raise ConfigError(f"{error}; pick another --listen") from None
    if grpc.port == 65535:
        raise ConfigError(
            f"listen {config.listen}: the bulk channel's default port (the gRPC port + 1) "
            "does not exist; set [bulk] listen or --bulk-listen"
        )
    return HostPort(grpc.host, grpc.port + 1 if grpc.port else 0)


def check_bulk_plaintext(config: ListenSettings, has_tls: bool) -> None:
    """The bulk listener's own address follows the gRPC rule: plaintext only on
    loopback unless allowed (its default address is the gRPC host's, checked there)."""
    if has_tls or config.allow_insecure_listen or not config.bulk.listen:
        return
    address = parse_host_port(config.bulk.listen)
    if not address.is_loopback:
        raise ConfigError(
            f"refusing to listen on non-loopback {address} for the bulk channel without "
            "TLS; give --tls-cert/--tls-key (or [tls]), or --allow-insecure-listen on a "
            "trusted network"
        )


def bulk_announced_address(config: ListenSettings, bound: str) -> str:
    """What OpenBulk tells clients: `[bulk] advertise`, else the bound address (a
    wildcard host there means: the host you dialed for gRPC)."""
    return config.bulk.advertise or bound
