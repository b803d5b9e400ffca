#!/usr/bin/env bash
# Packaging check (CI runs it; docs/development.md "Packaging"): build the sdist and the wheel, check
# their metadata, then install the wheel -- not the checkout -- with the langchain, llamaindex and
# server extras into a fresh virtual environment outside the checkout, and use it from a directory
# that is not the checkout: the adapters import, the `specem` command runs, and `specem presets
# --json` reads the package data (specem_core/data). Nothing is left behind: everything happens in
# a temporary directory, removed at exit (KEEP=1 keeps it and prints where).
#
# Environment:
#   PYTHON   interpreter that builds and runs twine (default: .venv/bin/python; needs `build` and
#            `twine`, both in the dev extra); the fresh environment is created from it too
#   KEEP=1   keep the temporary directory
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-.venv/bin/python}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")

TMP=$(mktemp -d)
if [ "${KEEP:-0}" = "1" ]; then
    echo "check_package: keeping $TMP" >&2
else
    trap 'rm -rf "$TMP"' EXIT
fi

echo "== build (sdist and wheel) into $TMP/dist"
"$PY" -m build --outdir "$TMP/dist" "$ROOT"

echo "== twine check"
"$PY" -m twine check --strict "$TMP"/dist/*

WHEEL=$(ls "$TMP"/dist/*.whl)
SDIST=$(ls "$TMP"/dist/*.tar.gz)
echo "== wheel: $(basename "$WHEEL"), $(wc -c <"$WHEEL") bytes; sdist: $(basename "$SDIST"), $(wc -c <"$SDIST") bytes"
"$PY" - "$WHEEL" <<'EOF'
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
required = [
    "specem_core/py.typed",
    "specem_integrations/py.typed",
    "specem_core/data/preset_results.json",
    "specem_core/data/priors/quality.json",
    "specem_core/data/priors/fast.json",
    # the playground of `specem serve` (GET /)
    "specem_integrations/server/static/index.html",
    "specem_integrations/server/static/playground.css",
    "specem_integrations/server/static/playground.js",
]
missing = [n for n in required if n not in names]
if missing:
    sys.exit(f"check_package: the wheel lacks {', '.join(missing)}")
stray = [n for n in names if n.split("/")[0] not in ("specem_core", "specem_integrations") and ".dist-info/" not in n]
if stray:
    sys.exit(f"check_package: the wheel holds files outside the two packages: {', '.join(stray)}")
print(f"check_package: {len(names)} files; py.typed in both packages and the package data are there")
EOF
unzip -l "$WHEEL"

echo "== fresh environment, the wheel with [langchain,llamaindex,server]"
"$PY" -m venv "$TMP/venv"
"$TMP/venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$TMP/venv/bin/python" -m pip install -q --disable-pip-version-check "${WHEEL}[langchain,llamaindex,server]"

mkdir "$TMP/work"
cd "$TMP/work"  # not the checkout: imports must come from the installed wheel
export PATH="$TMP/venv/bin:$PATH"
unset PYTHONPATH
"$TMP/venv/bin/python" - "$TMP/venv" <<'EOF'
import sys
from pathlib import Path

import specem_core
import specem_integrations
from specem_integrations.langchain import ChatSpecEM
from specem_integrations.llamaindex import SpecEMLLM
from specem_integrations.server import create_app
from specem_integrations.server._playground import playground_routes

venv = Path(sys.argv[1]).resolve()
for module in (specem_core, specem_integrations):
    where = Path(module.__file__).resolve()
    if venv not in where.parents:
        sys.exit(f"check_package: {module.__name__} was imported from {where}, not from the installed wheel")
playground_routes()  # reads the playground's page and assets from the installed package data
print(f"check_package: specem {specem_core.__version__} imports from {venv}: "
      f"{ChatSpecEM.__name__}, {SpecEMLLM.__name__}, {create_app.__name__}")
EOF
specem --help >/dev/null
specem --version
specem presets --json >presets.json
"$TMP/venv/bin/python" - <<'EOF'
import json

rows = json.load(open("presets.json"))
names = [row["name"] for row in rows]
default = [row["name"] for row in rows if row["default"]]
assert {"quality", "fast", "paper"} <= set(names), names
assert default == ["quality"], default
assert rows[0]["prior"]["scores"], "the quality preset's prior (package data) was not read"
print(f"check_package: specem presets --json lists {', '.join(names)} (default {default[0]}) from the package data")
EOF
echo "check_package: OK"
