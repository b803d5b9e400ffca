"""Load a repository script (``benchmarks/*.py``, ``scripts/*.py``) as a module, for tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str) -> ModuleType:
    """Import ``ROOT / relative`` under the module name ``name`` (registered in ``sys.modules``,
    which dataclasses and pickling in the script need)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
