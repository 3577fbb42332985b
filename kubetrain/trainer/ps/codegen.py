"""Regenerate (or, with --check, verify) the gRPC code of protos/ in kubetrain/trainer/ps/.

    python -m kubetrain.trainer.ps.codegen [--check]

grpc_tools.protoc writes `from kubetrain.ps.v1 import ps_pb2`, an import path
that exists only in the proto tree; the generated stub is rewritten to import
its sibling package-relatively, so kubetrain/trainer/ps/ works wherever it is installed.
The output depends on the pinned grpcio-tools version alone, so --check fails
exactly when someone edited the .proto without regenerating.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_ROOT = PACKAGE_DIR.parents[2] / "protos"
PROTO = "kubetrain/ps/v1/ps.proto"
GENERATED = ("ps_pb2.py", "ps_pb2_grpc.py", "ps_pb2.pyi")
ABSOLUTE_IMPORT = "from kubetrain.ps.v1 import ps_pb2 as"
RELATIVE_IMPORT = "from . import ps_pb2 as"


def generate(proto_root: Path = PROTO_ROOT) -> dict[str, bytes]:
    """Run protoc on the .proto and return the generated files, imports fixed, by name."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as out:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(proto_root / PROTO),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto_root / PROTO}")
        generated_dir = Path(out) / Path(PROTO).parent
        files = {name: (generated_dir / name).read_bytes() for name in GENERATED}
    stub = files["ps_pb2_grpc.py"].decode()
    if ABSOLUTE_IMPORT not in stub:
        raise RuntimeError(f"ps_pb2_grpc.py no longer contains {ABSOLUTE_IMPORT!r}; update codegen.py")
    files["ps_pb2_grpc.py"] = stub.replace(ABSOLUTE_IMPORT, RELATIVE_IMPORT).encode()
    return files


def stale_files(target: Path = PACKAGE_DIR, proto_root: Path = PROTO_ROOT) -> list[str]:
    """Names of the generated files in `target` that differ from what protoc makes of `proto_root` now."""
    return [
        name for name, content in generate(proto_root).items()
        if not (target / name).is_file() or (target / name).read_bytes() != content
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetrain.trainer.ps.codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed code is stale; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code in {PACKAGE_DIR}: {', '.join(stale)}; run python -m kubetrain.trainer.ps.codegen", file=sys.stderr)
            return 1
        print("generated code is up to date")
        return 0
    for name, content in generate().items():
        (PACKAGE_DIR / name).write_bytes(content)
        print(f"wrote {PACKAGE_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
