"""Mesh shapes and slices against numpy indexing (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.actors import ActorMesh, ActorRef
from nereus.errors import ConfigError

AXES = ("dp", "pp", "tp")


def _mesh(sizes: dict[str, int]) -> ActorMesh:
    n = int(np.prod(list(sizes.values()))) if sizes else 1
    refs = [ActorRef(f"ipc:///x{i}", f"m/{i}", 1, i, "m", i) for i in range(n)]
    return ActorMesh("m", refs, sizes)


@st.composite
def mesh_and_selection(draw):
    names = draw(st.lists(st.sampled_from(AXES), min_size=1, max_size=3, unique=True))
    sizes = {a: draw(st.integers(1, 4)) for a in names}
    selection = {}
    for a in names:
        kind = draw(st.sampled_from(["none", "int", "slice"]))
        if kind == "int":
            selection[a] = draw(st.integers(0, sizes[a] - 1))
        elif kind == "slice":
            start = draw(st.integers(0, sizes[a] - 1))
            stop = draw(st.integers(start + 1, sizes[a]))
            step = draw(st.integers(1, 2))
            selection[a] = slice(start, stop, step)
    return sizes, selection


@settings(max_examples=200, deadline=None)
@given(mesh_and_selection())
def test_slice_matches_numpy_indexing(case):
    sizes, selection = case
    mesh = _mesh(sizes)
    ranks = np.arange(mesh.size).reshape(list(sizes.values()))  # row-major, like the mesh
    index = tuple(selection.get(a, slice(None)) for a in sizes)
    expected = ranks[index]
    sub = mesh.slice(**selection)
    assert [r.rank for r in sub.refs] == expected.reshape(-1).tolist()
    kept = [a for a in sizes if not isinstance(selection.get(a), int)]
    assert list(sub.axes) == kept
    assert tuple(sub.axes.values()) == expected.shape
    for rank, ref in enumerate(mesh.refs):  # coords invert the row-major layout
        c = mesh.coords(rank)
        assert ranks[tuple(c[a] for a in sizes)] == ref.rank


def test_bad_shapes_and_selections():
    with pytest.raises(ConfigError, match="hold 4 positions"):
        ActorMesh("m", _mesh({"dp": 3}).refs, {"dp": 2, "tp": 2})
    with pytest.raises(ConfigError, match=r"axes\['tp'\]=0"):
        ActorMesh("m", [], {"tp": 0})
    mesh = _mesh({"dp": 2, "tp": 2})
    with pytest.raises(ConfigError, match="int or a slice"):
        mesh.slice(dp="0")
    with pytest.raises(ConfigError, match="selects no position"):
        mesh.slice(dp=slice(2, 2))
    assert mesh.endpoint("name").method == "name"  # endpoints that clash with attributes
