"""The committed gRPC stubs are exactly what proto/tierkv.proto generates."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from cache_service.blocks.keys import Namespace
from proto import tierkv_pb2 as pb

ROOT = Path(__file__).resolve().parents[3]
STUBS = ("tierkv_pb2.py", "tierkv_pb2_grpc.py", "tierkv_pb2.pyi")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    # regenerate with the documented command, from a copy of the proto tree
    out = tmp_path_factory.mktemp("stubs")
    (out / "proto").mkdir()
    shutil.copy(ROOT / "proto" / "tierkv.proto", out / "proto" / "tierkv.proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", "proto/tierkv.proto"], cwd=out, check=True, capture_output=True)
    return out / "proto"


@pytest.mark.parametrize("name", STUBS)
def test_committed_stubs_are_current(regenerated: Path, name: str) -> None:
    # a stale stub means someone edited the proto and forgot the command in its header
    fresh = _unstamped((regenerated / name).read_text())
    committed = _unstamped((ROOT / "proto" / name).read_text())
    assert committed == fresh, f"proto/{name} is stale: rerun the protoc command in proto/tierkv.proto"


def _unstamped(stub: str) -> str:
    """A stub without the generator's version stamps: a newer grpcio-tools
    from the registry writes the same code under another version number."""
    for stamp in (r"GRPC_GENERATED_VERSION = '[^']*'", r"# Protobuf Python Version: .*",
                  r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)"):
        stub = re.sub(stamp, "<version>", stub)
    return stub


def test_grpc_stub_imports_the_package_not_a_top_level_module() -> None:
    # `import tierkv_pb2` would only work with proto/ on sys.path
    text = (ROOT / "proto" / "tierkv_pb2_grpc.py").read_text()
    assert "from proto import tierkv_pb2" in text
    assert "\nimport tierkv_pb2" not in text


def test_namespace_message_mirrors_the_dataclass() -> None:
    # every field of the layout fingerprint crosses the wire under the same name
    assert [f.name for f in pb.Namespace.DESCRIPTOR.fields] == [f.name for f in fields(Namespace)]
