"""The ground truth's parameters: ``ground_truth.toml``'s tables, each with its source,
checked against ``SCHEMA`` when loaded.

Promises: a ``TruthParams`` holds every table and key of the schema, each value of its
kind (a number >= 0, or [x, y] / [x, y, z] points of positive numbers with increasing x
where the kind says so) and each table's source. Refuses (``ConfigError``, naming the
table and key): an unknown or missing table or key, a table without a source, a value of
the wrong shape, a file that is missing or not TOML.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nereus.config import require
from nereus.errors import ConfigError
from nereus.sim.cpu_truth import CPU_KEYS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

__all__ = ["PARAMS_PATH", "SCHEMA", "TruthParams", "load_truth_params", "truth_params_from"]

PARAMS_PATH = Path(__file__).with_name("ground_truth.toml")
# Every table of the file and its keys: "n" a number, "pts" a list of [x, y] points.
SCHEMA: dict[str, dict[str, str]] = {
    "device": {"peak_flops": "n", "hbm_bytes_per_s": "n"},
    "decode": {"points": "pts3", "weight_bytes": "n", "roofline_share": "n", "max_concurrent": "n"},
    "training": {"mfu_by_tp": "pts"},
    "short_batches": {"points": "pts"},
    "prefill": {"share_of_training_mfu": "n"},
    "collectives": {
        "intra_node_bytes_per_s": "n",
        "inter_node_port_bytes_per_s": "n",
        "ports_per_node": "n",
        "size_share": "pts",
        "intra_latency_s": "n",
        "inter_latency_s": "n",
    },
    "congestion": {"per_doubling": "n"},
    "optimizer": {"bytes_per_param": "n", "update_passes": "n"},
    "activations": {"replicated": "n", "recompute_bytes_per_h": "n", "logit_bytes": "n"},
    "fragmentation": {"points": "pts", "kv_share": "n"},
    "workspace": {"gib": "n"},
    "lengths": {"default_sigma": "n"},
    "stragglers": {"device_sigma": "n", "step_sigma": "n"},
    "drift": {"amplitude": "n", "period_steps": "n"},
    "restart": {"points": "pts"},
    "extend": {"points": "pts"},
    "reshard": {"points": "pts", "reference_params": "n"},
    "cpu": dict.fromkeys(CPU_KEYS, "n"),
}


@dataclass(frozen=True)
class TruthParams:
    """The ground truth's tables: ``tables[name]`` maps each key to its value and
    ``sources[name]`` says where the table's numbers come from."""

    tables: dict[str, dict[str, Any]]
    sources: dict[str, str]

    def __getitem__(self, key: str) -> Any:
        """``params["table.key"]``."""
        table, name = key.split(".")
        return self.tables[table][name]

    def rows(self) -> list[tuple[str, Any, str]]:
        """(``table.key``, value, the table's source) of every value, in schema order."""
        return [(f"{t}.{k}", self.tables[t][k], self.sources[t]) for t in SCHEMA for k in SCHEMA[t]]


def _check(table: str, key: str, kind: str, value: Any) -> None:
    where = f"{table}.{key}"
    if kind == "n":
        require(
            isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
            where,
            value,
            "must be a number >= 0",
        )
        return
    width = 3 if kind == "pts3" else 2
    ok = (
        isinstance(value, list)
        and len(value) >= 1
        and all(
            isinstance(p, list)
            and len(p) == width
            and all(isinstance(v, (int, float)) and v > 0 for v in p)
            for p in value
        )
    )
    require(
        ok,
        where,
        value,
        f"must be a list of [{', '.join(['x'] * width)}] points of positive numbers",
    )
    if kind == "pts":
        xs = [p[0] for p in value]
        require(
            xs == sorted(xs) and len(set(xs)) == len(xs),
            where,
            value,
            "must have increasing x values",
        )


def truth_params_from(data: dict[str, Any]) -> TruthParams:
    """``TruthParams`` from a parsed file; refuses unknown or missing tables and keys, a
    table without its source, and values of the wrong shape (``ConfigError``)."""
    unknown = sorted(set(data) - set(SCHEMA))
    if unknown:
        raise ConfigError(f"ground truth: unknown table(s) {unknown}; expected {sorted(SCHEMA)}")
    tables, sources = {}, {}
    for table, keys in SCHEMA.items():
        got = data.get(table)
        require(isinstance(got, dict), table, got, "must be a table of the ground truth file")
        source = got.get("source")
        require(
            isinstance(source, str) and bool(source.strip()),
            f"{table}.source",
            source,
            "must name where the table's numbers come from",
        )
        extra = sorted(set(got) - set(keys) - {"source"})
        if extra:
            raise ConfigError(
                f"ground truth table {table!r}: unknown key(s) {extra}; expected {sorted(keys)}"
            )
        for key, kind in keys.items():
            require(key in got, f"{table}.{key}", None, "must be given")
            _check(table, key, kind, got[key])
        tables[table] = {k: got[k] for k in keys}
        sources[table] = source
    share = tables["decode"]["roofline_share"]
    require(0 < share <= 1, "decode.roofline_share", share, "must be in (0, 1]")
    return TruthParams(tables, sources)


def load_truth_params(path: str | Path | None = None) -> TruthParams:
    """The ground truth's tables (default: the project's ``ground_truth.toml``)."""
    p = Path(path or PARAMS_PATH)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"ground truth file {str(p)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"ground truth file {str(p)!r} is not valid TOML: {e}") from None
    return truth_params_from(data)
