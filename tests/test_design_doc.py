"""docs/design.md is the project's whole design: its sections are numbered without gaps, and every place that
cites it (code, tests, docs) names a section that exists. Nothing cites a design document the repository
does not hold."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "design.md"
CITED = re.compile(r"design\.md\s+§(\d+)(?:\s*-\s*(\d+))?")
TEXT = (".py", ".sh", ".md", ".yaml", ".tpl", ".txt", ".toml", ".proto")


def sections() -> list[int]:
    return [int(m) for m in re.findall(r"^## (\d+)\. ", DOC.read_text(), flags=re.M)]


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / n for n in names if n.endswith(TEXT) or n.endswith("Makefile")]


def test_the_design_sections_are_numbered_without_gaps() -> None:
    numbers = sections()
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    assert len(numbers) >= 15


def test_every_citation_names_a_section_that_exists() -> None:
    exists = set(sections())
    missing = []
    for path in tracked_text_files():
        for m in CITED.finditer(path.read_text(errors="replace")):
            first = int(m.group(1))
            last = int(m.group(2) or first)
            missing += [f"{path.relative_to(REPO)}: §{n}" for n in range(first, last + 1) if n not in exists]
    assert not missing, missing


def test_nothing_cites_a_design_document_the_repository_does_not_hold() -> None:
    stray = [str(p.relative_to(REPO)) for p in tracked_text_files()
             if p != DOC and re.search(r"\bDES" r"IGN\b", p.read_text(errors="replace"))]
    assert not stray, f"cite docs/design.md §N instead: {stray}"
