"""Thin framework adapters over :mod:`specem_core` (no algorithm lives here).

* :mod:`specem_integrations.langchain` — ``ChatSpecEM`` (the ``langchain`` extra).
* :mod:`specem_integrations.llamaindex` — the LlamaIndex LLM (the ``llamaindex`` extra).
* :mod:`specem_integrations.server` — ``specem serve``, the OpenAI-compatible server (the ``server`` extra).
* :mod:`specem_integrations.cli` — the ``specem`` command.
* :mod:`specem_integrations._options` — the one declaration of the options a user sets, and what
  every surface builds from it (the adapters' fields, the CLI's flags, ``--set``, the server's
  request object).

Install an extra with ``.venv/bin/pip install -e '.[langchain]'`` after ``scripts/install.sh``
(docs/guides/installation.md, "Extras"). Each subpackage imports its framework lazily, so
importing this package costs nothing.
"""
