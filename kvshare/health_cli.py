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

from kvshare.client_options import (
    add_address_argument,
    add_tls_arguments,
    client_tls,
    half_cert_pair,
    open_channel,
    rpc_failure,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_address_argument(parser)
    parser.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help="the health service to ask (default: the server as a whole; "
        "e.g. kvshare.v1.BlockStore)",
    )
    add_tls_arguments(parser, timeout_s=5.0)


def run(args: argparse.Namespace) -> int:
    # gRPC's own log lines (a failed TLS handshake) would break the one-line answer;
    # read when gRPC starts, so before its first import.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if half_cert_pair(args):
        print("kvshare health: error: give both --tls-cert and --tls-key", file=sys.stderr)
        return 2
    try:
        channel = open_channel(args.address, client_tls(args))
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
            name, detail = rpc_failure(error)
            print(
                f"kvshare health: {args.address}: no answer ({name}: {detail[:300]})",
                file=sys.stderr,
            )
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"kvshare health: {args.address}: {status}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run: kvshare health")
