"""Regenerate the committed gRPC/protobuf code under shardps/v1/.

Usage: python protos/codegen.py [--out DIR]

With --out the code is written below DIR instead of the repository root
(tests use this to check that the committed code is up to date).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
PROTOS = ["shardps/v1/shardps.proto"]


def generate(out: pathlib.Path) -> None:
    """Run protoc (from grpcio-tools) on every proto, writing below ``out``."""
    import importlib.resources

    from grpc_tools import protoc  # imported here: only contributors need grpcio-tools

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    out.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO_DIR / proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {proto}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT, help="output root directory")
    args = parser.parse_args(argv)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
