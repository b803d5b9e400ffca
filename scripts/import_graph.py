"""The package's import graph: circles (import cycles), arrows, the largest modules, and a picture.

Reads the imports with grimp (the engine of import-linter, which CI runs on the same graph) and
collapses them to one node per module of ``specem_core`` (``backends.*`` and ``tools`` one level
down) and per entry point of ``specem_integrations``. Prints the circles (strongly connected groups
of more than one node; the layering wants none), each node's line count and the largest module of
``specem_core``; writes the graph as Graphviz DOT and, where ``dot`` is installed, as a PNG.

Usage::

    python scripts/import_graph.py --out docs/assets/import_graph      # .dot and .png
    python scripts/import_graph.py --max-lines 600                     # exit 1 above it
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
DEEPER = ("specem_core.backends", "specem_core.tools", "specem_core.testing")
"""Packages whose modules are nodes of their own (elsewhere a subpackage is one node)."""


def node_of(module: str) -> str:
    """The node a module belongs to (see :data:`DEEPER`)."""
    parts = module.split(".")
    for package in DEEPER:
        if module.startswith(package + "."):
            depth = package.count(".") + 2
            return ".".join(parts[:depth])
    return ".".join(parts[:2])


def module_lines() -> dict[str, int]:
    """Lines of every module file, by dotted name."""
    out = {}
    for package in ("specem_core", "specem_integrations"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = len(path.read_text(encoding="utf-8").splitlines())
    return out


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def dot_source(nodes: dict[str, int], edges: dict[str, set[str]]) -> str:
    """The graph in Graphviz DOT: one box per node (its lines), the core and the entry points apart."""
    lines = [
        "digraph imports {",
        '  rankdir=TB; nodesep=0.25; ranksep=0.5; node [shape=box, fontname="Helvetica", fontsize=10];',
    ]
    for cluster, prefix, color in (
        ("integrations", "specem_integrations", "#e8eaf6"),
        ("core", "specem_core", "#f1f8e9"),
    ):
        lines.append(f'  subgraph cluster_{cluster} {{ label="{prefix}"; style=filled; color="{color}";')
        for name in sorted(n for n in nodes if n == prefix or n.startswith(prefix + ".")):
            short = name.removeprefix(prefix + ".") if name != prefix else "__init__"
            lines.append(f'    "{name}" [label="{short}\\n{nodes[name]} lines"];')
        lines.append("  }")
    for source in sorted(edges):
        for target in sorted(edges[source]):
            lines.append(f'  "{source}" -> "{target}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write OUT.dot (and OUT.png where Graphviz is installed)")
    parser.add_argument("--max-lines", type=int, default=None, help="fail when a specem_core module is longer")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph("specem_core", "specem_integrations")
    lines = module_lines()
    nodes: dict[str, int] = defaultdict(int)
    for module in graph.modules:
        nodes[node_of(module)] += lines.get(module, 0)
    edges: dict[str, set[str]] = defaultdict(set)
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = node_of(module), node_of(imported)
            if a != b:
                edges[a].add(b)
    found = circles(edges)
    arrows = sum(len(t) for t in edges.values())
    print(f"{len(nodes)} nodes, {arrows} arrows, {len(found)} circles")
    for group in found:
        print("  circle: " + " <-> ".join(group))
    core = {m: n for m, n in lines.items() if m.startswith("specem_core")}
    largest = max(core, key=core.__getitem__)
    print(f"largest specem_core module: {largest} ({core[largest]} lines)")
    for module, n in sorted(core.items(), key=lambda item: -item[1])[:5]:
        print(f"  {n:5d}  {module}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        dot_file = args.out.with_suffix(".dot")
        dot_file.write_text(dot_source(dict(nodes), edges), encoding="utf-8")
        print(f"wrote {dot_file}")
        if shutil.which("dot"):
            png = args.out.with_suffix(".png")
            subprocess.run(["dot", "-Tpng", "-Gdpi=56", str(dot_file), "-o", str(png)], check=True)
            print(f"wrote {png}")
    too_long = args.max_lines is not None and core[largest] > args.max_lines
    return 1 if found or too_long else 0


if __name__ == "__main__":
    raise SystemExit(main())
