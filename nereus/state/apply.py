"""Running a plan on tensors: the part one device executes, and an in-memory executor.

``plan_part(plan, device)`` is the plain-data piece of a ``ReshardPlan`` that one device
executes (msgpack-ready: lists, ints, strings): the target tensors to allocate, the
shards to adopt, the local copies, and the ordered sends and receives per peer device.

``apply_plan(plan, stores)`` runs every device's part in one process, matching sends
with receives by direct copy: the reference executor for tests and the simulator.

Refuses (``StateError``): a source tensor the part names that is missing or has the
wrong shape or dtype, sends and receives that do not pair up.

More (how it works): docs/state.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nereus.errors import StateError
from nereus.state.primitives import Step
from nereus.state.reshard import ReshardPlan
from nereus.transfer import copy_into

__all__ = [
    "TORCH_DTYPES",
    "plan_part",
    "run_part",
    "apply_plan",
    "apply_step",
    "box_slices",
    "Exchange",
]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

Exchange = Callable[..., Any]  # (sends, recvs) or, with local_in_exchange, (sends, recvs, copies)
_ALIGN = 64
Stores = Mapping[str, Mapping[str, torch.Tensor]]


def box_slices(box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def plan_part(plan: ReshardPlan, device: int) -> dict[str, Any]:
    """The plain-data part of ``plan`` that ``device`` runs (see module docstring).

    Built once per plan geometry and device (kept in ``plan.parts``): read-only."""
    part = plan.parts.get(device)
    if part is None:
        part = plan.parts[device] = _build_part(plan, device)
    return part


def _build_part(plan: ReshardPlan, device: int) -> dict[str, Any]:
    target = plan.target
    tensors: dict[str, list] = {}
    if device in target.devices:
        for key, (shard, dtype) in target.shards_on(device).items():
            tensors[key] = [list(shard.shape), dtype]
    box = lambda b: [list(r) for r in b]  # noqa: E731
    keeps = [[k.src_emu, k.key] for k in plan.keeps if k.device == device]
    copies, sends, recvs = [], [], []
    for m in plan.moves:
        if m.is_local and m.dst_device == device:
            copies.append([m.src_emu, m.key, box(m.src_box), box(m.dst_box)])
        elif not m.is_local and m.src_device == device:
            sends.append([m.dst_device, m.src_emu, m.key, box(m.src_box)])
        elif not m.is_local and m.dst_device == device:
            recvs.append([m.src_device, m.key, box(m.dst_box)])
    return {
        "target": target.name,
        "device": device,
        "tensors": tensors,
        "keeps": keeps,
        "copies": copies,
        "sends": sends,
        "recvs": recvs,
    }


def _source(sources: Stores, emu: str, key: str, device: int) -> torch.Tensor:
    try:
        return sources[emu][key]
    except KeyError:
        raise StateError(f"device {device} has no tensor {key!r} of source EMU {emu!r}") from None


def _view(t: torch.Tensor, box, what: str) -> torch.Tensor:
    """``t``'s part in ``box`` (``t`` itself for a whole box). A part has hundreds of
    these before its first message: ``narrow`` per cut dimension is 3x cheaper than
    indexing with slices."""
    shape = t.shape
    if len(box) != len(shape):
        raise StateError(f"{what}: box {box} does not fit a tensor of shape {tuple(shape)}")
    out = t
    for dim, (lo, hi) in enumerate(box):
        n = shape[dim]
        if hi > n:
            raise StateError(f"{what}: box {box} does not fit a tensor of shape {tuple(shape)}")
        if lo or hi != n:
            out = out.narrow(dim, lo, hi - lo)
    return out


def _allocate(
    new: list[tuple[str, list[int], torch.dtype]],
    alloc: Callable[[int], torch.Tensor] | None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    if alloc is None or not new:
        return {key: torch.empty(shape, dtype=dtype, device=device) for key, shape, dtype in new}
    spans, total = [], 0  # (offset, bytes) of each new shard in the one buffer
    for _, shape, dtype in new:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        spans.append((total, nbytes))
        total += -(-nbytes // _ALIGN) * _ALIGN
    buf = alloc(total)
    return {
        key: buf[offset : offset + nbytes].view(dtype).view(shape)
        for (key, shape, dtype), (offset, nbytes) in zip(new, spans, strict=True)
    }


def _check_tensor(t: torch.Tensor, shape: list[int], dtype: str, what: str) -> None:
    if list(t.shape) != list(shape) or t.dtype != TORCH_DTYPES[dtype]:
        raise StateError(
            f"{what} has shape {tuple(t.shape)} {t.dtype}, the target needs {tuple(shape)} {dtype}"
        )


def run_part(
    part: Mapping[str, Any],
    sources: Stores,
    exchange: Exchange | None,
    *,
    alloc: Callable[[int], torch.Tensor] | None = None,
    local_in_exchange: bool = False,
    into: Mapping[str, torch.Tensor] | None = None,
    tensor_device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Build this device's target tensors from ``sources`` (emu name -> key -> tensor).

    Effects: allocates the target shards not kept (in one ``alloc`` buffer if given, else
    on ``tensor_device``: the worker's, so a GPU worker's targets are CUDA tensors) --
    or, with ``into`` (the target's existing tensors, key -> tensor), writes into those
    in place and allocates nothing; copies; one ``exchange`` call when the part sends or
    receives anything. Sources are read, never changed or freed."""
    device = part["device"]
    out: dict[str, torch.Tensor] = {}
    if into is not None:
        if part["keeps"]:
            raise StateError(
                f"a part writing into {part['target']!r} in place cannot keep source shards"
            )
        for key, (shape, dtype) in part["tensors"].items():
            if key not in into:
                raise StateError(
                    f"device {device}: {part['target']!r} has no tensor {key!r} to write into"
                )
            _check_tensor(
                into[key], shape, dtype, f"{key!r} of {part['target']!r} on device {device}"
            )
            out[key] = into[key]
    for src_emu, key in part["keeps"]:
        out[key] = _source(sources, src_emu, key, device)
    new = []
    for key, (shape, dtype) in part["tensors"].items():
        if key in out:
            _check_tensor(out[key], shape, dtype, f"kept {key!r} on device {device}")
            continue
        new.append((key, shape, TORCH_DTYPES[dtype]))
    out.update(_allocate(new, alloc, tensor_device))
    copies = []
    for src_emu, key, src_box, dst_box in part["copies"]:
        src = _view(_source(sources, src_emu, key, device), src_box, f"copy {key} from {src_emu}")
        copies.append((src, _view(out[key], dst_box, f"copy {key} into {part['target']}")))
    moving = bool(part["sends"] or part["recvs"])
    if not (moving and local_in_exchange):
        for src, dst in copies:
            copy_into(dst, src)
    sends: dict[int, list[torch.Tensor]] = defaultdict(list)
    recvs: dict[int, list[torch.Tensor]] = defaultdict(list)
    for peer, src_emu, key, src_box in part["sends"]:
        sends[peer].append(
            _view(_source(sources, src_emu, key, device), src_box, f"send {key} from {src_emu}")
        )
    # A target tensor that one receive fills whole is handed over as the tensor itself
    # (not a view of it), so an adopting exchange can make the received memory its
    # storage instead of copying into it.
    written = defaultdict(int, {key: 1 for _, key in part["keeps"]})
    for _, key, _, _ in part["copies"]:
        written[key] += 1
    for _, key, _ in part["recvs"]:
        written[key] += 1
    for peer, key, dst_box in part["recvs"]:
        view = _view(out[key], dst_box, f"receive {key} into {part['target']}")
        whole = into is None and written[key] == 1 and list(view.shape) == list(out[key].shape)
        recvs[peer].append(out[key] if whole else view)
    if sends or recvs:
        if exchange is None:
            raise StateError(f"device {device} must exchange tensors but was given no exchange")
        if local_in_exchange:
            exchange(dict(sends), dict(recvs), copies)
        else:
            exchange(dict(sends), dict(recvs))
    return out


