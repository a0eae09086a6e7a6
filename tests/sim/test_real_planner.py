"""The simulator drives the project's own planner and transition DAG, not copies: every
module-level reference to ``nereus.planner.search.search`` and
``nereus.transition.build.build_dag`` is replaced by a counting wrapper around the very same
function, and a short simulation must go through them."""

from __future__ import annotations

import importlib
import sys

import pytest

from nereus.sim import run_policies
from tests.sim.helpers import small_scenario

# the modules themselves (``nereus.planner.search`` the attribute is the function)
search_module = importlib.import_module("nereus.planner.search")
dag_module = importlib.import_module("nereus.transition.build")


def _wrap_everywhere(monkeypatch: pytest.MonkeyPatch, real, calls: list) -> None:
    def counting(*args, **kwargs):
        calls.append(real)
        return real(*args, **kwargs)

    patched = 0
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if name.startswith("nereus") and getattr(module, real.__name__, None) is real:
            monkeypatch.setattr(module, real.__name__, counting)
            patched += 1
    assert patched >= 2  # the defining module and at least one importer


def test_policies_call_the_real_search_and_build_dag(monkeypatch):
    import nereus.sim.policies
    import nereus.sim.transitions  # noqa: F401 - every importer is loaded before patching

    real_search, real_build = search_module.search, dag_module.build_dag
    searches: list = []
    dags: list = []
    _wrap_everywhere(monkeypatch, real_search, searches)
    _wrap_everywhere(monkeypatch, real_build, dags)
    assert nereus.sim.policies.search is not real_search  # the simulator now holds the wrapper
    scn = small_scenario(memory_gib=24, steps=8)
    results = run_policies(scn, ("adaptive", "every-k", "static-restart"))
    assert all(r.steps == 8 for r in results)
    assert len(searches) >= 3 and all(f is real_search for f in searches)
    assert len(dags) >= 1 and all(f is real_build for f in dags)
    assert (
        real_search.__module__ == "nereus.planner.search"
        and real_build.__module__ == "nereus.transition.build"
    )
