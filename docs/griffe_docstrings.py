"""Griffe extensions for this site: render the project's docstrings as the code means them.

Loaded by mkdocstrings (``extensions`` in ``mkdocs.yml``); the docstrings in the code stay as
they are.

:class:`DocstringRewrites` makes three rewrites, on the docstring text only:

* a Google ``Example:`` section (singular) is read as ``Examples:``, so ``>>>`` lines render as
  Python sessions instead of nested quotes;
* reST ``.. code-block:: LANG`` blocks (LangChain's docstring convention) become fenced blocks;
* reST roles (``:class:`~specem_core.weights.MemberWeights```) become inline code
  (``MemberWeights``).

:class:`RuntimeModelFields` renders pydantic models whose fields are built at run time, which
griffe's static reading cannot see: a field declared as ``Field(description=_doc("seed"))`` gets
the description pydantic holds as its docstring (and its default as its value, not the
``Field(...)`` call), and a model made by ``create_model`` (``SpecEMOptions``) becomes a class with
one attribute per field. Both descriptions come from the code (``SpecEMConfig``'s field
docstrings), so the reference says what the surfaces say, in one place.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
import typing
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


def annotation_text(tp: Any) -> str:
    """A type as code writes it: ``bool | None``, ``Literal['sum', 'softmax'] | None``, ``list[str]``."""
    if tp is type(None) or tp is None:
        return "None"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(annotation_text(a) for a in args)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin is not None and args:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(annotation_text(a) for a in args)}]"
    if isinstance(tp, type):
        return tp.__name__
    return re.sub(r"\btyping\.", "", str(tp))


def _default_text(field: Any) -> str | None:
    """The field's default as code (``None``, ``{}``), or ``None`` for a required field."""
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        return repr(field.default_factory())
    if field.default is PydanticUndefined:
        return None
    return repr(field.default)


class RuntimeModelFields(griffe.Extension):
    """Field descriptions and defaults of the pydantic models named in ``models``, read from the
    imported classes (see the module docstring)."""

    def __init__(self, models: list[str], shared: list[str] | None = None) -> None:
        super().__init__()
        self.models = list(models)
        self.shared = list(shared or [])
        """Models whose fields the classes in ``models`` inherit (``EnsembleFields``): each such
        field becomes an attribute of the class that inherits it, so its page lists it."""

    def _shared_fields(self) -> set[str]:
        names: set[str] = set()
        for path in self.shared:
            module_path, name = path.rsplit(".", 1)
            names |= set(getattr(importlib.import_module(module_path), name).model_fields)
        return names

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for path in self.models:
            if path.startswith(pkg.path + "."):
                self._document(pkg, path)

    def _document(self, pkg: griffe.Module, path: str) -> None:
        module_path, name = path.rsplit(".", 1)
        model = getattr(importlib.import_module(module_path), name)
        found = pkg[path[len(pkg.path) + 1 :]]
        if isinstance(found, griffe.Class):
            shared = self._shared_fields()
            for field_name, field in model.model_fields.items():
                attribute = found.members.get(field_name)
                if attribute is None and field_name in shared:  # declared once, for every surface
                    attribute = griffe.Attribute(
                        field_name, annotation=annotation_text(field.annotation), lineno=found.lineno, parent=found
                    )
                    found.set_member(field_name, attribute)
                if not isinstance(attribute, griffe.Attribute):
                    continue  # inherited, or not declared in this class
                if attribute.docstring is None and field.description:
                    attribute.docstring = griffe.Docstring(rewrite(field.description), parent=attribute)
                default = _default_text(field)
                if default is not None:
                    attribute.value = default
                attribute.labels = {"instance-attribute"}  # a field, not a class attribute
            return
        # a model assigned at run time (``X = create_model(...)``): a class with one attribute per field
        parent = found.parent
        assert parent is not None
        cls = griffe.Class(name, lineno=found.lineno, endlineno=found.endlineno, parent=parent)
        cls.docstring = griffe.Docstring(rewrite(inspect.cleandoc(model.__doc__ or "")), parent=cls)
        for field_name, field in model.model_fields.items():
            attribute = griffe.Attribute(
                field_name,
                value=_default_text(field),
                annotation=annotation_text(field.annotation),
                lineno=found.lineno,
                parent=cls,
            )
            attribute.labels = {"instance-attribute"}
            if field.description:
                attribute.docstring = griffe.Docstring(rewrite(field.description), parent=attribute)
            else:  # declared with a docstring in a base class of the same module
                for base in model.__mro__[1:]:
                    declared = parent.members.get(base.__name__)
                    if isinstance(declared, griffe.Class) and field_name in declared.members:
                        attribute.docstring = declared.members[field_name].docstring
                        break
            cls.set_member(field_name, attribute)
        parent.set_member(name, cls)
