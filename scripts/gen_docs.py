"""Regenerate (or check) the generated sections of docs/reference.md: flags, metrics and error reasons.

    python scripts/gen_docs.py          # rewrite docs/reference.md between the <!-- name:start/end --> markers
    python scripts/gen_docs.py --check  # exit 1 naming the stale sections
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"
sys.path.insert(0, str(ROOT))

from cache_service.config import FLAGS  # noqa: E402
from cache_service.core import CoreConfig, KVCacheCore  # noqa: E402
from cache_service.core.reasons import Reason  # noqa: E402
from cache_service.events.hub import EventHub  # noqa: E402
from cache_service.metrics import Metrics  # noqa: E402
from cache_service.tier.stats import TierStats  # noqa: E402


class _DocTier:
    """A tier for the table: one error sample, so the labels show; stored bytes, so the disk gauge does."""

    def stats(self) -> TierStats:
        return TierStats(backend="disk", up=True, errors={("put", "full"): 1}, stored_bytes=0)


def flags_table() -> str:
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for f in FLAGS:
        default = f.default if not isinstance(f.default, bool) else str(f.default).lower()
        if default is None:
            default = "off"
        if f.name in ("pool-bytes", "max-message-bytes") and isinstance(default, int) and default:
            default = f"{default // 2**20}Mi"
        choices = f" ({', '.join(f.choices)})" if f.choices else ""
        shown = f"`{default}`" if default != "" else '`""`'
        rows.append(f"| `--{f.name}` | `{f.env}` | {shown} | {f.help}{choices} |")
    return "\n".join(rows)


def metrics_table() -> str:
    core = KVCacheCore(CoreConfig(num_pages=4, page_size=1, window_pages=4, window_tokens=2))  # window metrics too
    metrics = Metrics(core.stats, {"instance_id": "x", "backend": "host_shm", "version": "v"})
    metrics.observe_rpc("GetStats", "OK", 0.001)
    metrics.add_events(EventHub(core, instance_id="x", medium="CPU", buffer=1))
    metrics.add_tier(_DocTier())
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for family in metrics.registry.collect():
        labels = sorted({k for s in family.samples for k in s.labels if k not in ("le",)})
        name = family.name + ("_total" if family.type == "counter" else "")
        rows.append(f"| `{name}` | {family.type} | {', '.join(labels) or '-'} | {family.documentation} |")
    return "\n".join(rows)


def errors_table() -> str:
    """From the proto's ErrorReason (through the generated core enum, which proto-check keeps fresh)."""
    rows = ["| code | reason | meaning |", "|---|---|---|"]
    for reason in Reason:
        rows.append(f"| `{reason.code.value}` | `{reason.value}` | {reason.doc} |")
    return "\n".join(rows)


SECTIONS = {"flags": flags_table, "metrics": metrics_table, "errors": errors_table}


def render(text: str) -> str:
    for name, make in SECTIONS.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n)(?:.*?\n)?(<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"docs/reference.md has no <!-- {name}:start --> ... <!-- {name}:end --> section")
        text = pattern.sub(lambda m, make=make: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    current = REFERENCE.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("docs-check: docs/reference.md's generated sections are stale; run 'make docs'")
            return 1
        print(f"docs-check: docs/reference.md sections {', '.join(SECTIONS)} are up to date")
        return 0
    REFERENCE.write_text(fresh)
    print(f"docs: rewrote docs/reference.md sections {', '.join(SECTIONS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
