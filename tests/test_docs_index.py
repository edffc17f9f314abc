"""docs/README.md stays the index of the docs: it links every doc in docs/, each link leads to a file, and each section
it sends a reader to ("Running the server") is a heading of that doc (a heading may go on past the name given)."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
INDEX = DOCS / "README.md"
LINK = re.compile(r"\[[^\]]+\]\(([^)#]+)\)")
SECTIONS = re.compile(r"\[([\w-]+\.md)\]\([\w-]+\.md\)((?:(?:,| and)? \"[^\"]+\")+)")


def _headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")]


def test_the_index_links_every_doc_and_every_link_leads_to_a_file():
    text = INDEX.read_text()
    targets = LINK.findall(text)
    assert all((DOCS / target).resolve().is_file() for target in targets), [t for t in targets if not (DOCS / t).exists()]
    unlinked = sorted(doc.name for doc in DOCS.glob("*.md") if doc != INDEX and doc.name not in targets)
    assert not unlinked, f"docs/README.md does not send any reader to {unlinked}: add each under its readers"


def test_each_section_the_index_names_is_a_heading_of_its_doc():
    text = " ".join(INDEX.read_text().split())  # a name may be wrapped over two lines
    named = [(doc, name) for doc, names in SECTIONS.findall(text) for name in re.findall(r"\"([^\"]+)\"", names)]
    assert len(named) > 10, f"only {len(named)} sections named: has the index's form changed?"
    missing = [f"{doc}: {name!r}" for doc, name in named if not any(h.startswith(name) for h in _headings(DOCS / doc))]
    assert not missing, f"docs/README.md names sections its docs no longer have: {missing}"
