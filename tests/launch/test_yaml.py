"""The manifest YAML writer: whatever it writes, a YAML reader reads back exactly."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.launch._yaml import dump, dump_all

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=40), inner, max_size=4)
    ),
    max_leaves=20,
)
_documents = st.dictionaries(st.text(max_size=40), _values, max_size=5)


@settings(max_examples=150, deadline=None)
@given(st.lists(_documents, min_size=1, max_size=3))
def test_what_is_written_reads_back_exactly(documents):
    assert list(yaml.safe_load_all(dump_all(documents))) == documents


@pytest.mark.parametrize(
    "value",
    [
        "yes",
        "No",
        "on",
        "null",
        "~",
        "1e3",
        "0x1F",
        "12:30",
        "2001-12-14",
        "- a",
        "a: b",
        "#x",
        "'q'",
        "*ref",
        "&a",
        "<<",
        "",
        " lead",
        "trail ",
        "1_000",
        ".inf",
        "-.5",
    ],
)
def test_words_yaml_would_read_as_something_else_stay_strings(value):
    assert yaml.safe_load(dump({"k": value})) == {"k": value}
    assert dump({"k": value}).startswith('k: "')


def test_plain_and_block_forms_where_they_are_exact():
    text = dump(
        {
            "name": "nereus-node",
            "command": ["python", "-m", "nereus.node", "--gpus"],
            "data": {"job.toml": '[model]\nkind = "tiny"\n\n[run]\nsteps = 3\n'},
        }
    )
    assert text == (
        "name: nereus-node\n"
        "command:\n  - python\n  - -m\n  - nereus.node\n  - --gpus\n"
        'data:\n  job.toml: |\n    [model]\n    kind = "tiny"\n\n    [run]\n'
        "    steps = 3\n"
    )


def test_what_a_manifest_cannot_hold_is_refused():
    for bad in ({"k": float("nan")}, {"k": {1, 2}}, {1: "v"}, {"k" * 300: 1}):
        with pytest.raises(TypeError):
            dump(bad)
