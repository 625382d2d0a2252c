"""`make gpu-test`: every GPU check in one table (tests/gpu, then the mapped-pool bandwidth benchmark of each
GPU backend, cuda_ipc and cuda_vmm).

Exit 0 when all pass, 1 when any fails, 2 when there is no GPU to check on (one line saying why).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from tests.gpu.conftest import torch_cuda_unavailable

    reason = torch_cuda_unavailable()  # without cupy or cuda-python, their backends' checks skip
    if reason:
        print(f"gpu-test: nothing to check: {reason}")
        return 2
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "gpu.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu",
                        f"--junitxml={junit}"], cwd=ROOT)
        for case in ET.parse(junit).getroot().iter("testcase"):
            failed = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped")
            result = "FAIL" if failed else "SKIP" if skipped is not None else "PASS"
            detail = f"{float(case.get('time', 0)):.1f} s"
            if skipped is not None:
                detail = skipped.get("message", "")
            rows.append((case.get("name", "?"), result, detail))
    bench = subprocess.run([sys.executable, "-m", "bench.gpu_bandwidth", "--json"], cwd=ROOT, capture_output=True,
                           text=True)
    try:
        report = json.loads(bench.stdout.strip().splitlines()[-1])
        for r in report["rows"]:
            rows.append((f"bandwidth: {r['backend']} {r['access']} (mapped vs native)",
                         "PASS" if r["ratio"] >= report["target"] else "FAIL",
                         f"{r['mapped_gbps']:.0f} vs {r['native_gbps']:.0f} GB/s, ratio {r['ratio']:.3f} (target "
                         f"{report['target']}) on {report['gpu']}"))
        for backend, why in report["skipped"].items():
            rows.append((f"bandwidth: {backend}", "SKIP", why))
    except (IndexError, json.JSONDecodeError, KeyError):
        rows.append(("bandwidth benchmark", "FAIL", (bench.stderr.strip().splitlines() or ["no output"])[-1]))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'GPU check':<{width}}  result  detail")
    for name, result, detail in rows:
        print(f"{name:<{width}}  {result:<6}  {detail}")
    failed = sum(r[1] == "FAIL" for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} passed" if not failed else f"{failed} of {len(rows)} FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
