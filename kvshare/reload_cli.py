"""`kvshare admin reload`: ask a running server to read its config file again, live.

    kvshare admin reload --address HOST:PORT --token-file F [--tls-ca PEM ...]

The server's answer (the admin RPC Reload, cacheserver.reload) is one line: what
changed and the config generation now serving (exit 0), or why the reload was refused
and what to change, while the running config keeps serving (exit 1). The caller needs
a principal with the `admin` action. `kill -HUP` of the server process does the same,
and the answer goes to the server's log.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvcommon.errors import ConfigError
from kvshare.client_options import (
    add_address_argument,
    add_tls_arguments,
    client_tls,
    half_cert_pair,
    open_channel,
    read_token_file,
    rpc_failure,
)

if TYPE_CHECKING:
    from kvcommon.v1 import kvshare_pb2 as pb
    from replica_agent.client import ClientTls


def add_reload_arguments(parser: argparse.ArgumentParser) -> None:
    add_address_argument(parser)
    parser.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="file holding an admin principal's bearer token (or use a client certificate)",
    )
    add_tls_arguments(parser, timeout_s=60.0)


def request_reload(
    address: str, token: str, tls: ClientTls | None = None, timeout_s: float = 60.0
) -> pb.ReloadResponse:
    """The server's answer to Reload; grpc.RpcError when it refuses the call itself
    (UNAUTHENTICATED, PERMISSION_DENIED: not an admin) or cannot be reached."""
    from kvcommon.v1 import kvshare_pb2, kvshare_pb2_grpc

    channel = open_channel(address, tls)
    metadata: tuple[tuple[str, str | bytes], ...] = (
        (("authorization", f"Bearer {token}"),) if token else ()
    )
    with channel:
        stub = kvshare_pb2_grpc.BlockStoreStub(channel)
        reply: kvshare_pb2.ReloadResponse = stub.Reload(
            kvshare_pb2.ReloadRequest(), metadata=metadata, timeout=timeout_s
        )
        return reply


def run_reload(args: argparse.Namespace) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # one line of answer, not gRPC's logs
    import grpc

    if half_cert_pair(args):
        print("kvshare admin reload: error: give both --tls-cert and --tls-key", file=sys.stderr)
        return 2
    try:
        token = read_token_file(args.token_file)
    except ConfigError as error:
        print(f"kvshare admin reload: error: {error}", file=sys.stderr)
        return 2
    try:
        reply = request_reload(args.address, token, client_tls(args), args.timeout_s)
    except grpc.RpcError as error:
        name, detail = rpc_failure(error)
        print(f"kvshare admin reload: {name}: {detail}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"kvshare admin reload: error: cannot read a TLS file: {error}", file=sys.stderr)
        return 2
    if not reply.applied:
        print(
            f"kvshare admin reload: refused (generation {reply.generation} keeps serving): "
            f"{reply.message}",
            file=sys.stderr,
        )
        return 1
    print(f"reloaded: generation {reply.generation}: {reply.message}")
    return 0
