"""A YAML writer for manifests: mappings, sequences, strings, numbers, booleans, null.

``dump(value)`` writes block style that any YAML 1.1 or 1.2 reader (kubectl, PyYAML)
reads back as exactly ``value``; ``dump_all(values)`` joins documents with ``---``.
A string is written plain only when it cannot be read as anything else (a name, a
path); a multi-line string as a literal block when that keeps it exact; every other
string double-quoted, in printable ASCII with every other character escaped. nereus writes
manifests with it so that it needs no YAML package; it reads no YAML.

Refuses (``TypeError``): values other than dict (string keys of at most 253
characters), list, tuple, str, int, float (finite), bool and None.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["dump", "dump_all"]

# A letter first (after at most two dashes: command-line flags), then letters, digits and
# _ . / -: never a number, date, bool, null or indicator once the YAML 1.1 words below
# are excluded.
_PLAIN = re.compile(r"(-{1,2}[A-Za-z]|[A-Za-z_/])[A-Za-z0-9_./-]*\Z")
_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf"}
MAX_KEY_CHARS = 253  # Kubernetes' longest names; YAML's simple keys stop at 1,024
# Characters a literal block keeps as they are: YAML's printable set less its line breaks
# (U+0085, U+2028, U+2029) and the byte-order mark.
_PRINTABLE_LINE = re.compile(
    r"[\t\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufefe\uff00-\ufffd\U00010000-\U0010ffff]*\Z"
)


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"cannot write the float {value!r} to a manifest")
        text = repr(value)
        # YAML 1.1 readers take "1e-05" for a string: give every float its point.
        return text if "." in text or "e" not in text else text.replace("e", ".0e", 1)
    if isinstance(value, str):
        if _PLAIN.match(value) and value.lower() not in _WORDS:
            return value
        return _quoted(value)
    raise TypeError(f"cannot write a {type(value).__name__} ({value!r}) to a manifest")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t"}


def _quoted(value: str) -> str:
    """A double-quoted scalar in printable ASCII: every other character escaped."""
    out = []
    for ch in value:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def _block_text(value: str) -> bool:
    """Whether ``value`` survives as a literal block (``|`` or ``|-``) exactly."""
    if "\n" not in value or value.endswith("\n\n") or "\r" in value:
        return False
    lines = value.rstrip("\n").split("\n")
    return (
        not lines[0].startswith((" ", "\t"))
        and lines[0] != ""
        and all(
            _PRINTABLE_LINE.match(line)
            and not line.endswith((" ", "\t"))
            and not line.startswith("\t")
            for line in lines
        )
    )


def _lines(value: Any, indent: str) -> list[str]:
    """``value`` as the lines that follow a ``key:`` or ``-`` (nested under ``indent``)."""
    out: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
                raise TypeError(
                    f"manifest keys must be strings of at most {MAX_KEY_CHARS} "
                    f"characters (YAML's limit on simple keys), not {key!r:.80}"
                )
            out += _entry(f"{indent}{_scalar(key)}:", item, indent + "  ")
    elif isinstance(value, (list, tuple)):
        for item in value:
            out += _entry(f"{indent}-", item, indent + "  ")
    else:
        raise TypeError(f"expected a mapping or a sequence, not {value!r}")
    return out


def _entry(head: str, value: Any, indent: str) -> list[str]:
    if isinstance(value, (dict, list, tuple)):
        if not value:
            return [f"{head} {'{}' if isinstance(value, dict) else '[]'}"]
        nested = _lines(value, indent)
        if head.endswith("-"):  # "- key: value" on one line, the rest aligned under it
            return [f"{head} {nested[0].lstrip()}", *nested[1:]]
        return [head, *nested]
    if isinstance(value, str) and _block_text(value):
        chomp = "" if value.endswith("\n") else "-"
        return [
            f"{head} |{chomp}",
            *(f"{indent}{line}" if line else "" for line in value.rstrip("\n").split("\n")),
        ]
    return [f"{head} {_scalar(value)}"]


def dump(value: dict[str, Any]) -> str:
    """One YAML document holding the mapping ``value``."""
    if not isinstance(value, dict):
        raise TypeError(f"a manifest is a mapping, not {type(value).__name__}")
    return "\n".join(_lines(value, "")) + "\n" if value else "{}\n"


def dump_all(values: list[dict[str, Any]]) -> str:
    """Several YAML documents, separated by ``---``."""
    return "---\n".join(dump(v) for v in values)
