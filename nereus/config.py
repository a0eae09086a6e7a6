"""Configuration helpers shared by every layer: dataclasses from dicts and TOML.

Promises:
- ``from_dict(Cls, mapping)`` builds a (possibly nested) dataclass from plain data,
  checking every value against the field's annotation; an unknown key, a missing
  required key or a value of the wrong type raises ``ConfigError`` naming the dotted
  field path, the value and what was expected.
- ``load_toml(Cls, path)`` does the same for a TOML file (one-to-one with the
  dataclass).
- ``parse_size("2GiB")`` turns a human size into bytes.
- ``require(ok, field, value, rule)`` is the one-line check used in ``__post_init__``.

Refuses: silent coercion (a string where an int is expected is an error; an int
where a float is expected is accepted, as TOML writes ``1`` for ``1.0``).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from nereus.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

__all__ = ["from_dict", "load_toml", "parse_size", "require", "to_dict"]

T = TypeVar("T")

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 2**10,
    "ki": 2**10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 2**20,
    "mi": 2**20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 2**30,
    "gi": 2**30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 2**40,
    "ti": 2**40,
}


def parse_size(text: str | int, field: str = "size") -> int:
    """Bytes from ``"512MiB"``, ``"2GB"``, ``"1.5GiB"`` or an int. Raises ConfigError."""
    if isinstance(text, bool):
        raise ConfigError(f"{field}={text!r} must be a size such as '2GiB' or a byte count")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{field}={text} must be >= 0 bytes")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"{field}={text!r} must be a size such as '512MiB', '2GiB' or '4GB'")
    number, unit = m.group(1), (m.group(2) or "").lower()
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"{field}={text!r} has an unknown unit {unit!r}")
    return int(float(number) * _SIZE_UNITS[unit])


def require(ok: bool, field: str, value: Any, rule: str) -> None:
    """Raise ``ConfigError('field=value rule')`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field}={value!r} {rule}")


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:  # an optional value: the one type's own error says more
            raise errors[0]
        raise ConfigError(f"{path}={value!r} must be {_type_name(tp)}")
    if origin is typing.Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}={value!r} must be one of {list(allowed)}")
        return value
    if origin in (list, tuple, typing.Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}={value!r} must be a list")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}={value!r} must have {len(args)} items")
            return tuple(
                _convert(v, a, f"{path}[{i}]")
                for i, (a, v) in enumerate(zip(args, value, strict=True))
            )
        item = args[0] if args else Any
        out = [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r} must be a table")
        kt, vt = get_args(tp) or (Any, Any)
        return {
            _convert(k, kt, f"{path}.<key>"): _convert(v, vt, f"{path}.{k}")
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r} must be a table for {tp.__name__}")
        return from_dict(tp, value, path)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}={value!r} must be a number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}={value!r} must be an integer")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r} must be true or false")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r} must be a string")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{path}={value!r} must be {_type_name(tp)}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; errors name the dotted path of the field."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}={data!r} must be a table")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = path or cls.__name__
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{sub} is required ({_type_name(hints[name])})")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if path and not str(e).startswith(path):
            raise ConfigError(f"{path}.{e}") from None
        raise


def load_toml(cls: type[T], path: str | Path) -> T:
    """Read a TOML file into dataclass ``cls`` (see ``from_dict``)."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    return from_dict(cls, data)


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) from a dataclass tree, for msgpack and JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
