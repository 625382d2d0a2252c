"""Generate (or check) the committed Python code for protos/kvcache/v1/*.proto.

    python scripts/gen_protos.py          # write *_pb2.py, *_pb2.pyi, *_pb2_grpc.py beside the protos
    python scripts/gen_protos.py --check  # exit 1 naming the stale files if regeneration would differ
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
PROTO_DIR = ROOT / "protos" / "kvcache" / "v1"


def generate(out_root: Path) -> list[Path]:
    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *[str(p.relative_to(ROOT)) for p in protos]]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see above)")
    return sorted((out_root / "protos" / "kvcache" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        rel = [g.relative_to(tmp) for g in generated]
        if args.check:
            stale = [str(r) for r in rel if not (ROOT / r).exists() or not filecmp.cmp(Path(tmp) / r, ROOT / r,
                                                                                        shallow=False)]
            extra = [str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*_pb2*.py*")
                     if p.relative_to(ROOT) not in rel]
            if stale or extra:
                print(f"proto-check: stale generated code: {', '.join(stale + extra)}; run 'make proto'")
                return 1
            print(f"proto-check: {len(rel)} generated files are up to date")
            return 0
        for r in rel:
            shutil.copyfile(Path(tmp) / r, ROOT / r)
        print(f"proto: wrote {', '.join(str(r) for r in rel)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
