"""Thin framework adapters over :mod:`specem_core` (no algorithm lives here).

* :mod:`specem_integrations.langchain` — ``ChatSpecEM`` (needs ``specem[langchain]``).
* :mod:`specem_integrations.llamaindex` — the LlamaIndex LLM (needs ``specem[llamaindex]``).

Each subpackage imports its framework lazily, so importing this package costs nothing.
"""
