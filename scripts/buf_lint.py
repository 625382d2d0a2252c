"""Lint the proto with buf (STANDARD rules, buf.yaml) on an image that protoc builds, so buf needs no registry.

    python scripts/buf_lint.py BUF_BINARY
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_protos import PROTO_DIR, ROOT, descriptor_set


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    buf = sys.argv[1]
    protos = [str(p.relative_to(ROOT)) for p in sorted(PROTO_DIR.glob("*.proto"))]
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "kvcache.binpb"
        descriptor_set(image)
        paths = [arg for p in protos for arg in ("--path", p)]
        proc = subprocess.run([buf, "lint", str(image), "--config", str(ROOT / "buf.yaml"), *paths],
                              capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout + proc.stderr, end="")
        print(f"[lint] buf lint: {len(proc.stdout.splitlines())} finding(s) in {', '.join(protos)}")
        return 1
    print(f"[lint] buf lint: clean ({', '.join(protos)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
