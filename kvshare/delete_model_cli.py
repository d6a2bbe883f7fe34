"""`kvshare admin delete-model`: delete one weight version's blocks of a tenant's model.

    kvshare admin delete-model --address HOST:PORT --token-file F --tenant acme \\
        --namespace 'org/llama@main;bf16;L32;H8;D128;B256;tp0/2;Wstep-100' \\
        [--weight-version step-90] [--tls-ca PEM ...]

`--namespace` is one replica's store namespace (ReplicaAgent.model, the vLLM
connector's or the SGLang backend's `namespace`): the model, its KV layout, its
tensor-parallel shard and its weight version. Every shard of it is deleted
(tp0/N .. tp(N-1)/N), for the version in the namespace, or for `--weight-version`
(`''`: the blocks of replicas that set no version). Blocks are named by the model
string, so this is the server's namespace delete (Delete with whole_tenant and a
model), which needs a principal with the `admin` action. Prints one JSON line:
the tenant, the namespaces deleted and how many blocks went.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvcommon.errors import ConfigError
from kvshare.client_options import client_tls, half_cert_pair, read_token_file
from kvshare.reload_cli import add_reload_arguments

ACTION = "delete-model"


def add_delete_model_arguments(parser: argparse.ArgumentParser) -> None:
    add_reload_arguments(parser)  # where the server is and who asks: as for reload
    parser.add_argument("--tenant", required=True, help="the tenant whose blocks go")
    parser.add_argument(
        "--namespace", required=True, help="a replica's store namespace (MODEL@REV;...;tpR/N...)"
    )
    parser.add_argument(
        "--weight-version",
        metavar="V",
        help="delete this version's blocks instead of the namespace's own ('': unversioned)",
    )


def run_delete_model(args: argparse.Namespace) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # one line of answer, not gRPC's logs
    from replica_agent.errors import BlockStoreError

    try:
        report = _delete(args)
    except ConfigError as error:
        print(f"kvshare admin {ACTION}: error: {error}", file=sys.stderr)
        return 2
    except BlockStoreError as error:
        details = " ".join(error.details().split())
        print(f"kvshare admin {ACTION}: {error.code().name}: {details}", file=sys.stderr)
        return 1
    print(json.dumps(report))
    if args.audit_log is not None:
        from policy.audit import AuditLog

        audit = AuditLog(args.audit_log)
        audit.record(
            "admin",
            source="kvshare admin",
            action="delete_model",
            tenant=args.tenant,
            blocks=report["deleted_blocks"],
        )
        audit.close()
    return 0


def _delete(args: argparse.Namespace) -> dict[str, Any]:
    from policy.types import is_valid_tenant_id
    from replica_agent.client import BlockClient
    from replica_agent.spec import namespaces_of_version

    if not is_valid_tenant_id(args.tenant):
        raise ConfigError("--tenant must match [a-z0-9][a-z0-9._-]{0,62}")
    if half_cert_pair(args):
        raise ConfigError("give both --tls-cert and --tls-key")
    version = args.weight_version
    if version is None:  # the namespace's own version
        tail = args.namespace.rsplit(";", 1)[-1]
        version = tail[1:] if tail.startswith("W") else ""
    try:
        namespaces = namespaces_of_version(args.namespace, version)
    except ValueError as error:
        raise ConfigError(f"--namespace/--weight-version: {error}") from None
    token = read_token_file(args.token_file)
    tls = client_tls(args)
    deleted = 0
    with BlockClient(args.address, token, tls=tls, timeout_s=args.timeout_s, bulk=False) as client:
        for namespace in namespaces:
            deleted += client.delete_tenant(args.tenant, namespace)
    return {"tenant": args.tenant, "namespaces": namespaces, "deleted_blocks": deleted}
