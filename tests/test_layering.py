"""nereus.sim sits on the planning layers only: it may import nereus.planner,
nereus.transition, nereus.state and nereus.models (ModelSpecs read off the model
definition), never the runtime (actors, transfer, engines, rl) or the tap."""

from __future__ import annotations

import ast
from pathlib import Path

import nereus.sim

ALLOWED = {"nereus", "nereus.config", "nereus.errors", "nereus.planner", "nereus.transition", "nereus.state",
           "nereus.models", "nereus.sim"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return {m for m in out if m.split(".")[0] == "nereus"}


def test_the_simulator_imports_only_the_planning_layers():
    for path in Path(nereus.sim.__file__).parent.glob("*.py"):
        for module in _imports(path):
            top = ".".join(module.split(".")[:2])
            assert top in ALLOWED, f"{path.name} imports {module}"
