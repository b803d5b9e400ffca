"""The maps the code and the docs draw of the code stay true.

* **Module maps.** A package whose ``__init__`` docstring names two or more of its own modules
  (``:mod:`` roles, absolute or relative: ``:mod:`~specem_core.tools.plan```, ``:mod:`.session```,
  or ````name.py```` literals) is taken to list its modules, and must list every one: each ``.py``
  file of the package (private ones too, ``__init__`` aside) and each subpackage. Every ``:mod:``
  role in a package docstring must name a module that exists.
* **Protocols.** ``docs/development.md``'s "Protocols" list names every ``typing.Protocol`` class
  of ``specem_core`` (found by reading the source, not by importing it), each with the module it
  lives in, and nothing else.

Both checks are pure source reading: no package is imported.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specem_core", "specem_integrations")
DEVELOPMENT = ROOT / "docs" / "development.md"

_MOD_ROLE = re.compile(r":mod:`(?:[^`<]*<)?~?([\w.]+)>?`")
_FILE_LITERAL = re.compile(r"``(\w+)\.py``")

KNOWN_GAPS: dict[str, str] = {}
"""Maps known to be incomplete, by package (each case an expected failure, strict): none."""


def packages() -> list[Path]:
    """Every package directory (an ``__init__.py``) under the top-level packages."""
    return sorted(p.parent for top in PACKAGES for p in (ROOT / top).rglob("__init__.py"))


def dotted(package_dir: Path) -> str:
    return ".".join(package_dir.relative_to(ROOT).parts)


def parse(path: Path) -> ast.Module:
    """``path``'s syntax tree (warnings about its literals are the compiler's business, not ours)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(path.read_text(encoding="utf-8"))


def module_docstring(path: Path) -> str:
    return ast.get_docstring(parse(path)) or ""


def children(package_dir: Path) -> set[str]:
    """The package's modules: its ``.py`` files (not ``__init__`` / ``__main__``) and subpackages."""
    files = {p.stem for p in package_dir.glob("*.py") if p.stem not in ("__init__", "__main__")}
    subpackages = {p.name for p in package_dir.iterdir() if (p / "__init__.py").is_file()}
    return files | subpackages


def module_refs(docstring: str, package: str) -> set[str]:
    """The dotted names of the modules the docstring's ``:mod:`` roles name (relative ones resolved
    against ``package``)."""
    refs: set[str] = set()
    for target in _MOD_ROLE.findall(docstring):
        if target.startswith("."):
            dots = len(target) - len(target.lstrip("."))
            base = package.split(".")
            base = base[: len(base) - dots + 1] if dots > 1 else base
            target = ".".join([*base, target.lstrip(".")])
        refs.add(target)
    return refs


def named_children(docstring: str, package: str, package_dir: Path) -> set[str]:
    """The package's own modules that the docstring names (``:mod:`` roles, ````name.py````)."""
    prefix = package + "."
    named = {ref[len(prefix) :].split(".")[0] for ref in module_refs(docstring, package) if ref.startswith(prefix)}
    named |= set(_FILE_LITERAL.findall(docstring)) & children(package_dir)
    return named


def map_problems(docstring: str, package: str, package_dir: Path) -> list[str]:
    """What is wrong with the package docstring's module map (``[]``: nothing, or no map)."""
    problems = [
        f"names {ref}, which does not exist"
        for ref in sorted(module_refs(docstring, package))
        if ref.split(".")[0] in PACKAGES and not exists(ref)
    ]
    named = named_children(docstring, package, package_dir)
    if len(named) >= 2:  # a map: it must be whole
        problems += [f"omits {package}.{name}" for name in sorted(children(package_dir) - named)]
    return problems


def exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _package_params() -> Iterator[object]:
    for package_dir in packages():
        name = dotted(package_dir)
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[name])] if name in KNOWN_GAPS else []
        yield pytest.param(package_dir, id=name, marks=marks)


