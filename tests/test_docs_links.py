"""Every relative link in README.md and docs/*.md points at a file that exists, and a link
to a heading (`page.md#heading`) at a heading that exists (GitHub's anchor rules)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from controlplane.local import repo_root

ROOT = repo_root()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

NOT_YET_PRESENT: set[str] = set()
"""Pages written on other branches, linked from README's "Where to go next" before they land.
Remove each one when its page is merged; the test then checks the link as usual."""

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _without_code(text: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercase, punctuation dropped, spaces to
    hyphens, a repeated one suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(_without_code(page.read_text()))
        if not re.match(r"[a-z]+:", target)  # http:, https:, mailto:
    ]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path_part, _, anchor = target.partition("#")
        file = (page.parent / path_part).resolve() if path_part else page
        relative = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
        if relative in NOT_YET_PRESENT:
            continue
        if not file.exists():
            broken.append(f"{target}: no file {relative}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {relative}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_pages_not_yet_present_are_still_missing() -> None:
    """Once a page lands, its exception must go (so its links are checked)."""
    landed = sorted(page for page in NOT_YET_PRESENT if (ROOT / page).exists())
    assert not landed, f"remove from NOT_YET_PRESENT in this file: {landed}"


def test_anchors_follow_github_s_rules(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Trust: who may write\n## No fleet at hand: `make demo`\n## A\n## A\n")
    assert anchors(page) == {"trust-who-may-write", "no-fleet-at-hand-make-demo", "a", "a-1"}
