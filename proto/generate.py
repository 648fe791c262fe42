"""Regenerate the controller API's Python stubs (controller_pb2.py, controller_pb2_grpc.py, .pyi).

Run `python proto/generate.py` (needs grpcio-tools 1.81.1, the `dev` extra). The .proto is
copied into a temporary tree `luwu/proto/controller.proto` so that protoc writes
package-qualified imports (`from luwu.proto import controller_pb2`), then the outputs are
copied next to this file. `generate(out_dir)` is what the freshness test calls.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = PROTO_DIR / "controller.proto"
OUTPUTS = ("controller_pb2.py", "controller_pb2.pyi", "controller_pb2_grpc.py")
GRPC_TOOLS_VERSION = "1.81.1"


def generate(out_dir: Path) -> list[Path]:
    """Write the generated stubs into `out_dir`; return their paths."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="luwu-proto-") as tmp:
        src = Path(tmp) / "src"
        gen = Path(tmp) / "gen"
        (src / "luwu" / "proto").mkdir(parents=True)
        gen.mkdir()
        shutil.copy(PROTO_FILE, src / "luwu" / "proto" / "controller.proto")
        include = Path(protoc.__file__).resolve().parent / "_proto"
        argv = ["grpc_tools.protoc", f"-I{src}", f"-I{include}", f"--python_out={gen}", f"--pyi_out={gen}",
                f"--grpc_python_out={gen}", "luwu/proto/controller.proto"]
        if protoc.main(argv) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_FILE}: see the messages above")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in OUTPUTS:
            target = out_dir / name
            shutil.copy(gen / "luwu" / "proto" / name, target)
            written.append(target)
    return written


def main() -> int:
    try:
        from importlib.metadata import version

        import grpc_tools
    except ImportError:
        print("grpcio-tools is missing: pip install 'grpcio-tools==1.81.1' (the `dev` extra)", file=sys.stderr)
        return 1
    found = version("grpcio-tools")
    if found != GRPC_TOOLS_VERSION:
        print(f"warning: grpcio-tools {found} differs from the pinned {GRPC_TOOLS_VERSION}; the committed stubs "
              "may change", file=sys.stderr)
    del grpc_tools
    for path in generate(PROTO_DIR):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
