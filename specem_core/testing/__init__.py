"""Test oracles and diagnostics: slow, obviously correct code the fast paths are checked against.

:mod:`specem_core.testing.reference` recomputes every draft and score from scratch (no caches,
no batching) for the engine's and the backends' tests. Nothing in the library imports this
package; it ships so that the benchmarks and a user's own checks can use the same oracles.
"""
