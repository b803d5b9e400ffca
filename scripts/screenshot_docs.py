"""Screenshots of this site as a reader sees it, and a count of code blocks cut off at the right.

Builds the site strictly (``mkdocs build --strict``) into a temporary folder, serves it on
loopback, opens each page in headless Chromium (Debian's ``chromium``, driven by Playwright; no
browser is downloaded) at 1280×900 and saves a PNG of the first screen or, with ``--full-page``,
of the whole page. For every page it also counts the code blocks whose content is wider than
their box (``pre > code`` with ``scrollWidth > clientWidth``: the reader has to scroll sideways
to see the end of a line) and prints ``PAGE: N of M code blocks overflow``. With ``--reference``
it reads the API reference pages instead and prints ``PAGE: N of M entries without text`` (a
class, function or attribute rendered with a heading and a signature only).

Usage::

    python scripts/screenshot_docs.py --out /tmp/shots                      # the pages below
    python scripts/screenshot_docs.py --out /tmp/shots --full-page home quality
    python scripts/screenshot_docs.py --count-only                           # no PNGs
    python scripts/screenshot_docs.py --out docs/assets/screenshots --height 1600 home langchain
    python scripts/screenshot_docs.py --reference [--list-empty]            # API entries without text

A page is one of the names in :data:`PAGES` or a path of the site (``guides/cli/``). Exits 1
when any page has an overflowing code block and ``--fail-on-overflow`` is given.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

PAGES = {
    "home": "",
    "langchain": "guides/langchain/",
    "serving": "guides/serving/",
    "members": "guides/members-and-backends/",
    "quality": "reports/quality/",
    "api": "reference/engine/",
}
"""Short names for the pages the layout check reads (the ones issue #65 names, and the engine's
API reference page that the home page shows)."""

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

_OVERFLOW_JS = """() => {
    const blocks = Array.from(document.querySelectorAll('article pre > code'));
    return {
        total: blocks.length,
        over: blocks.filter(el => el.scrollWidth > el.clientWidth + 1).length,
    };
}"""
"""Code blocks in the page's article, and those whose content is wider than the block (one pixel
of slack for subpixel rounding)."""

_EMPTY_ENTRIES_JS = """() => {
    const entries = Array.from(document.querySelectorAll('article .doc.doc-object'));
    const empty = [];
    for (const entry of entries) {
        const contents = Array.from(entry.children).find(c => c.classList.contains('doc-contents'));
        let text = '';
        if (contents) {
            const own = contents.cloneNode(true);
            own.querySelectorAll('.doc-children, .doc-class-bases').forEach(n => n.remove());
            text = own.textContent.trim();
        }
        if (!text) {
            const heading = Array.from(entry.children).find(c => c.classList.contains('doc-heading'));
            empty.push(heading ? heading.id : '?');
        }
    }
    return {total: entries.length, empty: empty};
}"""
"""API reference entries (``.doc-object``: a class, function, attribute…) and the ids of those
with no text of their own: nothing but a heading and a signature (their members' text and a
class's "Bases:" line do not count)."""


def build_site(site_dir: Path) -> None:
    """``mkdocs build --strict`` of this repository into ``site_dir``."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site_dir)],
        cwd=ROOT,
        env=env,
        check=True,
    )


@contextmanager
def serve(site_dir: Path) -> Iterator[str]:
    """The built site served on loopback (an ephemeral port); yields its base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            if not isinstance(sys.exc_info()[1], ConnectionError):  # a page closed mid-transfer
                super().handle_error(request, client_address)

    handler = functools.partial(Quiet, directory=str(site_dir))
    server = Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def chromium_path() -> str:
    """The system Chromium (``SPECEM_CHROMIUM`` or ``chromium`` on the PATH)."""
    for name in (os.environ.get("SPECEM_CHROMIUM", ""), "chromium", "chromium-browser"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise SystemExit("no Chromium on this machine (Debian: apt-get install chromium)")


def file_name(page: str) -> str:
    """The PNG's name for a page: its short name, or its path with ``/`` as ``-``."""
    return (page if page in PAGES else page.strip("/").replace("/", "-") or "home") + ".png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", help=f"names ({', '.join(PAGES)}) or site paths; default: all names")
    parser.add_argument("--out", type=Path, help="folder for the PNGs (default: none written)")
    parser.add_argument("--count-only", action="store_true", help="count overflowing code blocks, save no PNG")
    parser.add_argument("--full-page", action="store_true", help="the whole page, not the first screen")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--site", type=Path, help="an already built site (skips the build)")
    parser.add_argument("--fail-on-overflow", action="store_true", help="exit 1 if any code block overflows")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="instead: count the API reference entries without text on every reference page",
    )
    parser.add_argument("--list-empty", action="store_true", help="with --reference: name each entry without text")
    args = parser.parse_args(argv)
    if not (args.count_only or args.reference) and args.out is None:
        parser.error("give --out DIR, --count-only or --reference")

    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="specem-site-") as tmp:
        site = args.site
        if site is None:
            site = Path(tmp) / "site"
            build_site(site)
        if args.reference:
            pages = args.pages or sorted(
                f"{d.relative_to(site).as_posix()}/" for d in (site / "reference").iterdir() if d.is_dir()
            )
        else:
            pages = args.pages or list(PAGES)
        if args.out is not None and not args.reference:
            args.out.mkdir(parents=True, exist_ok=True)
        any_over = False
        with serve(site) as base, sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            try:
                for page_name in pages:
                    url = base + PAGES.get(page_name, page_name.lstrip("/"))
                    page = browser.new_page(viewport={"width": args.width, "height": args.height})
                    try:
                        response = page.goto(url, wait_until="load")
                        if response is None or response.status != 200:
                            raise SystemExit(f"{url}: HTTP {response.status if response else 'no response'}")
                        if args.reference:
                            found = page.evaluate(_EMPTY_ENTRIES_JS)
                            print(f"{page_name}: {len(found['empty'])} of {found['total']} entries without text")
                            if args.list_empty:
                                for entry in found["empty"]:
                                    print(f"    {entry}")
                            continue
                        counts = page.evaluate(_OVERFLOW_JS)
                        any_over = any_over or counts["over"] > 0
                        line = f"{page_name}: {counts['over']} of {counts['total']} code blocks overflow"
                        if not args.count_only:
                            target = args.out / file_name(page_name)
                            page.screenshot(path=str(target), full_page=args.full_page)
                            line += f" ({target})"
                        print(line, flush=True)
                    finally:
                        page.close()
            finally:
                browser.close()
    return 1 if args.fail_on_overflow and any_over else 0


if __name__ == "__main__":
    sys.exit(main())
