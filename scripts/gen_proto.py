"""Generate the Python stubs for proto/ into kvcommon/v1, or check they are current.

    python scripts/gen_proto.py          # regenerate
    python scripts/gen_proto.py --check  # exit 1 when the committed stubs drift

The wire contract is the proto package `kvshare.v1` (proto/kvshare/v1/kvshare.proto);
its stubs live in the ground package `kvcommon` (server and agent both import them),
not in a package named `proto` (PyPI's proto-plus owns that import name). protoc is
given the file under the virtual path `kvcommon/v1/`, so the generated modules import
each other as `kvcommon.v1.*`; the service's full name (`kvshare.v1.BlockStore`), and
so the wire, is unchanged. CI runs `--check`, so a `.proto` edit without regenerating
fails.

The mypy plugins (protoc-gen-mypy, protoc-gen-mypy_grpc) are taken from beside this
interpreter, so `venv/bin/python scripts/gen_proto.py --check` works without an
activated venv.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto" / "kvshare" / "v1"
VIRTUAL_DIR = "kvcommon/v1"  # where protoc (and so the generated imports) see the files
PROTOS = ["kvshare.proto"]
GENERATED = ["kvshare_pb2.py", "kvshare_pb2.pyi", "kvshare_pb2_grpc.py", "kvshare_pb2_grpc.pyi"]
PLUGINS = ("protoc-gen-mypy", "protoc-gen-mypy_grpc")


def _plugin_args() -> list[str]:
    """`--plugin=NAME=PATH` for each mypy plugin found beside the interpreter (a venv's
    bin/, which is not on PATH unless the venv is activated); else protoc searches PATH."""
    bindir = Path(sys.executable).parent
    return [f"--plugin={name}={bindir / name}" for name in PLUGINS if (bindir / name).exists()]


def generate(out_dir: Path) -> None:
    args = [
        "grpc_tools.protoc",
        f"-I{VIRTUAL_DIR}={PROTO_DIR}",
        *_plugin_args(),
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(str(PROTO_DIR / p) for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the message above")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if stubs drift from proto/")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / VIRTUAL_DIR
        target = ROOT / VIRTUAL_DIR
        drifted = [
            n
            for n in GENERATED
            if not (target / n).exists() or not filecmp.cmp(fresh / n, target / n, shallow=False)
        ]
        if args.check:
            if drifted:
                print(
                    f"generated stubs drift from proto/: {', '.join(drifted)}; "
                    "run: python scripts/gen_proto.py",
                    file=sys.stderr,
                )
                return 1
            print("generated stubs match proto/")
            return 0
        for name in GENERATED:
            shutil.copyfile(fresh / name, target / name)
        print(f"wrote {len(GENERATED)} files to {VIRTUAL_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
