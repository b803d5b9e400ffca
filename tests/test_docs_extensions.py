"""The site's griffe extensions (``docs/griffe_docstrings.py``), on the real packages.

``RuntimeModelFields`` must give every field of ``SpecEMLLM`` its description (most are built at
run time from ``SpecEMConfig``'s field docstrings, which a static reading cannot see) and its
default instead of the ``Field(...)`` call, and must turn ``SpecEMOptions`` (a ``create_model``
result, an attribute to griffe) into a class with one documented attribute per field.
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
    "specem_integrations.llamaindex.base.SpecEMLLM",
    "specem_integrations.server._protocol.SpecEMOptions",
]


def _extensions() -> ModuleType:
    return load_script("docs/griffe_docstrings.py", "griffe_docstrings")


def _load(*extensions: Any) -> Any:
    loader = griffe.GriffeLoader(extensions=griffe.load_extensions(*extensions), search_paths=[str(ROOT)])
    package = loader.load("specem_integrations")
    loader.resolve_aliases(external=False, implicit=False)
    return package


@pytest.fixture(scope="module")
def documented() -> Any:
    return _load(_extensions().RuntimeModelFields(models=MODELS))


def test_every_field_of_specemllm_has_its_description_and_default(documented: Any) -> None:
    from specem_integrations.llamaindex import SpecEMLLM

    cls = documented["llamaindex.base.SpecEMLLM"]
    own = [name for name in SpecEMLLM.model_fields if name in cls.members]
    assert len(own) >= 30
    for name in own:
        attribute = cls.members[name]
        assert attribute.docstring is not None, name
        assert attribute.docstring.value == _extensions().rewrite(SpecEMLLM.model_fields[name].description), name
        assert "Field(" not in str(attribute.value), name
    assert str(cls.members["temperature"].value) == "None"
    assert str(cls.members["member_kwargs"].value) == "{}"


def test_without_the_extension_the_runtime_descriptions_are_missing() -> None:
    """The check above is not vacuous: griffe alone sees ``Field(description=_doc(...))``."""
    cls = _load()["llamaindex.base.SpecEMLLM"]
    assert cls.members["temperature"].docstring is None
    assert "Field(" in str(cls.members["temperature"].value)
    assert not isinstance(_load()["server._protocol.SpecEMOptions"], griffe.Class)


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
