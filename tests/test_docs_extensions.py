"""The site's griffe extensions (``docs/griffe_docstrings.py``), on the real packages.

``RuntimeModelFields`` must give every field of ``ChatSpecEM`` and ``SpecEMLLM`` its description and
default, the fields they inherit from ``EnsembleFields`` (declared once for every surface, built at
run time from ``SpecEMConfig``'s field docstrings, which a static reading cannot see) included, and
must turn ``SpecEMOptions`` (a ``create_model`` result, an attribute to griffe) into a class with one
documented attribute per field.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import pytest
from script_loader import load_script

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[1]
MODELS = [
    "specem_integrations.langchain.chat_models.ChatSpecEM",
    "specem_integrations.llamaindex.base.SpecEMLLM",
    "specem_integrations.server._protocol.SpecEMOptions",
]
SHARED = ["specem_integrations._options.EnsembleFields"]


def _extensions() -> ModuleType:
    return load_script("docs/griffe_docstrings.py", "griffe_docstrings")


def _load(*extensions: Any) -> Any:
    loader = griffe.GriffeLoader(extensions=griffe.load_extensions(*extensions), search_paths=[str(ROOT)])
    package = loader.load("specem_integrations")
    loader.resolve_aliases(external=False, implicit=False)
    return package


@pytest.fixture(scope="module")
def documented() -> Any:
    return _load(_extensions().RuntimeModelFields(models=MODELS, shared=SHARED))


@pytest.mark.parametrize("path", MODELS[:2])
def test_every_field_of_the_adapters_has_its_description_and_default(documented: Any, path: str) -> None:
    import importlib

    from specem_integrations._options import EnsembleFields

    module, name = path.rsplit(".", 1)
    model = getattr(importlib.import_module(module), name)
    cls = documented[path.removeprefix("specem_integrations.")]
    for field in EnsembleFields.model_fields:  # declared once, listed on each adapter's page
        attribute = cls.members[field]
        assert attribute.docstring is not None, field
        assert attribute.docstring.value == _extensions().rewrite(model.model_fields[field].description), field
        assert "Field(" not in str(attribute.value), field
    assert len(EnsembleFields.model_fields) >= 30
    assert str(cls.members["temperature"].value) == "None"
    assert str(cls.members["member_kwargs"].value) == "{}"
    assert cls.members["segment_boundary"].annotation == "Literal['tokens', 'line'] | None"


def test_without_the_extension_the_runtime_fields_are_missing() -> None:
    """The check above is not vacuous: griffe alone sees no inherited field on the adapters."""
    package = _load()
    assert "temperature" not in package["llamaindex.base.SpecEMLLM"].members
    assert "temperature" not in package["langchain.chat_models.ChatSpecEM"].members
    assert not isinstance(package["server._protocol.SpecEMOptions"], griffe.Class)


def test_specem_options_becomes_a_class_with_one_documented_attribute_per_field(documented: Any) -> None:
    from specem_integrations.server import SpecEMOptions

    cls = documented["server._protocol.SpecEMOptions"]
    assert isinstance(cls, griffe.Class)
    assert list(cls.members) == list(SpecEMOptions.model_fields)
    for name, attribute in cls.members.items():
        assert attribute.docstring is not None, name
        assert attribute.docstring.value.strip(), name
    # trace and preset are declared with attribute docstrings on the base class
    assert cls.members["trace"].docstring.value.startswith("Return the per-round trace")
    assert str(cls.members["trace"].value) == "False"
    assert cls.members["segment_boundary"].annotation == "Literal['tokens', 'line'] | None"
    # the public name (an alias in specem_integrations.server) resolves to the new class
    assert documented["server.SpecEMOptions"].final_target is cls


@pytest.mark.parametrize(
    ("annotation", "text"),
    [
        (bool | None, "bool | None"),
        (Literal["sum", "softmax"] | None, "Literal['sum', 'softmax'] | None"),
        (list[str], "list[str]"),
        (dict[str, Any], "dict[str, Any]"),
        (int, "int"),
    ],
)
def test_annotation_text_writes_types_as_code_does(annotation: Any, text: str) -> None:
    assert _extensions().annotation_text(annotation) == text
