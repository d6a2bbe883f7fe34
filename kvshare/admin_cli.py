"""`kvshare admin`: make tenants, principals and data keys as config stanzas.

    kvshare admin tenant --id acme --quota-bytes 1073741824      >> kvshare.toml
    kvshare admin token --name replica-a --tenant acme --actions read,write >> kvshare.toml
    kvshare admin cert --name replica-b --identity uri:spiffe://org/replica-b \\
        --tenant acme --actions read,write                        >> kvshare.toml
    kvshare admin keyring --tenant acme --version 1               >> keyring.toml
    kvshare admin public --quota-bytes 268435456                  >> kvshare.toml
    kvshare admin token --name publisher --actions publish        >> kvshare.toml
    kvshare admin keyring --public --version 1                    >> keyring.toml
    kvshare admin publish --target HOST:PORT --token-file F --keyring K \
        --text-file framework-prompt.txt [--model ...]   # blocks into @public
    kvshare admin reload --address HOST:PORT --token-file F  # apply kvshare.toml live
    kvshare admin delete-model --address HOST:PORT --token-file F --tenant acme \
        --namespace NS [--weight-version V]      # a retired weight version's blocks

Stanzas go to stdout, so they can be appended to a file. A new bearer token is shown
once, on stderr (or written to `--token-file`, mode 0600); the stanza holds only its
SHA-256. A data key belongs in the agents' keyring, never in the server's config.
With `--audit-log FILE` the action is recorded there (names only, never secrets).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvcommon.errors import ConfigError
from kvshare.delete_model_cli import add_delete_model_arguments, run_delete_model
from kvshare.publish import add_publish_arguments, run_publish
from kvshare.reload_cli import add_reload_arguments, run_reload
from policy.types import PUBLIC


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--audit-log", type=Path, metavar="FILE", help="append a record of this action here"
    )
    sub = parser.add_subparsers(dest="admin_command", metavar="ACTION", required=True)
    tenant = sub.add_parser("tenant", help="print a [[tenants]] stanza")
    tenant.add_argument("--id", required=True, help="tenant id, [a-z0-9][a-z0-9._-]{0,62}")
    tenant.add_argument("--quota-bytes", type=int, default=0, metavar="N", help="0: no quota")
    tenant.add_argument(
        "--read-public", action="store_true", help="its principals may read the public scope"
    )
    public = sub.add_parser("public", help="print the [public] table (the public scope)")
    public.add_argument("--quota-bytes", type=int, required=True, metavar="N")
    public.add_argument("--epoch", type=int, default=0, help="bump to retire every publication")
    token = sub.add_parser("token", help="issue a bearer token; print its [[principals]] stanza")
    _principal_arguments(token)
    token.add_argument(
        "--token-file", type=Path, metavar="FILE", help="write the token here (0600), not stderr"
    )
    cert = sub.add_parser("cert", help="print a [[principals]] stanza for an mTLS identity")
    _principal_arguments(cert)
    cert.add_argument(
        "--identity", required=True, help="uri:<URI SAN>, dns:<DNS SAN> or cn:<common name>"
    )
    keyring = sub.add_parser("keyring", help="print a [[keys]] stanza with a new data key")
    scope = keyring.add_mutually_exclusive_group(required=True)
    scope.add_argument("--tenant", help="a tenant's data key")
    scope.add_argument(
        "--public",
        action="store_true",
        help="the public scope's data key (every reading replica holds it)",
    )
    keyring.add_argument("--version", type=int, default=1, help="key version (>= 1)")
    publish = sub.add_parser(
        "publish", help="compute a public prefix's KV blocks and publish them into @public"
    )
    add_publish_arguments(publish)
    reload = sub.add_parser(
        "reload",
        help="make a running server read its config file again and apply it live "
        "(an admin principal's call; prints the outcome)",
    )
    add_reload_arguments(reload)
    delete_model = sub.add_parser(
        "delete-model",
        help="delete a tenant's blocks of one model and weight version, every TP shard "
        "(an admin principal's call; prints one JSON line)",
    )
    add_delete_model_arguments(delete_model)


def _principal_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", required=True, help="principal name (unique)")
    parser.add_argument(
        "--tenant",
        action="append",
        default=[],
        help="a tenant it may act for (repeatable; a publish-only principal needs none)",
    )
    parser.add_argument(
        "--actions", default="read,write", help="comma list of read, write, admin, publish"
    )


def run(args: argparse.Namespace) -> int:
    from policy.audit import AuditLog

    if args.admin_command == "reload":  # the server audits it, in its own log
        return run_reload(args)
    if args.admin_command == "delete-model":  # audited by itself, after the call
        return run_delete_model(args)
    try:
        fields = _perform(args)
        if args.audit_log is not None:
            audit = AuditLog(args.audit_log)
            audit.record("admin", source="kvshare admin", **fields)
            audit.close()
    except ConfigError as error:
        print(f"kvshare admin: error: {error}", file=sys.stderr)
        return 2
    return 0


def _perform(args: argparse.Namespace) -> dict[str, str | int | list[str]]:
    """Do the action, print its output; returns the audit fields (no secrets)."""
    from policy import admin
    from policy.sealing import new_key_entry

    command: str = args.admin_command
    if command == "tenant":
        print(admin.tenant_stanza(args.id, args.quota_bytes, read_public=args.read_public), end="")
        return {"action": "add_tenant", "tenant": args.id}
    if command == "public":
        print(admin.public_stanza(args.quota_bytes, args.epoch), end="")
        return {"action": "add_public_scope", "quota_bytes": args.quota_bytes}
    if command == "publish":
        return run_publish(args)
    if command == "keyring":
        tenant = PUBLIC if args.public else args.tenant
        if not args.public:
            admin.check_tenant_ids([tenant])
        if not 1 <= args.version < 2**32:
            raise ConfigError("--version must be from 1 to 2^32-1")
        print(new_key_entry(tenant, args.version), end="")
        print(
            "# a secret data key: add it to the agents' keyring file (chmod 600); "
            "the server must never see it",
            file=sys.stderr,
        )
        return {"action": "new_data_key", "tenant": tenant, "key_version": args.version}
    actions = admin.parse_actions(args.actions)
    if command == "cert":
        print(
            admin.principal_stanza(args.name, args.tenant, actions, cert_identity=args.identity),
            end="",
        )
        return {"action": "add_cert_principal", "name": args.name, "tenants": args.tenant}
    issued = admin.issue_token(args.name, args.tenant, actions)
    _show_token(args.name, issued.token, args.token_file)
    print(issued.stanza, end="")
    return {"action": "issue_token", "name": args.name, "tenants": args.tenant}


def _show_token(name: str, token: str, token_file: Path | None) -> None:
    if token_file is not None:
        try:
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            raise ConfigError(
                f"cannot create {token_file}: {error.strerror}; pick a new --token-file"
            ) from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token + "\n")
        print(f"# bearer token for {name!r} written to {token_file}", file=sys.stderr)
        return
    print(
        f"# bearer token for principal {name!r} (shown once; the server keeps only its "
        f"sha256):\n{token}",
        file=sys.stderr,
    )


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run: kvshare admin")
