"""Every guide's code runs from its install line: each module a guide's Python blocks import must be
installed by the extras that guide's ``pip install -e '.[...]'`` line names (after
``scripts/install.sh``, which installs the ``llamacpp`` extra), or be in the standard library.

The extras come from ``pyproject.toml``; each extra's distributions are followed through their own
requirements (``importlib.metadata``) to the top-level modules they install. A guide that imports
something its install line does not give fails here, naming the module and the guide.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs" / "guides").glob("*.md")), ROOT / "docs" / "index.md"]
BASE_EXTRAS = frozenset({"llamacpp"})
"""What ``scripts/install.sh`` installs (``pip install -e ".[llamacpp]"``)."""
INSTALL_LINE = re.compile(r"pip install -e '\.\[([a-z0-9_,-]+)\]'")
IMPORT = re.compile(r"^\s*(?:from\s+([A-Za-z_][\w.]*)\s+import\s+(.+)|import\s+([A-Za-z_][\w.]*))", re.M)
OWN_SUBPACKAGES = {
    "specem_integrations.langchain": "langchain",
    "specem_integrations.llamaindex": "llamaindex",
    "specem_integrations.server": "server",
}
"""This package's modules that need an extra of the same purpose."""
NAMES_NEEDING = {"SentenceTransformerEmbeddings": "embeddings", "SentenceTransformerEmbedding": "embeddings"}
"""Names whose module imports lazily but which need an extra when used."""


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def _extras_named(text: str) -> set[str]:
    named: set[str] = set()
    for group in INSTALL_LINE.findall(text):
        named.update(e.strip() for e in group.split(",") if e.strip())
    return named


@cache
def _pyproject_extras() -> dict[str, list[str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(data["project"]["optional-dependencies"])


def _direct_requirements(extras: frozenset[str]) -> set[str]:
    """Distribution names the base dependencies and these extras ask for (``specem[...]``
    references followed)."""
    table = _pyproject_extras()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    out = {canonicalize_name(Requirement(r).name) for r in data["project"]["dependencies"]}
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for spec in table[extra]:
            req = Requirement(spec)
            if canonicalize_name(req.name) == "specem":
                todo.extend(req.extras)
            else:
                out.add(canonicalize_name(req.name))
    return out


@cache
def _closure(extras: frozenset[str]) -> frozenset[str]:
    """Every distribution installed with these extras: their requirements, followed through the
    installed distributions' own (unconditional) requirements."""
    env = default_environment()
    todo = list(_direct_requirements(extras))
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue  # an optional dependency of that distribution, or another platform's
            todo.append(canonicalize_name(req.name))
    return frozenset(seen)


@cache
def _modules_of() -> dict[str, set[str]]:
    """Top-level module -> the distributions that install it."""
    return {module: {canonicalize_name(d) for d in dists} for module, dists in md.packages_distributions().items()}


def _imports(code: str) -> list[tuple[str, list[str]]]:
    out = []
    for match in IMPORT.finditer(code):
        module = match.group(1) or match.group(3)
        names = [n.strip().split(" as ")[0].strip("() ") for n in (match.group(2) or "").split(",")]
        out.append((module, [n for n in names if n]))
    return out


def missing_for(text: str) -> list[str]:
    """What a page's Python blocks import that its install line does not give."""
    extras = frozenset(BASE_EXTRAS | _extras_named(text))
    unknown = extras - set(_pyproject_extras())
    problems = [f"install line names unknown extra {e!r}" for e in sorted(unknown)]
    extras -= unknown
    installed = _closure(extras)
    modules = _modules_of()
    for block in _python_blocks(text):
        for module, names in _imports(block):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names:
                continue
            if top in ("specem_core", "specem_integrations"):
                need = next((e for prefix, e in OWN_SUBPACKAGES.items() if module.startswith(prefix)), None)
                if need is not None and need not in extras:
                    problems.append(f"{module} needs the {need!r} extra")
                for name in names:
                    if name in NAMES_NEEDING and NAMES_NEEDING[name] not in extras:
                        problems.append(f"{name} needs the {NAMES_NEEDING[name]!r} extra")
                continue
            providers = modules.get(top)
            if providers is None:
                problems.append(f"{module}: no installed distribution provides {top!r}")
            elif not providers & installed:
                problems.append(f"{module}: {top!r} comes from {sorted(providers)}, not installed by {sorted(extras)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_each_guide_imports_only_what_its_install_line_gives(page: Path) -> None:
    assert missing_for(page.read_text()) == []


def test_a_guide_that_needs_more_than_its_install_line_fails() -> None:
    """The check is not vacuous: ``create_agent`` needs the ``agents`` extra, not ``langchain``."""
    page = (
        "```bash\n.venv/bin/pip install -e '.[langchain]'\n```\n\n"
        "```python\nfrom langchain.agents import create_agent\n```\n"
    )
    assert any("langchain.agents" in p for p in missing_for(page))
    fixed = page.replace("'.[langchain]'", "'.[langchain,agents]'")
    assert missing_for(fixed) == []
    rag = "```python\nfrom specem_integrations.langchain import ChatSpecEM, SentenceTransformerEmbeddings\n```\n"
    assert {
        "specem_integrations.langchain needs the 'langchain' extra",
        "SentenceTransformerEmbeddings needs the 'embeddings' extra",
    } <= set(missing_for(rag))
    openai_page = "pip install -e '.[server]'\n```python\nfrom openai import OpenAI\n```\n"
    assert missing_for(openai_page)
    assert missing_for(openai_page.replace("[server]", "[server,clients]")) == []


def test_every_guide_with_an_integration_names_its_install_line() -> None:
    for page in PAGES:
        text = page.read_text()
        code = "\n".join(_python_blocks(text))
        if "specem_integrations" in code:
            assert _extras_named(text), f"{page.name} imports an integration but has no install line"
