"""Whether model-written programs can be graded on this machine, for the tests that grade them.

The grader runs them behind bubblewrap (``benchmarks/quality_study/sandbox.py``) and refuses to run
them without it. Where it is missing, those tests skip and say why; where
``SPECEM_REQUIRE_SANDBOX=1`` (CI, which installs it), they run, and fail.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from quality_study import sandbox

REFUSAL = sandbox.sandbox_available()
"""Why the sandbox cannot run here; ``None`` where it can."""
SKIP = REFUSAL is not None and os.environ.get("SPECEM_REQUIRE_SANDBOX") != "1"
"""Whether the tests that need the sandbox skip here."""
needs_sandbox = pytest.mark.skipif(SKIP, reason=f"the sandbox is unavailable here: {REFUSAL}")
