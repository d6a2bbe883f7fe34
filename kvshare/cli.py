"""The `kvshare` console script: one dispatcher, one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. The
modules are imported when the parser is built, so they must keep heavy imports
(torch, transformers, lmdb, grpc) inside `run`: `kvshare serve --help` then works on a
server-only install, and `kvshare simulate` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast


class _Command(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# name -> (module, one-line help). Order is the order `kvshare --help` lists them in.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("cacheserver.cli", "run the block store server"),
    "demo": (
        "kvshare.demo.cli",
        "round robin with and without the shared store, on real replicas",
    ),
    "simulate": (
        "kvshare.simulate.cli",
        "replay a request trace through routing policies and caches",
    ),
    "bench": ("kvshare.bench.cli", "data-path benchmark of kvshare against its peers"),
    "admin": ("kvshare.admin_cli", "make tenants, tokens, mTLS principals and data keys"),
    "stats": ("kvshare.stats_cli", "per-tenant usage, hit rate and bytes of a running server"),
    "audit": ("kvshare.audit.cli", "operator's checks of a running deployment (timing)"),
    "health": (
        "kvshare.health_cli",
        "ask a running server's gRPC health service (exit 0: SERVING)",
    ),
}


OWN_PACKAGES = frozenset({"kvshare", "kvcommon", "cacheserver", "replica_agent", "policy"})


def _load(module_name: str) -> _Command:
    return cast(_Command, importlib.import_module(module_name))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvshare",
        description="kvshare: a multi-tenant, secure, shared prefix-KV-cache service.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            command = _load(module_name)
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] in OWN_PACKAGES:
                raise  # a bug in kvshare itself, not a missing optional dependency
            sub = subparsers.add_parser(name, help=f"{help_text} (unavailable: {error.name})")
            sub.set_defaults(_unavailable=str(error))
            continue
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        command.add_arguments(sub)
        sub.set_defaults(_module=module_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unavailable = getattr(args, "_unavailable", None)
    if unavailable is not None:
        print(
            f"kvshare {args.command}: not installed here ({unavailable}); "
            "install the extra it needs, e.g. pip install -e '.[agent]'",
            file=sys.stderr,
        )
        return 2
    return _load(args._module).run(args)


if __name__ == "__main__":
    sys.exit(main())
