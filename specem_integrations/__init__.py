"""Thin framework adapters over :mod:`specem_core` (no algorithm lives here).

* :mod:`specem_integrations.langchain` — ``ChatSpecEM`` (the ``langchain`` extra).
* :mod:`specem_integrations.llamaindex` — the LlamaIndex LLM (the ``llamaindex`` extra).

Install an extra with ``.venv/bin/pip install -e '.[langchain]'`` after ``scripts/install.sh``
(docs/guides/installation.md, "Extras"). Each subpackage imports its framework lazily, so
importing this package costs nothing.
"""
