"""The quality study behind ``benchmarks/quality.py`` (its command line), by concern:

- ``tasks``: data sets, prompts, token budgets, recorded answers, graders (``measure``, ``passes``);
- ``configs``: the configurations (``CONFIGS``) and their member-weight priors;
- ``runner``: engines, resumable runs, side-by-side timing (``cost``);
- ``report``: the Markdown tables, plot and the presets' measured results;
- ``analysis``: paired analyses and replays of the recorded rounds.

Settings shared between the parts (``tasks.RESULTS``, ``tasks.TASKS``, ``configs.CONFIGS``, ...)
are defined once and read through their module, so setting one there reaches every part.
"""