@pytest.mark.parametrize("package_dir", list(_package_params()))
def test_package_docstring_maps_every_module(package_dir: Path) -> None:
    package = dotted(package_dir)
    problems = map_problems(module_docstring(package_dir / "__init__.py"), package, package_dir)
    assert not problems, f"{package}/__init__.py docstring: " + "; ".join(problems)


def test_the_map_rule_is_not_vacuous(tmp_path: Path) -> None:
    """A map that omits a module, or names one that is gone, is caught; a single mention is no map."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for name in ("__init__", "alpha", "beta", "_gamma"):
        (pkg / f"{name}.py").write_text("")
    whole = "* :mod:`~pkg.alpha` — a.\n* :mod:`.beta` — b.\n* ``_gamma.py`` — c.\n"
    assert map_problems(whole, "pkg", pkg) == []
    assert map_problems(whole.replace("* :mod:`.beta` — b.\n", ""), "pkg", pkg) == ["omits pkg.beta"]
    assert map_problems("See :mod:`.alpha`.", "pkg", pkg) == []  # one mention, not a map
    # the HTTP package's map before token_scoring and probing were added to it
    http = ROOT / "specem_core" / "backends" / "http"
    old = module_docstring(http / "__init__.py").replace(":mod:`~specem_core.backends.http.token_scoring`", "")
    old = old.replace(":mod:`~specem_core.backends.http.probing`", "")
    assert "omits specem_core.backends.http.token_scoring" in map_problems(old, "specem_core.backends.http", http)
    missing = map_problems("* :mod:`specem_core.nowhere` — x.", "specem_core", ROOT / "specem_core")
    assert missing == ["names specem_core.nowhere, which does not exist"]


# -- protocols -------------------------------------------------------------------------------
def _is_protocol_base(base: ast.expr) -> bool:
    if isinstance(base, ast.Subscript):  # Protocol[T]
        base = base.value
    return (isinstance(base, ast.Name) and base.id == "Protocol") or (
        isinstance(base, ast.Attribute) and base.attr == "Protocol"
    )


def protocols_in_source() -> dict[str, str]:
    """Every ``typing.Protocol`` class of ``specem_core`` -> its module's path under ``specem_core/``."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "specem_core").rglob("*.py")):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ClassDef) and any(_is_protocol_base(b) for b in node.bases):
                where = path.relative_to(ROOT / "specem_core").as_posix()
                assert node.name not in found, f"two protocols named {node.name}: {found[node.name]} and {where}"
                found[node.name] = where
    return found


def protocols_in_docs(text: str) -> dict[str, str]:
    """The "Protocols" section of development.md: ``- `Name` (`module path`) — ...`` lines."""
    section = re.search(r"^#+ Protocols\s*$(.*?)(?=^#|\Z)", text, re.MULTILINE | re.DOTALL)
    assert section, "docs/development.md has no Protocols section"
    listed: dict[str, str] = {}
    for name, where in re.findall(r"^[-*] `(\w+)` \(`([\w/.]+)`\)", section.group(1), re.MULTILINE):
        assert name not in listed, f"{name} is listed twice"
        listed[name] = where
    return listed


def test_development_lists_every_protocol() -> None:
    source = protocols_in_source()
    docs = protocols_in_docs(DEVELOPMENT.read_text(encoding="utf-8"))
    assert sorted(set(source) - set(docs)) == [], "protocols missing from docs/development.md"
    assert sorted(set(docs) - set(source)) == [], "docs/development.md lists protocols that do not exist"
    moved = {name: (docs[name], where) for name, where in source.items() if docs[name] != where}
    assert moved == {}, "docs/development.md: (listed module, actual module)"


def test_the_protocol_rule_is_not_vacuous() -> None:
    """The list as it stood before this test (four optional features, no list of its own) fails."""
    old = "### Protocols\n\n- `CostedMember` (`backends/base.py`) — x.\n- `SettlingMember` (`backends/base.py`) — y.\n"
    assert set(protocols_in_source()) - set(protocols_in_docs(old))
