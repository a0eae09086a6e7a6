"""nereus.state: layouts, shard specs, EMUs, reshard plans, the four primitives, logical
state and checkpoints (DESIGN §4).

The planning modules (spec, layout, emu, plan, memory, primitives, transition) are pure:
descriptions in, plans out. ``apply`` runs a plan over tensors in one process or in one
worker's part; ``holder`` runs plans and steps on worker processes (``ShardHolder``,
``execute``); ``checkpoint`` is the save/load fallback.
"""

from nereus.state.apply import apply_plan, apply_step, plan_part, run_part
from nereus.state.checkpoint import (
    load_checkpoint,
    load_shards,
    save_checkpoint,
    save_shards,
    write_manifest,
)
from nereus.state.emu import (
    EMU,
    OPTIMIZER_SLOTS,
    SLOTS,
    DeviceSet,
    LogicalState,
    emu_from_plain,
    emu_to_plain,
    split_key,
    tensor_key,
)
from nereus.state.holder import (
    ExecuteStats,
    ShardHolder,
    execute,
    execute_step,
    load_from_disk,
    save_to_disk,
)
from nereus.state.layout import Box, Layout, Piece, Shard, check_layout, layer_bounds, param_shard
from nereus.state.memory import DEFAULT_BUCKET_BYTES, MemoryEffect, check_fits, memory_effect
from nereus.state.plan import PLAN_CACHE_SIZE, Keep, Move, ReshardPlan, bytes_minimum, plan_reshard
from nereus.state.primitives import Step, destroy, extend, merge, split, sub_layout, sub_placements
from nereus.state.spec import DTYPE_BYTES, Component, ModelSpec, ParamSpec, ShardRule
from nereus.state.transition import StageTransition, plan_stage_transition

__all__ = [
    "save_to_disk",
    "load_from_disk",
    "execute",
    "execute_step",
    "ShardHolder",
    "ExecuteStats",
    "Box",
    "Component",
    "DEFAULT_BUCKET_BYTES",
    "DTYPE_BYTES",
    "DeviceSet",
    "EMU",
    "Keep",
    "Layout",
    "LogicalState",
    "MemoryEffect",
    "ModelSpec",
    "Move",
    "OPTIMIZER_SLOTS",
    "ParamSpec",
    "Piece",
    "ReshardPlan",
    "SLOTS",
    "Shard",
    "ShardRule",
    "StageTransition",
    "Step",
    "apply_plan",
    "apply_step",
    "bytes_minimum",
    "check_fits",
    "check_layout",
    "destroy",
    "emu_from_plain",
    "emu_to_plain",
    "extend",
    "layer_bounds",
    "load_checkpoint",
    "load_shards",
    "memory_effect",
    "merge",
    "param_shard",
    "PLAN_CACHE_SIZE",
    "plan_part",
    "plan_reshard",
    "plan_stage_transition",
    "run_part",
    "save_checkpoint",
    "save_shards",
    "split",
    "split_key",
    "sub_layout",
    "sub_placements",
    "tensor_key",
    "write_manifest",
]
