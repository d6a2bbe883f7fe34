"""Generate the Python stubs for proto/ into kvshare/v1, or check they are current.

    python scripts/gen_proto.py          # regenerate
    python scripts/gen_proto.py --check  # exit 1 when the committed stubs drift

The stubs live in `kvshare.v1`, not in a package named `proto` (PyPI's proto-plus
owns that import name). CI runs `--check`, so a `.proto` edit without regenerating fails.
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
PROTO_ROOT = ROOT / "proto"
PROTOS = ["kvshare/v1/kvshare.proto"]
GENERATED = ["kvshare_pb2.py", "kvshare_pb2.pyi", "kvshare_pb2_grpc.py", "kvshare_pb2_grpc.pyi"]


def generate(out_dir: Path) -> None:
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(str(PROTO_ROOT / p) for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the message above")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if stubs drift from proto/")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "kvshare" / "v1"
        target = ROOT / "kvshare" / "v1"
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
        print(f"wrote {len(GENERATED)} files to {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
