"""The four primitives as pure planners: Split, Merge, Extend, Destroy (docs/design.md §4).

Each returns a ``Step``: the EMUs it reads, creates and frees, one ``ReshardPlan`` per
created EMU (what moves where, by box intersection), and its ``MemoryEffect`` per
device. Nothing runs here; the runtime executes steps, the simulator replays them.

- ``split(emu, sub)``: cut one EMU into EMUs of the smaller layout ``sub`` on its
  devices; moves only what the smaller shards lack. Frees ``emu`` when done.
- ``merge(emus, layout, devices)``: fuse replicas into one larger layout; shards already
  on a target device are copied locally or kept, never sent. Frees the merged EMUs.
- ``extend(emu, devices, layout=...)``: a new replica on new devices, disjoint from the
  sources'; each shard sent once. Frees nothing.
- ``destroy(emu, others)``: frees ``emu``; only ever a redundant copy.

``sub_layout(a, b)`` is T_sub: the largest layout both ``a`` and ``b`` can be split
into (power-of-two layouts: ``(min tp, min pp)``, cut like whichever has the smaller pp).

Refuses (``StateError``, nothing freed): a layout that does not divide, destroying the
last copy, Extend onto devices that are not disjoint; (``OutOfMemory``) a step whose
peak does not fit a device's budget, when the ``DeviceSet`` has budgets.

More (how it works): docs/state.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from nereus.errors import StateError
from nereus.state.emu import EMU, DeviceSet
from nereus.state.layout import Box, Layout, box_subtract, check_layout
from nereus.state.memory import DEFAULT_BUCKET_BYTES, MemoryEffect, check_fits, memory_effect
from nereus.state.reshard import ReshardPlan, plan_reshard

__all__ = ["Step", "split", "merge", "extend", "destroy", "sub_layout", "sub_placements"]

Kind = Literal["split", "merge", "extend", "destroy"]


@dataclass(frozen=True, eq=False)
class Step:
    """One primitive: reads ``inputs``, creates ``created`` (one plan each), frees ``freed``."""

    kind: Kind
    inputs: tuple[EMU, ...]
    created: tuple[EMU, ...]
    freed: tuple[EMU, ...]
    plans: tuple[ReshardPlan, ...]
    memory: MemoryEffect

    @property
    def bytes_moved(self) -> int:
        return sum(p.bytes_moved for p in self.plans)

    @property
    def model_stage(self) -> str:
        return self.inputs[0].model_stage

    def __repr__(self) -> str:
        names = lambda es: [e.name for e in es]  # noqa: E731
        return (
            f"Step({self.kind}, in={names(self.inputs)}, created={names(self.created)}, "
            f"freed={names(self.freed)}, bytes_moved={self.bytes_moved})"
        )


def _finish(kind: Kind, inputs, created, freed, plans, devices, used, bucket_bytes) -> Step:
    effect = memory_effect(plans, inputs, freed, bucket_bytes)
    check_fits(
        effect,
        devices if isinstance(devices, DeviceSet) else None,
        used,
        f"{kind} of {[e.name for e in inputs]}",
    )
    return Step(kind, tuple(inputs), tuple(created), tuple(freed), tuple(plans), effect)


def sub_layout(a: Layout, b: Layout) -> Layout:
    """T_sub: the largest layout both ``a`` and ``b`` split into."""
    for x, y, axis in ((a.tp, b.tp, "tp"), (a.pp, b.pp, "pp")):
        lo, hi = min(x, y), max(x, y)
        if hi % lo:
            raise StateError(
                f"layouts {a} and {b}: the smaller {axis}={lo} must divide the larger {axis}={hi}"
            )
    pp = min(a.pp, b.pp)
    cuts = a.cuts if a.pp == pp else b.cuts
    return Layout(min(a.tp, b.tp), pp, cuts)


def sub_placements(big: Layout, devices: Sequence[int], sub: Layout) -> list[tuple[int, ...]]:
    """Device tuples of the ``big.size / sub.size`` ``sub`` replicas carved out of one
    ``big`` replica on ``devices``. Strided: sub TP rank ``t`` of replica ``k`` sits on
    big TP rank ``t * f + k``, so each big rank's shard lies inside its sub shard."""
    if big.tp % sub.tp or big.pp % sub.pp:
        raise StateError(f"layout {sub} does not divide layout {big}: tp and pp must divide")
    f_tp, f_pp = big.tp // sub.tp, big.pp // sub.pp
    out = []
    for k_pp in range(f_pp):
        for k_tp in range(f_tp):
            out.append(
                tuple(
                    devices[big.index(ps * f_pp + k_pp, ts * f_tp + k_tp)]
                    for ps in range(sub.pp)
                    for ts in range(sub.tp)
                )
            )
    return out


