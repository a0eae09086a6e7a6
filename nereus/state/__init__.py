"""nereus.state: layouts, shard specs, EMUs, reshard plans, the four primitives, logical
state, the per-device memory ledger and checkpoints (docs/design.md §4).

The planning modules (spec, layout, emu, reshard, memory, primitives, transition) are pure:
descriptions in, plans out. ``apply`` runs a plan over tensors in one process or in one
worker's part; ``holder`` is the workers' shard store (``ShardHolder``) and ``executor``
runs plans and steps on it from the controller (``execute``); ``ledger`` is each
device's memory account; ``checkpoint`` is the save/load fallback.

Names are resolved on first use, so the pure modules (``nereus.state.spec`` and the
planners) import without torch: the planner shares their rules.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {}
for _module, _names in {
    "apply": ["apply_plan", "apply_step", "plan_part", "run_part"],
    "checkpoint": [
        "load_checkpoint",
        "load_shards",
        "save_checkpoint",
        "save_shards",
        "write_manifest",
    ],
    "emu": [
        "EMU",
        "OPTIMIZER_SLOTS",
        "SLOTS",
        "DeviceSet",
        "LogicalState",
        "emu_from_plain",
        "emu_to_plain",
        "split_key",
        "tensor_key",
    ],
    "holder": ["ShardHolder"],
    "executor": [
        "ExecuteStats",
        "execute",
        "execute_into",
        "execute_step",
        "load_from_disk",
        "save_to_disk",
    ],
    "layout": ["Box", "Layout", "Piece", "Shard", "check_layout", "layer_bounds", "param_shard"],
    "ledger": ["MemoryLedger", "device_ledger"],
    "memory": ["DEFAULT_BUCKET_BYTES", "MemoryEffect", "check_fits", "memory_effect"],
    "reshard": ["PLAN_CACHE_SIZE", "Keep", "Move", "ReshardPlan", "bytes_minimum", "plan_reshard"],
    "primitives": ["Step", "destroy", "extend", "merge", "split", "sub_layout", "sub_placements"],
    "spec": [
        "DTYPE_BYTES",
        "Component",
        "ModelSpec",
        "ParamSpec",
        "ShardRule",
        "grad_bytes_per_param",
        "optimizer_bytes_per_param",
        "optimizer_slots",
        "training_slots",
    ],
    "transition": ["StageTransition", "plan_stage_transition"],
}.items():
    for _name in _names:
        _LAZY[_name] = f"nereus.state.{_module}"
del _module, _names, _name

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nereus.state' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
