"""The committed gRPC code in kubetrain/trainer/ps/ is what protoc makes of protos/ now."""

import shutil
import subprocess
import sys

from kubetrain.trainer.ps import codegen


def test_committed_generated_code_is_up_to_date():
    assert codegen.stale_files() == [], "run: python -m kubetrain.trainer.ps.codegen"


def test_an_edited_proto_makes_the_check_fail(tmp_path):
    shutil.copytree(codegen.PROTO_ROOT, tmp_path / "protos")
    proto = tmp_path / "protos" / codegen.PROTO
    proto.write_text(proto.read_text() + "\nmessage Added { string field = 1; }\n")
    assert set(codegen.stale_files(proto_root=tmp_path / "protos")) == {"ps_pb2.py", "ps_pb2.pyi"}


def test_generated_stub_imports_its_sibling_package_relatively():
    stub = (codegen.PACKAGE_DIR / "ps_pb2_grpc.py").read_text()
    assert codegen.RELATIVE_IMPORT in stub and codegen.ABSOLUTE_IMPORT not in stub


def test_check_command_exits_0_when_up_to_date():
    done = subprocess.run([sys.executable, "-m", "kubetrain.trainer.ps.codegen", "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stdout
