"""The top-level API: every name in nereus.__all__ resolves, lazily, to its layer's object."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import nereus


def test_every_public_name_resolves_to_its_layer():
    for name in nereus.__all__:
        value = getattr(nereus, name)
        module = nereus._LAZY.get(name)
        if module is not None:
            assert value is getattr(importlib.import_module(module), name), name
            assert name in importlib.import_module(module).__all__, (module, name)


def test_unknown_name_is_an_attribute_error():
    try:
        nereus.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("expected AttributeError")


@pytest.mark.integration
def test_import_is_cheap_and_never_loads_gpu_packages():
    code = (
        "import sys, nereus; print(sorted(m for m in ('torch', 'cupy', 'vllm') if m in "
        "sys.modules));"
        "nereus.Cluster; nereus.GenerationEngine; print(sorted(m for m in ('cupy', 'vllm') if "
        "m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout + out.stderr
