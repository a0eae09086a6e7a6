"""Actor classes named by file (a driver script run as ``__main__``): one module per
script path and modification time, so a second or edited script is never served the
first one's classes."""

from __future__ import annotations

import os

import pytest

from nereus.actors._endpoint import import_actor_class
from nereus.errors import ProtocolError

_SCRIPT = """
import nereus

class Worker(nereus.Actor):
    VALUE = {value!r}
"""


def _write(path, value: str, mtime_ns: int) -> str:
    path.write_text(_SCRIPT.format(value=value))
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return str(path)


def test_each_script_and_each_edit_gets_its_own_module(tmp_path):
    first = _write(tmp_path / "first.py", "first", 1_000_000_000_000)
    second = _write(tmp_path / "second.py", "second", 1_000_000_000_000)
    assert import_actor_class(f"file:{first}:Worker").VALUE == "first"
    assert import_actor_class(f"file:{second}:Worker").VALUE == "second"
    cls = import_actor_class(f"file:{first}:Worker")
    assert cls.VALUE == "first" and import_actor_class(f"file:{first}:Worker") is cls
    _write(tmp_path / "first.py", "edited", 2_000_000_000_000)
    assert import_actor_class(f"file:{first}:Worker").VALUE == "edited"


def test_a_missing_script_is_a_clear_error(tmp_path):
    with pytest.raises(ProtocolError, match="cannot import actor module from file"):
        import_actor_class(f"file:{tmp_path / 'gone.py'}:Worker")