def apply_plan(
    plan: ReshardPlan, stores: Mapping[int, Stores]
) -> dict[int, dict[str, torch.Tensor]]:
    """Run ``plan`` on in-memory stores (device -> emu name -> key -> tensor); returns
    device -> key -> tensor of the target. Sources are left as they were."""
    pending: dict[int, tuple[dict, dict]] = {}

    def exchange_of(device: int) -> Exchange:
        def record(sends, recvs):
            pending[device] = (sends, recvs)

        return record

    out = {}
    for device in plan.devices():
        out[device] = run_part(plan_part(plan, device), stores.get(device, {}), exchange_of(device))
    for a, (sends, _) in pending.items():
        for b, tensors in sends.items():
            theirs = pending.get(b, ({}, {}))[1].get(a, [])
            if len(theirs) != len(tensors):
                raise StateError(
                    f"device {a} sends {len(tensors)} tensors to {b}, which receives {len(theirs)}"
                )
            for src, dst in zip(tensors, theirs, strict=False):
                dst.copy_(src)
    return {d: t for d, t in out.items() if d in plan.target.devices}


def apply_step(step: Step, stores: dict[int, dict[str, dict[str, torch.Tensor]]]) -> None:
    """Run a primitive ``Step`` on in-memory stores (device -> emu -> key -> tensor):
    adds the EMUs it creates, then drops the EMUs it frees (only after every plan ran)."""
    for plan in step.plans:
        for device, tensors in apply_plan(plan, stores).items():
            stores.setdefault(device, {})[plan.target.name] = tensors
    for emu in step.freed:
        for device in emu.devices:
            stores.get(device, {}).pop(emu.name, None)
