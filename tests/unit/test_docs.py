"""The documentation stays findable and its links true: docs/README.md indexes every page, and
every relative link in the Markdown files resolves to a file of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# [text](target) with a relative target (no scheme, not an anchor of the same page).
LINK = re.compile(r"\[[^\]]*\]\((?![a-z]+://|#|mailto:)([^)\s]+)\)")


def markdown_files() -> list[Path]:
    skipped = ("node_modules", "build", "dist")
    return sorted(
        p
        for p in ROOT.rglob("*.md")
        if not any(part.startswith(".") or part in skipped for part in p.relative_to(ROOT).parts)
    )


def test_the_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text("utf-8")
    linked = {Path(target).name for target in LINK.findall(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages - linked == set(), "docs/README.md does not list these pages"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for target in LINK.findall(path.read_text("utf-8")):
        file = target.split("#", 1)[0]
        if file and not (path.parent / file).exists():
            broken.append(target)
    assert broken == [], f"{path.relative_to(ROOT)} links to missing files"
