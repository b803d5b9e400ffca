"""A griffe extension for this site: render the project's docstrings as the code means them.

Loaded by mkdocstrings (``extensions`` in ``mkdocs.yml``); the docstrings in the code stay as
they are. Three rewrites, on the docstring text only:

* a Google ``Example:`` section (singular) is read as ``Examples:``, so ``>>>`` lines render as
  Python sessions instead of nested quotes;
* reST ``.. code-block:: LANG`` blocks (LangChain's docstring convention) become fenced blocks;
* reST roles (``:class:`~specem_core.weights.MemberWeights```) become inline code
  (``MemberWeights``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$")
_CODE_BLOCK = re.compile(r"^(\s*)\.\. code-block::\s*(\w*)\s*$")
_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def rewrite(text: str) -> str:
    """The docstring text with the three rewrites applied."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        example = _EXAMPLE.match(line)
        block = _CODE_BLOCK.match(line)
        if example:
            out.append(f"{example.group(1)}Examples:")
            i += 1
            continue
        if block:
            indent, lang = block.group(1), block.group(2)
            i += 1
            body: list[str] = []
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
                body.append(lines[i])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            while body and not body[0].strip():
                body.pop(0)
            depth = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=0)
            out.append(f"{indent}```{lang}")
            out.extend(f"{indent}{b[depth:]}" if b.strip() else "" for b in body)
            out.append(f"{indent}```")
            out.append("")
            continue
        out.append(_ROLE.sub(_role, line))
        i += 1
    return "\n".join(out)


class DocstringRewrites(griffe.Extension):
    """Apply :func:`rewrite` to every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
