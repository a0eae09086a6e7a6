"""The import graph of nereus, read with ``ast`` (imports inside functions and under
``TYPE_CHECKING`` included), has no cycles, no import of another package's private
module and no import that runs up the layer order below (bottom to top, as in the
design's section 2). The simulator sits on the planning layers only. The checks run
on a planted package too, so a test that cannot fail would show."""

from __future__ import annotations

import ast
from pathlib import Path

import nereus

# Bottom to top: a module imports only modules of its own layer and the layers below.
# ``monitor`` sits below the job (the job records the tap); ``data`` below ``rl`` (a
# step draws samples from a task and encodes them with a codec); ``sim`` below the job
# (a running job replays the simulator's traces through ``nereus.sim.traces``).
LAYERS: list[tuple[str, ...]] = [
    ("nereus.errors",),
    ("nereus.config",),
    ("nereus.actors",),
    ("nereus.transfer",),
    ("nereus.state",),
    ("nereus.models",),
    ("nereus.engines",),
    ("nereus.planner",),
    ("nereus.transition",),
    ("nereus.monitor",),
    ("nereus.data",),
    ("nereus.rl",),
    ("nereus.sim",),
    ("nereus.job",),
    ("nereus.launch",),
    ("nereus", "nereus.cli", "nereus.node"),
]

TOP_LEVEL = {"__init__", "cli", "config", "errors", "node"}

# the simulator replays the planner and the transition DAG: never the runtime
SIM_MAY_IMPORT = {
    "nereus.errors",
    "nereus.config",
    "nereus.planner",
    "nereus.transition",
    "nereus.state",
    "nereus.models",
    "nereus.sim",
}


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules it imports, for every module under ``root`` (the folder of
    ``package``). ``from P import name`` is an edge to ``P.name`` when that is a module,
    else to ``P``; importing a module of another package also runs that package's
    ``__init__``, so it is an edge to the package as well."""
    paths = {_module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for me, path in paths.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = me.split(".")[: len(me.split(".")) - node.level + is_package]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in paths else base)
        edges: set[str] = set()
        for t in targets:
            if t.split(".")[0] != package:
                continue
            while t not in paths and "." in t:  # an attribute path: its module
                t = t.rsplit(".", 1)[0]
            edges.add(t)
            top = ".".join(t.split(".")[:2])
            if top != ".".join(me.split(".")[:2]) and top in paths and top != package:
                edges.add(top)
        edges.discard(me)
        graph[me] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected component of more
    than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(comp)) for comp in components]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    start = min(comp)
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph[path[-1]] if w in comp)
        back = [w for w in nxt if w in seen]
        if back:
            return path[path.index(back[0]) :] + [back[0]]
        path.append(nxt[0])
        seen.add(nxt[0])


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def private_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` where ``b`` is a private module (a ``_name`` part) of a package ``a``
    is not in."""
    out = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            private = any(p.startswith("_") for p in b.split(".")[2:])
            if private and _package(a) != _package(b):
                out.append(f"{a} -> {b}")
    return out


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int | None:
    best: tuple[int, int] | None = None
    for i, names in enumerate(layers):
        for name in names:
            if module == name or module.startswith(name + ".") and name.count(".") >= 1:
                if best is None or len(name) > best[1]:
                    best = (i, len(name))
    return None if best is None else best[0]


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    out = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if la is not None and lb is not None and lb > la:
                out.append(f"{a} (layer {la}) -> {b} (layer {lb})")
    return out


def _graph() -> dict[str, set[str]]:
    return import_graph(Path(nereus.__file__).parent, "nereus")


def test_the_import_graph_has_no_cycles():
    found = cycles(_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_module_imports_another_packages_private_module():
    found = private_imports(_graph())
    assert not found, "imports of another package's private module:\n" + "\n".join(found)


def test_no_import_runs_up_the_layers():
    found = upward_imports(_graph(), LAYERS)
    assert not found, "imports that run up the layers:\n" + "\n".join(found)


def test_every_module_has_a_layer_and_the_top_level_is_small():
    graph = _graph()
    assert [m for m in sorted(graph) if layer_of(m, LAYERS) is None] == []
    top = {p.stem for p in Path(nereus.__file__).parent.glob("*.py")}
    assert top == TOP_LEVEL, sorted(top ^ TOP_LEVEL)


def test_the_simulator_imports_only_the_planning_layers():
    for module, targets in _graph().items():
        if _package(module) == "nereus.sim":
            for target in targets:
                assert _package(target) in SIM_MAY_IMPORT, f"{module} imports {target}"


def _plant(root: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(root / "pkg", "pkg")


def test_the_checks_find_a_planted_cycle_private_import_and_upward_import(tmp_path):
    graph = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/_inner.py": "",
            "low/a.py": "def f():\n    from pkg.high.b import g\n",  # function-level, upward
            "high/__init__.py": "",
            "high/b.py": "from pkg.low import a\nfrom pkg.low._inner import x\n",
        },
    )
    assert graph["pkg.low.a"] == {"pkg.high.b", "pkg.high"}
    assert graph["pkg.high.b"] == {"pkg.low.a", "pkg.low._inner", "pkg.low"}
    assert cycles(graph) == [["pkg.high.b", "pkg.low.a", "pkg.high.b"]]
    assert private_imports(graph) == ["pkg.high.b -> pkg.low._inner"]
    layers = [("pkg.low",), ("pkg.high",)]
    assert upward_imports(graph, layers) == [
        "pkg.low.a (layer 0) -> pkg.high (layer 1)",
        "pkg.low.a (layer 0) -> pkg.high.b (layer 1)",
    ]


def test_a_cycle_through_a_package_init_is_found(tmp_path):
    # rl.algorithms -> job.config runs job/__init__, which imports job.loop -> rl.algorithms
    graph = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "rl/__init__.py": "",
            "rl/algorithms.py": "from pkg.job.config import JobConfig\n",
            "job/__init__.py": "from pkg.job.loop import run\n",
            "job/config.py": "",
            "job/loop.py": "import pkg.rl.algorithms\n",
        },
    )
    assert cycles(graph) == [["pkg.job", "pkg.job.loop", "pkg.rl.algorithms", "pkg.job"]]
