"""The built site as a reader sees it: the site is built strictly (``scripts/screenshot_docs.py``'s
``build_site``), served on loopback and every page of it (each ``index.html`` of the build) read in
one headless Chromium at 1280×900 (issues #65 and #72). On every page:

- a code block keeps its lines as written: ``pre > code`` renders ``white-space: pre`` and no more
  lines than its source has (a wrapped line breaks inside a token, ``--enable-prompt-tokens-details
  -`` / ``-enable-scale-out``, and scrambles ASCII diagrams); a line wider than its box scrolls;
- nothing runs past the right edge of the page's content column or of the viewport, except inside
  a box that scrolls (code, wide tables);
- no table hides columns: a table wider than its box sits in a box that scrolls sideways
  (``overflow-x: auto``), not one that clips.

Skips without Debian's ``chromium`` or the ``playwright`` package, as the playground's browser
tests do.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 1280, 900

_LAYOUT_JS = """() => {
    const out = {code: 0, wrapped: [], notPre: [], tables: 0, hiddenColumns: [], overflow: [],
                 pageOverflow: 0};
    const vw = document.documentElement.clientWidth;
    const main = document.querySelector('.md-content') || document.querySelector('article');
    const bound = Math.min(vw, main.getBoundingClientRect().right) + 1;
    const where = el => {
        const section = el.closest('article') ? [...el.closest('article').querySelectorAll('h1, h2, h3, h4')]
            .filter(h => h.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING).pop() : null;
        return (section ? '#' + (section.id || section.textContent.trim().slice(0, 40)) + ' ' : '')
            + el.tagName.toLowerCase() + ': ' + el.textContent.trim().replace(/\\s+/g, ' ').slice(0, 60);
    };
    const scrolls = el => ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
    const clips = el => getComputedStyle(el).overflowX !== 'visible';
    const shown = el => el.getClientRects().length > 0;

    for (const code of document.querySelectorAll('article pre > code')) {
        if (!shown(code)) continue;  // inside a closed <details>
        out.code += 1;
        const ws = getComputedStyle(code).whiteSpace;
        if (ws !== 'pre') out.notPre.push(where(code) + ' (white-space: ' + ws + ')');
        const source = code.textContent.replace(/\\n$/, '').split('\\n').length;
        const range = document.createRange();
        range.selectNodeContents(code);
        const tops = [...range.getClientRects()].filter(r => r.width > 0 && r.height > 0)
            .map(r => r.top).sort((a, b) => a - b);
        let lines = tops.length ? 1 : 0;
        for (let i = 1; i < tops.length; i++) if (tops[i] - tops[i - 1] > 4) lines += 1;
        if (lines > source) out.wrapped.push(where(code) + ' (' + lines + ' lines for ' + source + ')');
    }

    for (const table of document.querySelectorAll('article table')) {
        if (!shown(table)) continue;
        out.tables += 1;
        // every cell must lie inside the visible part of each box around it that clips or scrolls
        // (Material's .md-typeset__scrollwrap): a column past it is hidden, behind a scrollbar at best
        const right = Math.max(...[...table.querySelectorAll('th, td')].map(c => c.getBoundingClientRect().right));
        for (let box = table.parentElement; box && box.tagName !== 'ARTICLE'; box = box.parentElement) {
            if (!clips(box)) continue;
            const visible = box.getBoundingClientRect().left + box.clientLeft + box.clientWidth;
            if (right > visible + 1) {
                out.hiddenColumns.push(where(table) + ' (' + Math.round(right - visible) + ' px of columns hidden by .'
                    + box.className + (scrolls(box) ? ', which scrolls' : ', which clips') + ')');
                break;
            }
        }
    }

    for (const el of document.querySelectorAll('article *')) {
        let inside = false;
        for (let a = el.parentElement; a && a.tagName !== 'ARTICLE'; a = a.parentElement) {
            if (clips(a)) { inside = true; break; }
        }
        if (inside || !shown(el)) continue;
        const r = el.getBoundingClientRect();
        if (r.width === 0 || r.height === 0) continue;
        if (r.right > bound || r.left < -1) {
            out.overflow.push(where(el) + ' (right edge ' + Math.round(r.right) + ' px, bound '
                + Math.round(bound) + ')');
        }
    }
    out.pageOverflow = document.documentElement.scrollWidth - vw;
    return out;
}"""
"""What a page shows a reader: code blocks checked, those that wrap (more rendered lines than source
lines; rendered lines are the distinct tops of the text's line boxes) or do not render
``white-space: pre``; tables checked, those whose box clips them; elements outside any scrolling box
that run past the content column or the viewport; how far the page itself scrolls sideways."""


def _tool() -> ModuleType:
    return load_script("scripts/screenshot_docs.py", "screenshot_docs")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, Path]:
    pytest.importorskip("playwright")
    pytest.importorskip("mkdocs")
    if not any(shutil.which(name) for name in ("chromium", "chromium-browser")):
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; .ci/run installs it)")
    tool = _tool()
    built = tmp_path_factory.mktemp("docs") / "site"
    tool.build_site(built)
    return tool, built


def pages_of(built: Path) -> list[str]:
    """Every page of a built site, as its path under the site (``""`` for the home page): each
    ``index.html`` of the build."""
    return sorted(p.parent.relative_to(built).as_posix().removeprefix(".") + "/" for p in built.rglob("index.html"))


def read_layout(tool: ModuleType, built: Path, pages: list[str]) -> dict[str, dict[str, Any]]:
    """:data:`_LAYOUT_JS`'s findings for each page, all read in one browser."""
    from playwright.sync_api import sync_playwright

    found: dict[str, dict[str, Any]] = {}
    with tool.serve(built) as base, sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=tool.chromium_path(), args=[*tool.CHROMIUM_ARGS, "--disable-quic", "--no-first-run"]
        )
        try:
            context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
            page = context.new_page()
            for path in pages:
                response = page.goto(base + path.lstrip("/"), wait_until="load")
                assert response is not None, path
                assert response.status == 200, f"{path}: HTTP {response.status}"
                found[path] = page.evaluate(_LAYOUT_JS)
        finally:
            browser.close()
    return found


def test_every_page_keeps_code_lines_whole_and_shows_every_column(site: tuple[ModuleType, Path]) -> None:
    tool, built = site
    pages = pages_of(built)
    nav = len(list((ROOT / "docs").rglob("*.md"))) - len(list((ROOT / "docs").glob("**/README.md")))
    assert len(pages) >= nav, f"{len(pages)} pages built for {nav} Markdown files"
    found = read_layout(tool, built, pages)
    problems = []
    for path, f in found.items():
        for kind in ("wrapped", "notPre", "hiddenColumns", "overflow"):
            problems += [f"{path or '/'}: {kind}: {item}" for item in f[kind]]
        if f["pageOverflow"] > 1:
            problems.append(f"{path or '/'}: the page scrolls sideways by {f['pageOverflow']} px")
    assert not problems, f"{len(problems)} layout problems:\n" + "\n".join(problems[:60])
    # not vacuous: the pages hold code blocks and tables, the members guide its diagram among them
    assert sum(f["code"] for f in found.values()) > 100
    assert sum(f["tables"] for f in found.values()) > 50
    assert found["guides/members-and-backends/"]["code"] > 0
