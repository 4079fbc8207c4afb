"""The documentation a newcomer reads: every relative link in README.md and docs/*.md resolves to a file
and, when it names a section, to a heading of that file; no page points outside the repository for
the design or speaks of issue or stop numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]*)(#[^)\s]+)?\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    in_code = False
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target, anchor in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor[1:] not in anchors(path):
            broken.append(f"{target}{anchor}")
    assert not broken, f"{page.name}: links that lead nowhere: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_issue_or_stop_numbers(page: Path) -> None:
    text = page.read_text()
    assert not re.findall(r"\b(?:issue|stop)[ -]\d+\b", text, re.I), page.name
    # the design is docs/architecture.md, not a file outside the repository
    assert not re.search(r"\]\(\.\./shared/|shared/ARCHITECTURE\.md", text), page.name


def test_slug_matches_github() -> None:
    assert slug(" engine_vs_peers.py: the engine against transformers and llama.cpp") == (
        "engine_vs_peerspy-the-engine-against-transformers-and-llamacpp"
    )
    assert slug("ops_hot_path.py: authenticate + admit + settle") == (
        "ops_hot_pathpy-authenticate--admit--settle"
    )
