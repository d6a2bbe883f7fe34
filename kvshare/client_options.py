"""The options by which a client command finds the server, and its TLS settings from them.

`kvshare stats`, `kvshare health`, `kvshare admin reload` and `kvshare admin delete-model`
take the same --address, --tls-ca, --tls-cert, --tls-key, --tls-server-name and
--timeout-s (each command its own --timeout-s default); those that take a --token-file
(and `kvshare admin publish`) read it with `read_token_file`. grpc and the client are
imported only when called, so that `kvshare health` can quiet gRPC's log before gRPC
first loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kvcommon.errors import ConfigError

if TYPE_CHECKING:
    import grpc

    from replica_agent.client import ClientTls

DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_address_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default=DEFAULT_ADDRESS, help=f"server HOST:PORT (default {DEFAULT_ADDRESS})"
    )


def add_tls_arguments(parser: argparse.ArgumentParser, *, timeout_s: float) -> None:
    """--tls-ca, --tls-cert, --tls-key, --tls-server-name and --timeout-s (default
    `timeout_s`)."""
    parser.add_argument("--tls-ca", type=Path, metavar="PEM", help="CA that signed the server")
    parser.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, metavar="PEM", help="client private key (mTLS)")
    parser.add_argument(
        "--tls-server-name", metavar="NAME", help="name to expect in the server certificate"
    )
    parser.add_argument("--timeout-s", type=float, default=timeout_s, help="RPC timeout (seconds)")


def read_token_file(path: Path | None) -> str:
    """The bearer token in `path` (surrounding white space dropped); "" for no file (a
    client certificate, or dev mode). ConfigError naming the file when it cannot be read."""
    if path is None:
        return ""
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from None


def half_cert_pair(args: argparse.Namespace) -> bool:
    """One of --tls-cert and --tls-key given without the other."""
    return (args.tls_cert is None) != (args.tls_key is None)


def client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The TLS settings the options ask for; None (plaintext) when no TLS option is given."""
    from replica_agent.client import ClientTls

    if not (args.tls_ca or args.tls_cert or args.tls_server_name):
        return None
    return ClientTls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


def open_channel(address: str, tls: ClientTls | None) -> grpc.Channel:
    """A gRPC channel to `address`, over `tls` where given (its server name overriding the
    address's). OSError when a TLS file cannot be read."""
    import grpc

    if tls is None:
        return grpc.insecure_channel(address)
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.secure_channel(address, tls.credentials(), options)


def rpc_failure(error: grpc.RpcError) -> tuple[str, str]:
    """The status code's name (ERROR when the failure carries none) and the details of a
    failed call, on one line."""
    import grpc

    code = error.code() if isinstance(error, grpc.Call) else None
    detail = error.details() if isinstance(error, grpc.Call) else str(error)
    return (code.name if code is not None else "ERROR"), " ".join((detail or "").split())
