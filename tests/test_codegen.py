"""The committed generated code must equal what protos/codegen.py produces now."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_up_to_date(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "protos" / "codegen.py"), "--out", str(tmp_path)], check=True)
    for name in ("shardps_pb2.py", "shardps_pb2.pyi", "shardps_pb2_grpc.py"):
        fresh = (tmp_path / "shardps" / "v1" / name).read_text()
        committed = (ROOT / "shardps" / "v1" / name).read_text()
        assert fresh == committed, f"shardps/v1/{name} is stale: run `python protos/codegen.py` and commit"


def test_every_proto_field_and_message_is_commented():
    lines = (ROOT / "protos" / "shardps" / "v1" / "shardps.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        is_decl = (s.endswith(";") and "=" in s and not s.startswith(("syntax", "option", "//"))) or s.startswith(
            ("message ", "enum ", "rpc ", "service ")
        )
        if is_decl:
            assert lines[i - 1].strip().startswith("//"), f"shardps.proto:{i + 1} has no comment: {s}"
