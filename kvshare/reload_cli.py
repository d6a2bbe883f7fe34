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

if TYPE_CHECKING:
    from kvcommon.v1 import kvshare_pb2 as pb
    from replica_agent.client import ClientTls

DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_reload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default=DEFAULT_ADDRESS, help=f"server HOST:PORT (default {DEFAULT_ADDRESS})"
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="file holding an admin principal's bearer token (or use a client certificate)",
    )
    parser.add_argument("--tls-ca", type=Path, metavar="PEM", help="CA that signed the server")
    parser.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, metavar="PEM", help="client private key (mTLS)")
    parser.add_argument(
        "--tls-server-name", metavar="NAME", help="name to expect in the server certificate"
    )
    parser.add_argument("--timeout-s", type=float, default=60.0, help="RPC timeout (seconds)")


def request_reload(
    address: str, token: str, tls: ClientTls | None = None, timeout_s: float = 60.0
) -> pb.ReloadResponse:
    """The server's answer to Reload; grpc.RpcError when it refuses the call itself
    (UNAUTHENTICATED, PERMISSION_DENIED: not an admin) or cannot be reached."""
    import grpc

    from kvcommon.v1 import kvshare_pb2, kvshare_pb2_grpc

    options = []
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    channel = (
        grpc.secure_channel(address, tls.credentials(), options)
        if tls is not None
        else grpc.insecure_channel(address)
    )
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

    from replica_agent.client import ClientTls

    if (args.tls_cert is None) != (args.tls_key is None):
        print("kvshare admin reload: error: give both --tls-cert and --tls-key", file=sys.stderr)
        return 2
    try:
        token = args.token_file.read_text(encoding="utf-8").strip() if args.token_file else ""
    except OSError as error:
        print(
            f"kvshare admin reload: error: cannot read {args.token_file}: {error.strerror}",
            file=sys.stderr,
        )
        return 2
    use_tls = args.tls_ca or args.tls_cert or args.tls_server_name
    tls = (
        ClientTls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
        if use_tls
        else None
    )
    try:
        reply = request_reload(args.address, token, tls, args.timeout_s)
    except grpc.RpcError as error:
        code = error.code() if isinstance(error, grpc.Call) else None
        detail = error.details() if isinstance(error, grpc.Call) else str(error)
        name = code.name if code is not None else "ERROR"
        print(f"kvshare admin reload: {name}: {' '.join((detail or '').split())}", file=sys.stderr)
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
