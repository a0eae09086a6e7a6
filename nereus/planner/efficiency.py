"""The cost model's calibration: one efficiency factor per operation class, the seconds
of each fixed cost, and the memory model's scale and fixed term (docs/design.md §6).

``Efficiency`` is what online calibration (``nereus.planner.calibrate``) fits and what
``nereus.planner.cost`` divides ideal times by; ``CONSERVATIVE`` is the uncalibrated
start. Pure data, no I/O.

Refuses (``ConfigError``, naming the field): efficiency factors outside (0, 1.5], a
memory scale outside [0.25, 8], a fixed memory term outside [0, 1 TiB], layer-pass
counts and fixed-cost seconds outside their ranges.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from nereus.config import require

__all__ = ["OP_CLASSES", "FIXED_COSTS", "MAX_MEMORY_FIXED_BYTES", "Efficiency", "CONSERVATIVE"]

OP_CLASSES = (
    "gemm",
    "attention",
    "decode",
    "allreduce_intra",
    "allreduce_inter",
    "p2p_intra",
    "p2p_inter",
)
# Costs a term counts in units (its "ideal" is a count: layer passes, groups, calls,
# transitions, GB copied locally), with the Efficiency field that holds the seconds per unit.
FIXED_COSTS = {
    "layer_passes": "layer_pass_s",
    "groups": "group_setup_s",
    "calls": "transition_call_s",
    "transitions": "transition_s",
    "groups_released": "group_release_s",
    "copy_gb": "copy_s_per_gb",
    "host_gb": "host_s_per_gb",
}
MAX_MEMORY_FIXED_BYTES = 2**40  # Efficiency.memory_fixed_bytes: at most 1 TiB


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak per operation class. Defaults are conservative: what
    an unseen class is assumed to reach before calibration has measured it."""

    gemm: float = 0.40
    attention: float = 0.30
    decode: float = 0.50
    allreduce_intra: float = 0.50
    allreduce_inter: float = 0.40
    p2p_intra: float = 0.50
    p2p_inter: float = 0.40
    # Measured over modelled transient bytes (activations, KV cache, logits): the
    # memory model's calibration against measured peaks; 1.0 until measured.
    memory_scale: float = 1.0
    # Bytes a running model-stage holds beyond its modelled transient bytes whatever
    # their size (allocator workspace, communicator buffers, engine graphs): the fixed
    # term of the same calibration; 0 until measured.
    memory_fixed_bytes: float = 0.0
    # A transition node's fixed costs, in seconds: making its groups, and calling its
    # workers (learned from measured transition nodes; conservative until then).
    group_setup_s: float = 0.02
    transition_call_s: float = 0.005
    # A whole transition's fixed cost beyond its DAG's nodes, in seconds: releasing the
    # transition's groups and renaming the EMUs it made (learned from measured
    # transitions; conservative until then).
    transition_s: float = 0.05
    # Seconds to release one group the transition made (its groups go when it ends).
    group_release_s: float = 0.01
    # Seconds per GB a transition node copies on one device from a source the device
    # holds (a Merge or Split slicing what is already there; learned from measured nodes).
    copy_s_per_gb: float = 0.05
    # Seconds per GB the devices of one host receive together in a transition node,
    # beyond each device's own link: what they share (a CPU host's memory bus; ~0 where
    # every device has its own links; learned from measured nodes, 0 until then).
    host_s_per_gb: float = 0.0
    # The fixed cost of running one layer once (forward, or one unit of backward) beyond
    # its bytes and FLOPs, in seconds: kernel launches, framework dispatch, scheduling;
    # what makes small decode steps and small micro-batches slower than their FLOPs
    # (learned from measured model-stage times).
    layer_pass_s: float = 5e-5
    # The layer passes recomputing one layer adds to its forward and backward (3 passes)
    # in a training step with ``recompute``: 1 for a bare second forward; activation
    # checkpointing's saved-tensor hooks cost more on small CPU layers (the local probe
    # measures it; 1 until measured).
    recompute_passes: float = 1.0
    # What one micro-batch of a forward and backward costs beyond its layers, in layer
    # passes: the embedding, the LM head, the loss and their backward (a forward-only
    # pass pays a third); on small CPU models as much as a layer or more (the local
    # probe measures it; 0 until measured).
    micro_batch_passes: float = 0.0

    def __post_init__(self) -> None:
        for c in OP_CLASSES:
            require(
                0 < getattr(self, c) <= 1.5,
                f"Efficiency.{c}",
                getattr(self, c),
                "must be in (0, 1.5]",
            )
        require(
            0.25 <= self.memory_scale <= 8.0,
            "Efficiency.memory_scale",
            self.memory_scale,
            "must be in [0.25, 8]",
        )
        require(
            0 <= self.memory_fixed_bytes <= MAX_MEMORY_FIXED_BYTES,
            "Efficiency.memory_fixed_bytes",
            self.memory_fixed_bytes,
            f"must be in [0, {MAX_MEMORY_FIXED_BYTES}] bytes",
        )
        require(
            0.0 <= self.micro_batch_passes <= 50.0,
            "Efficiency.micro_batch_passes",
            self.micro_batch_passes,
            "must be in [0, 50] layer passes",
        )
        require(
            1.0 <= self.recompute_passes <= 20.0,
            "Efficiency.recompute_passes",
            self.recompute_passes,
            "must be in [1, 20] layer passes",
        )
        for f in (
            "group_setup_s",
            "transition_call_s",
            "transition_s",
            "group_release_s",
            "copy_s_per_gb",
            "host_s_per_gb",
            "layer_pass_s",
        ):
            require(
                0 <= getattr(self, f) <= 10.0,
                f"Efficiency.{f}",
                getattr(self, f),
                "must be in [0, 10] seconds",
            )

    def __getitem__(self, op_class: str) -> float:
        if op_class in FIXED_COSTS:
            # a fixed cost counts units, not ideal seconds: seconds = count / (1 / cost)
            seconds = getattr(self, FIXED_COSTS[op_class])
            return 1.0 / seconds if seconds > 0 else math.inf
        return getattr(self, op_class)

    def as_dict(self) -> dict[str, float]:
        """The time efficiency per operation class (``memory_scale`` is not one)."""
        return {c: getattr(self, c) for c in OP_CLASSES}

    def replace(self, **factors: float) -> Efficiency:
        return dataclasses.replace(self, **factors)

    def uncalibrated_memory(self) -> Efficiency:
        """These factors with the memory model as it is, uncalibrated (scale 1, no fixed
        term): what measured peaks are compared with."""
        return dataclasses.replace(self, memory_scale=1.0, memory_fixed_bytes=0.0)


CONSERVATIVE = Efficiency()
