"""What a call to an actor is checked against: its endpoint (the method, its kind and
signature, the simple annotations of its positional parameters), and the actor class a
spawn names.

``Endpoint.check(args, kwargs)`` says what is wrong with a call's arguments (count,
names, and the types int, float, str, bytes, bool, list, dict, tuple where annotated;
``True`` is not an int) in words for the caller, or None. ``import_actor_class`` imports
``"module:QualName"`` or a driver script's ``"file:/x.py:QualName"`` (once per path and
modification time).

Refuses (``ProtocolError``): a class path of another shape, a missing attribute, a class
that is not an ``Actor``, a file that cannot be read or imported.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import types
import typing
from typing import Any

from nereus.actors.actor import Actor
from nereus.errors import ProtocolError

__all__ = ["EP_AGEN", "EP_CORO", "EP_SYNC", "Endpoint", "import_actor_class"]


_SIMPLE_TYPES: dict[Any, tuple[type, ...]] = {
    int: (int,),
    float: (int, float),
    str: (str,),
    bytes: (bytes,),
    bool: (bool,),
    list: (list,),
    dict: (dict,),
    tuple: (tuple,),
}
EP_CORO, EP_AGEN, EP_SYNC = 0, 1, 2  # how an endpoint runs: coroutine, stream, plain call


def import_actor_class(path: str) -> type:
    """The Actor subclass named by ``"module:QualName"`` (or ``"file:/x.py:QualName"``)."""
    module_name, sep, qual = path.rpartition(":")
    if not sep or not module_name or not qual:
        raise ProtocolError(f"actor class path {path!r} must look like 'module:QualName'")
    if module_name.startswith("file:"):
        module = _import_file(module_name[len("file:") :])
    else:
        module = importlib.import_module(module_name)
    obj: Any = module
    for part in qual.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ProtocolError(f"module {module_name!r} has no attribute {qual!r}")
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise ProtocolError(f"{path!r} is not a subclass of nereus.actors.Actor")
    return obj


def _import_file(file: str) -> types.ModuleType:
    """The module of a driver script, imported once per path and modification time: a
    second script, or the same one edited, gets a module of its own (in ``sys.modules``
    under a name made from both) instead of the first one's."""
    try:
        stat = os.stat(file)
    except OSError as e:
        raise ProtocolError(
            f"cannot import actor module from file {file!r}: {e.strerror}"
        ) from None
    digest = hashlib.sha256(f"{os.path.abspath(file)}\0{stat.st_mtime_ns}".encode())
    name = f"__nereus_main_{digest.hexdigest()[:16]}__"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise ProtocolError(f"cannot import actor module from file {file!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return module


class Endpoint:
    """One endpoint of a spawned actor: the bound method, whether calls run at once
    (``concurrent``), its kind and what its arguments are checked against."""

    __slots__ = ("fn", "concurrent", "kind", "sig", "nmin", "nmax", "checks", "qualname")

    def __init__(self, fn: Any, concurrent: bool, qualname: str) -> None:
        self.fn = fn
        self.concurrent = concurrent
        self.qualname = qualname
        if inspect.isasyncgenfunction(fn):
            self.kind = EP_AGEN
        elif inspect.iscoroutinefunction(fn):
            self.kind = EP_CORO
        else:
            self.kind = EP_SYNC
        self.sig = inspect.signature(fn)
        params = list(self.sig.parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.nmin = sum(1 for p in positional if p.default is p.empty)
        has_var = any(p.kind == p.VAR_POSITIONAL for p in params)
        self.nmax = None if has_var else len(positional)
        try:
            hints = typing.get_type_hints(fn)
        except (NameError, TypeError, AttributeError):
            hints = {}  # unresolvable annotations are documentation only
        self.checks: list[tuple[int, str, tuple[type, ...]]] = []
        for i, p in enumerate(positional):
            tp = hints.get(p.name)
            types = _SIMPLE_TYPES.get(typing.get_origin(tp) or tp)
            if types is not None:
                self.checks.append((i, p.name, types))

    def check(self, args: list, kwargs: dict) -> str | None:
        """None if ``args``/``kwargs`` fit; else what is wrong, for the caller."""
        if kwargs or len(args) < self.nmin or (self.nmax is not None and len(args) > self.nmax):
            try:
                bound = self.sig.bind(*args, **kwargs)
            except TypeError as e:
                return f"wrong arguments for {self.qualname}{self.sig}: {e}"
            values = bound.arguments
            for _, name, types in self.checks:
                if name in values and not _fits(values[name], types):
                    return self._type_msg(name, values[name], types)
            return None
        for i, name, types in self.checks:
            if i < len(args) and not _fits(args[i], types):
                return self._type_msg(name, args[i], types)
        return None

    def _type_msg(self, name: str, value: Any, types: tuple[type, ...]) -> str:
        want = " or ".join(t.__name__ for t in types)
        return (
            f"wrong argument type for {self.qualname}: {name}={_short(value)} is a "
            f"{type(value).__name__}, expected {want}"
        )


def _fits(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types and int in types and float not in types:
        return False  # True is not an int argument here
    return isinstance(value, types)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
