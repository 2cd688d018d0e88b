"""BENCHMARKS.md stays a summary: at most 250 lines, its goal table within the first 40, and every
citation of it from README.md and docs/*.md (`BENCHMARKS.md#anchor`, or `BENCHMARKS.md ("Section")`)
names a heading it has; its own links into itself and into docs/benchmarks-log.md resolve too."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
MAX_LINES = 250
SUMMARY_WITHIN = 40
# `BENCHMARKS.md` ("A", "B") or BENCHMARKS.md, "A": the quoted names that follow it.
QUOTED_CITATION = re.compile(r'BENCHMARKS\.md`?(?: \(|, )((?:"[^"]+"(?:,\s*)?)+)')
ANCHOR_CITATION = re.compile(r"BENCHMARKS\.md#([\w-]+)")
LOG_LINK = re.compile(r"\]\((docs/benchmarks-log\.md)?#([\w-]+)\)")


def headings(path: Path) -> list[str]:
    return [match.group(1).strip() for match in re.finditer(r"^#{1,6}\s+(.+)$", path.read_text(), re.MULTILINE)]


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(path):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def citing_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_benchmarks_is_short_and_opens_with_the_summary_table():
    lines = BENCHMARKS.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"BENCHMARKS.md has {len(lines)} lines; history goes to docs/benchmarks-log.md"
    start = lines.index("## Summary")
    table = [number for number, line in enumerate(lines) if number > start and line.startswith("|")]
    assert table and table[0] < SUMMARY_WITHIN
    last_row = next(number for number in range(table[0], len(lines)) if not lines[number].startswith("|")) - 1
    assert last_row < SUMMARY_WITHIN, f"the summary table runs to line {last_row + 1}"


def test_every_citation_of_benchmarks_names_a_section_it_has():
    names, slugs = set(headings(BENCHMARKS)), anchors(BENCHMARKS)
    missing = []
    for page in citing_pages():
        text = " ".join(page.read_text().split())  # a citation may wrap over lines
        for quoted in QUOTED_CITATION.findall(text):
            missing += [(page.name, name) for name in re.findall(r'"([^"]+)"', quoted) if name not in names]
        missing += [(page.name, f"#{anchor}") for anchor in ANCHOR_CITATION.findall(text) if anchor not in slugs]
    assert missing == []


def test_benchmarks_links_into_itself_and_the_log_resolve():
    own, log = anchors(BENCHMARKS), anchors(ROOT / "docs" / "benchmarks-log.md")
    broken = [(target or "BENCHMARKS.md", anchor) for target, anchor in LOG_LINK.findall(BENCHMARKS.read_text())
              if anchor not in (log if target else own)]
    assert broken == []
