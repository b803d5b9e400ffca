"""The built site as a reader sees it: ``scripts/screenshot_docs.py`` builds it strictly, serves it
on loopback and reads the pages issue #65 named in headless Chromium at 1280×900. No code block
may run past the right edge of its box there (the content wraps or fits).

Skips without Debian's ``chromium`` or the ``playwright`` package, as the playground's browser
tests do.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]


def _tool() -> ModuleType:
    return load_script("scripts/screenshot_docs.py", "screenshot_docs")


def test_no_code_block_runs_past_its_box(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("playwright")
    pytest.importorskip("mkdocs")
    if not any(shutil.which(name) for name in ("chromium", "chromium-browser")):
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; .ci/run installs it)")
    tool = _tool()
    pages = list(tool.PAGES)
    assert tool.main(["--count-only", "--fail-on-overflow", *pages]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(pages)
    for page, line in zip(pages, lines, strict=True):
        assert line.startswith(f"{page}: 0 of "), line
        assert not line.endswith(" 0 code blocks overflow"), f"{page}: no code block found, the check is vacuous"
