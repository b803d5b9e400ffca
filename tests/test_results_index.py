"""``benchmarks/results/README.md`` indexes every result file, and every result path the docs and
scripts quote exists: a result added without a row, a row left behind by a move, or a reference a
move forgot fails here (the matching rule is at the top of that README)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
ARCHIVE = "archive/"

QUOTING = [
    ROOT / "README.md",
    INDEX,
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "docs").rglob("*.py")),
    *sorted((ROOT / "benchmarks").glob("*.py")),
    ROOT / "notebooks" / "build_notebooks.py",
]
"""The texts whose ``benchmarks/results/...`` paths must exist (this index among them)."""
NOT_COMMITTED = {
    "benchmarks/results/gpu_check.json": "gpu_check.py's default --out; the committed runs are renamed by GPU",
}
"""Paths a script writes by default that are never committed under that name (and why)."""
QUOTED = re.compile(r"benchmarks/results(?:/[A-Za-z0-9_.*<>{},+-]+)*/?")


def expand(pattern: str) -> list[str]:
    """The pattern with each ``{a,b}`` group expanded (groups are not nested)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [p for option in match.group(1).split(",") for p in expand(head + option + tail)]


def to_regex(pattern: str) -> re.Pattern[str]:
    """A pattern without braces as a regex: ``**/`` any folders, ``*`` any part of one name."""
    out = ""
    for part in re.split(r"(\*\*/|\*)", pattern):
        out += {"**/": "(?:[^/]+/)*", "*": "[^/]*"}.get(part, re.escape(part))
    return re.compile(out + r"\Z")


def rows() -> list[tuple[list[str], str, str]]:
    """Every index row: (the patterns of its first column, its whole line, its status cell)."""
    found = []
    for line in INDEX.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        patterns = re.findall(r"`([^`]+)`", cells[0]) if cells else []
        if patterns:  # a header or separator row has none
            found.append((patterns, line, cells[-1]))
    return found


def result_files() -> list[str]:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p != INDEX)


def test_the_matching_rule() -> None:
    assert expand("a/{b,c}/x.{json,txt}") == ["a/b/x.json", "a/b/x.txt", "a/c/x.json", "a/c/x.txt"]
    assert to_regex("quality/*/*.jsonl").match("quality/gsm8k/1.5b.jsonl")
    assert not to_regex("quality/*/*.jsonl").match("quality/gsm8k/earlier-build/1.5b.jsonl")
    assert to_regex("quality/v1/**/*").match("quality/v1/summary.md")
    assert to_regex("quality/v1/**/*").match("quality/v1/ifeval64/paper.jsonl")
    assert not to_regex("speed.json").match("speed_json")


def test_every_result_file_is_matched_by_exactly_one_row() -> None:
    index = [(p, [to_regex(x) for x in expand(p)], line) for patterns, line, _ in rows() for p in patterns]
    unmatched, twice = [], []
    for path in result_files():
        lines = {line for _, regexes, line in index if any(r.match(path) for r in regexes)}
        if not lines:
            unmatched.append(path)
        elif len(lines) > 1:
            twice.append(path)
    assert not unmatched, f"files no row of {INDEX.relative_to(ROOT)} matches (add a row): {unmatched}"
    assert not twice, f"files matched by more than one row (make the patterns exclusive): {twice}"


def test_every_pattern_matches_a_file() -> None:
    files = result_files()
    empty = [
        expanded
        for patterns, _, _ in rows()
        for pattern in patterns
        for expanded in expand(pattern)
        if not any(to_regex(expanded).match(f) for f in files)
    ]
    assert not empty, f"patterns in {INDEX.relative_to(ROOT)} that match no file (moved or removed?): {empty}"


def test_archived_rows_say_superseded_and_the_others_current() -> None:
    assert rows()
    for patterns, line, status in rows():
        archived = {p.startswith(ARCHIVE) for p in patterns}
        assert len(archived) == 1, f"a row mixes archived and current files: {line}"
        expected = "superseded" if archived == {True} else "current"
        assert status.startswith(expected), f"status should start with {expected!r}: {line}"


@pytest.mark.parametrize("text", QUOTING, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_quoted_result_path_exists(text: Path) -> None:
    missing = []
    for quoted in QUOTED.findall(text.read_text(encoding="utf-8")):
        path = quoted.rstrip(".,")
        if path in NOT_COMMITTED:
            continue
        # a template (<task>, <config>) or a glob stands for whatever files it matches
        pattern = re.sub(r"<[^>]*>", "*", path)
        for expanded in (e.rstrip("/") for e in expand(pattern)):
            if "*" not in expanded:
                found = (ROOT / expanded).exists()
            else:  # files or folders
                found = any(to_regex(expanded).match(p.relative_to(ROOT).as_posix()) for p in RESULTS.rglob("*"))
            if not found:
                missing.append(quoted)
    assert not missing, f"{text.relative_to(ROOT)} quotes result paths that do not exist: {missing}"


def test_archived_files_are_never_quoted_at_their_old_place() -> None:
    """A reference that names an archived file by its old path (``speed_run1_before_ballast.json``
    with no ``archive/`` before it) is a reference the move forgot."""
    archived = [p.relative_to(RESULTS / ARCHIVE).as_posix() for p in (RESULTS / ARCHIVE).rglob("*") if p.is_file()]
    assert archived
    stale = []
    for text in QUOTING:
        if text == INDEX:
            continue
        content = text.read_text(encoding="utf-8")
        for old in archived:
            for match in re.finditer(re.escape(old), content):
                if not content[: match.start()].endswith(ARCHIVE):
                    stale.append(f"{text.relative_to(ROOT)}: {old}")
    assert not stale, f"archived files quoted at their old place: {stale}"


def slug(heading: str) -> str:
    """A heading's anchor as MkDocs makes it (Python-Markdown's toc slugify; GitHub agrees here)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_the_index_links_resolve() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", INDEX.read_text(encoding="utf-8"))
    assert links
    broken = []
    for link in links:
        target, _, anchor = link.partition("#")
        path = (INDEX.parent / target).resolve()
        if not path.exists():
            broken.append(link)
        elif anchor:
            headings = re.findall(r"^#+\s+(.*?)\s*$", path.read_text(encoding="utf-8"), re.M)
            if anchor not in {slug(h) for h in headings}:
                broken.append(link)
    assert not broken, f"links in {INDEX.relative_to(ROOT)} to no file or no heading: {broken}"