def split(
    emu: EMU,
    sub: Layout,
    devices: DeviceSet | None = None,
    *,
    placements: Sequence[Sequence[int]] | None = None,
    used: Mapping[int, int] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Step:
    """Split ``emu`` into replicas of ``sub`` on its devices (``placements``: the device
    tuple of each, disjoint tuples of ``emu.devices``; default ``sub_placements``: all
    of them)."""
    check_layout(emu.spec, sub)
    if emu.layout.tp % sub.tp or emu.layout.pp % sub.pp or sub == emu.layout:
        raise StateError(
            f"split of {emu.name}: {sub} must be smaller than {emu.layout} with tp and pp dividing"
        )
    places = (
        [tuple(p) for p in placements]
        if placements is not None
        else sub_placements(emu.layout, emu.devices, sub)
    )
    flat = [d for p in places for d in p]
    if (
        not places
        or len(set(flat)) != len(flat)
        or not set(flat) <= set(emu.devices)
        or any(len(p) != sub.size for p in places)
    ):
        raise StateError(
            f"split of {emu.name}: placements {places} must be disjoint tuples of {sub.size} of "
            f"its devices {list(emu.devices)}"
        )
    created = [
        emu.with_(name=f"{emu.name}.{i}", layout=sub, devices=p) for i, p in enumerate(places)
    ]
    plans = [plan_reshard([emu], t, devices, reuse=True) for t in created]
    return _finish(
        "split", [emu], [p.target for p in plans], [emu], plans, devices, used, bucket_bytes
    )


def merge(
    emus: Sequence[EMU],
    layout: Layout,
    target_devices: Sequence[int],
    devices: DeviceSet | None = None,
    *,
    name: str | None = None,
    used: Mapping[int, int] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Step:
    """Fuse ``emus`` into one EMU of ``layout`` on ``target_devices`` (at least one of
    which holds one of them)."""
    if not emus:
        raise StateError("merge needs at least one EMU")
    held = {d for e in emus for d in e.devices}
    if held.isdisjoint(target_devices):
        raise StateError(
            f"merge into {list(target_devices)}: no device holds any of {[e.name for e in emus]} "
            "(use extend)"
        )
    target = emus[0].with_(
        name=name or f"{emus[0].name}+", layout=layout, devices=tuple(target_devices)
    )
    plan = plan_reshard(emus, target, devices, reuse=True)
    return _finish(
        "merge", list(emus), [plan.target], list(emus), [plan], devices, used, bucket_bytes
    )


def extend(
    emu: EMU,
    new_devices: Sequence[int],
    devices: DeviceSet | None = None,
    *,
    name: str | None = None,
    layout: Layout | None = None,
    replicas: Sequence[EMU] = (),
    used: Mapping[int, int] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Step:
    """A new replica of ``emu`` on ``new_devices`` (disjoint from every source), in
    ``layout`` (default ``emu``'s); ``replicas`` are further sources of the same
    model-stage to balance load across."""
    sources = [emu, *replicas]
    for src in sources:
        common = sorted(set(new_devices) & set(src.devices))
        if common:
            raise StateError(
                f"extend of {emu.name} onto {list(new_devices)}: devices {common} "
                f"already hold {src.name}; Extend needs disjoint devices"
            )
    changes = {"layout": layout} if layout is not None else {}
    target = emu.with_(name=name or f"{emu.name}^", devices=tuple(new_devices), **changes)
    plan = plan_reshard(sources, target, devices)
    return _finish("extend", sources, [plan.target], [], [plan], devices, used, bucket_bytes)


def missing_boxes(emu: EMU, others: Sequence[EMU]) -> dict[str, list[Box]]:
    """key -> the boxes of ``emu``'s tensors that no EMU in ``others`` holds."""
    held: dict[str, list[Box]] = {}
    for o in others:
        for d in o.devices:
            for key, (shard, _) in o.shards_on(d).items():
                held.setdefault(key, []).extend(p.box for p in shard.pieces)
    missing: dict[str, list[Box]] = {}
    for d in emu.devices:
        for key, (shard, _) in emu.shards_on(d).items():
            for piece in shard.pieces:
                rest = [piece.box]
                for b in held.get(key, ()):
                    rest = [r for x in rest for r in box_subtract(x, b)]
                if rest:
                    missing.setdefault(key, []).extend(rest)
    return missing


def destroy(emu: EMU, others: Sequence[EMU], devices: DeviceSet | None = None) -> Step:
    """Free ``emu``; refused with ``StateError`` unless ``others`` hold all it holds."""
    others = [o for o in others if o is not emu and o.name != emu.name]
    missing = missing_boxes(emu, others)
    if missing:
        key, boxes = next(iter(missing.items()))
        raise StateError(
            f"destroy {emu.name} refused: it holds the last copy of {len(missing)} tensor(s), e.g. "
            f"{key} box {list(boxes[0])}; nothing was freed"
        )
    return _finish("destroy", [emu], [], [emu], [], devices, None, 0)
