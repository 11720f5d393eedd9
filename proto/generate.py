"""Regenerate the Python modules for proto/ovt.proto: `python -m proto.generate`.

`--check` regenerates into a temporary folder and exits 1 if the checked-in modules differ.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
OUTPUTS = ("ovt_pb2.py", "ovt_pb2.pyi", "ovt_pb2_grpc.py")


def generate(out_root: Path) -> None:
    (out_root / "proto").mkdir(parents=True, exist_ok=True)
    code = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_root}",
                        f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
                        str(ROOT / "proto" / "ovt.proto")])
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def stale_outputs() -> list[str]:
    """The checked-in generated modules that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [name for name in OUTPUTS if not (ROOT / "proto" / name).exists()
                or not filecmp.cmp(Path(tmp) / "proto" / name, ROOT / "proto" / name,
                                   shallow=False)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale modules")
    args = parser.parse_args()
    if args.check:
        stale = stale_outputs()
        for name in stale:
            print(f"stale: proto/{name} (run python -m proto.generate)")
        return 1 if stale else 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        for name in OUTPUTS:
            shutil.copyfile(Path(tmp) / "proto" / name, ROOT / "proto" / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
