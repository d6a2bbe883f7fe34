"""`kvshare health`: ask a running server's standard gRPC health service (grpc.health.v1).

    kvshare health --address HOST:PORT [--service NAME] [--tls-ca PEM ...]

For the places that need a command rather than a gRPC probe (a container's exec probe,
a load balancer's script check). Exit 0 when the service answers SERVING; otherwise 1
with one line on stderr saying what it answered or why no answer came (the health
service needs no credentials: a client certificate is only needed where the server
requires mTLS of every connection).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default=DEFAULT_ADDRESS, help=f"server HOST:PORT (default {DEFAULT_ADDRESS})"
    )
    parser.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help="the health service to ask (default: the server as a whole; "
        "e.g. kvshare.v1.BlockStore)",
    )
    parser.add_argument("--tls-ca", type=Path, metavar="PEM", help="CA that signed the server")
    parser.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, metavar="PEM", help="client private key (mTLS)")
    parser.add_argument(
        "--tls-server-name", metavar="NAME", help="name to expect in the server certificate"
    )
    parser.add_argument("--timeout-s", type=float, default=5.0, help="RPC timeout (seconds)")


def run(args: argparse.Namespace) -> int:
    # gRPC's own log lines (a failed TLS handshake) would break the one-line answer;
    # read when gRPC starts, so before its first import.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from replica_agent.client import ClientTls

    if (args.tls_cert is None) != (args.tls_key is None):
        print("kvshare health: error: give both --tls-cert and --tls-key", file=sys.stderr)
        return 2
    use_tls = args.tls_ca or args.tls_cert or args.tls_server_name
    try:
        if use_tls:
            tls = ClientTls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
            options = (
                [("grpc.ssl_target_name_override", args.tls_server_name)]
                if args.tls_server_name
                else []
            )
            channel = grpc.secure_channel(args.address, tls.credentials(), options)
        else:
            channel = grpc.insecure_channel(args.address)
    except OSError as error:
        print(f"kvshare health: error: cannot read a TLS file: {error}", file=sys.stderr)
        return 2
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
            )
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else None
            detail = error.details() if isinstance(error, grpc.Call) else str(error)
            name = code.name if code is not None else "ERROR"
            print(
                f"kvshare health: {args.address}: no answer ({name}: {_one_line(detail)})",
                file=sys.stderr,
            )
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"kvshare health: {args.address}: {status}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())[:300]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run: kvshare health")
