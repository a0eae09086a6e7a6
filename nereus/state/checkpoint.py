"""The checkpoint fallback: a model-stage's whole logical state on disk, in any layout.

A checkpoint directory holds one safetensors file per position (pp_rank, tp_rank) of
the replica that was saved, with the tensors that position is the first to hold (a
replicated norm, a GQA-replicated kv head or a tied embedding is written once), and
``manifest.json``: the model-stage, the parameters' names, shapes and dtypes, the
layout, the slots and the logical state (update counter, policy version, sample
position). The manifest is written last and atomically: a directory without one is
not a checkpoint.

- ``save_shards(directory, emu, device, tensors)``: one device writes its file (workers
  call this in parallel); ``write_manifest(directory, emu)`` completes the checkpoint.
- ``load_shards(directory, target, device)``: the tensors ``device`` holds in EMU
  ``target`` -- any layout, any devices: each target piece is read as slices of the
  saved files by box intersection, so nothing is read twice or gathered anywhere.
- ``save_checkpoint``/``load_checkpoint``: the same for every device of one process's
  in-memory stores.

Refuses (``StateError``): a directory that is not a complete checkpoint, a target
whose model (parameter names, shapes, slots) differs from the saved one, a tensor whose
shape or dtype does not match its shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nereus.errors import StateError
from nereus.state.apply import TORCH_DTYPES, box_slices
from nereus.state.emu import EMU, LogicalState, split_key
from nereus.state.layout import Box, Layout, box_intersect, box_subtract, param_shard

__all__ = [
    "MANIFEST",
    "save_shards",
    "write_manifest",
    "read_manifest",
    "load_shards",
    "save_checkpoint",
    "load_checkpoint",
]

MANIFEST = "manifest.json"
FORMAT = 1


def _file_name(pp_rank: int, tp_rank: int) -> str:
    return f"shard-pp{pp_rank}-tp{tp_rank}.safetensors"


def _written_keys(emu: EMU, device: int) -> list[str]:
    """Keys ``device`` writes: those no earlier position of ``emu`` holds identically."""
    index = emu.devices.index(device)
    earlier = [emu.shards_on(d) for d in emu.devices[:index]]
    out = []
    for key, (shard, _) in emu.shards_on(device).items():
        if not any(key in held and held[key][0] == shard for held in earlier):
            out.append(key)
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_shards(
    directory: str | Path,
    emu: EMU,
    device: int,
    tensors: Mapping[str, torch.Tensor],
    *,
    durable: bool = True,
) -> Path:
    """Write the shards ``device`` holds in ``emu`` that no earlier position holds.

    ``durable``: fsync the file before it takes its name (a fallback checkpoint must
    survive the machine, not only the process)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pp_rank, tp_rank = emu.position(device)
    out: dict[str, torch.Tensor] = {}
    shards = emu.shards_on(device)
    for key in _written_keys(emu, device):
        t = tensors.get(key)
        shard, dtype = shards[key]
        if t is None or tuple(t.shape) != shard.shape or t.dtype != TORCH_DTYPES[dtype]:
            got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise StateError(
                f"save {emu.name} device {device}: {key} is {got}, expected {shard.shape} {dtype}"
            )
        out[key] = (
            t.detach().cpu().contiguous()
        )  # a GPU worker's shards are written from host copies
    path = directory / _file_name(pp_rank, tp_rank)
    tmp = path.with_suffix(".tmp")
    save_file(out, str(tmp))
    if durable:
        _fsync(tmp)
    os.replace(tmp, path)
    return path


def write_manifest(directory: str | Path, emu: EMU, *, durable: bool = True) -> Path:
    """Complete a checkpoint of ``emu`` whose shard files are written."""
    directory = Path(directory)
    files = []
    for i, device in enumerate(emu.devices):
        pp_rank, tp_rank = emu.layout.position(i)
        name = _file_name(pp_rank, tp_rank)
        if not (directory / name).exists():
            raise StateError(f"checkpoint {directory}: shard file {name} of {emu.name} is missing")
        files.append(
            {
                "pp_rank": pp_rank,
                "tp_rank": tp_rank,
                "file": name,
                "keys": _written_keys(emu, device),
            }
        )
    manifest = {
        "format": FORMAT,
        "model_stage": emu.model_stage,
        "model": emu.spec.name,
        "params": [[p.name, list(p.shape), p.dtype] for p in emu.spec.params],
        "layout": {"tp": emu.layout.tp, "pp": emu.layout.pp, "cuts": list(emu.layout.cuts)},
        "slots": list(emu.slots),
        "state": {
            "update_count": emu.state.update_count,
            "policy_version": emu.state.policy_version,
            "sample_position": emu.state.sample_position,
        },
        "files": files,
    }
    path = directory / MANIFEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    if durable:
        _fsync(tmp)
    os.replace(tmp, path)
    if durable:
        _fsync(directory)
    return path


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise StateError(f"{directory} is not a complete checkpoint: {MANIFEST} is missing")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise StateError(
            f"checkpoint {directory}: format={manifest.get('format')!r}, expected {FORMAT}"
        )
    return manifest


def _check_model(manifest: dict, target: EMU, directory) -> None:
    saved = [tuple((n, tuple(s), d)) for n, s, d in manifest["params"]]
    mine = [(p.name, tuple(p.shape), p.dtype) for p in target.spec.params]
    if saved != mine:
        diff = sorted(set(saved) ^ set(mine))[:3]
        raise StateError(
            f"checkpoint {directory} holds another model than {target.name}'s: e.g. {diff}"
        )
    missing = [s for s in target.slots if s not in manifest["slots"]]
    if missing:
        raise StateError(
            f"checkpoint {directory} has no {missing} for {target.name} (saved {manifest['slots']})"
        )


def load_shards(directory: str | Path, target: EMU, device: int) -> dict[str, torch.Tensor]:
    """The tensors ``device`` holds in ``target``, read from the checkpoint."""
    manifest = read_manifest(directory)
    _check_model(manifest, target, directory)
    lay = manifest["layout"]
    saved = Layout(lay["tp"], lay["pp"], tuple(lay["cuts"]))
    # key -> [(file, saved shard)] of every file that holds it
    holders: dict[str, list] = {}
    for f in manifest["files"]:
        for key in f["keys"]:
            param = target.spec[split_key(key)[1]]
            holders.setdefault(key, []).append(
                (f["file"], param_shard(param, saved.tp, f["tp_rank"]))
            )
    out: dict[str, torch.Tensor] = {}
    handles: dict[str, object] = {}
    try:
        for key, (shard, dtype) in target.shards_on(device).items():
            t = torch.empty(shard.shape, dtype=TORCH_DTYPES[dtype])
            for piece in shard.pieces:
                need: list[Box] = [piece.box]
                for fname, saved_shard in holders.get(key, []):
                    for sp in saved_shard.pieces:
                        still = []
                        for box in need:
                            inter = box_intersect(box, sp.box)
                            if inter is None:
                                still.append(box)
                                continue
                            if fname not in handles:
                                handles[fname] = safe_open(
                                    str(Path(directory) / fname), framework="pt"
                                )
                            src = handles[fname].get_slice(key)[box_slices(sp.to_local(inter))]  # type: ignore[attr-defined]
                            t[box_slices(piece.to_local(inter))] = src
                            still.extend(box_subtract(box, inter))
                        need = still
                if need:
                    raise StateError(f"checkpoint {directory} lacks {key} box {list(need[0])}")
            out[key] = t
    finally:
        handles.clear()
    return out


def save_checkpoint(
    directory: str | Path, emu: EMU, stores: Mapping[int, Mapping[str, torch.Tensor]]
) -> Path:
    """Save ``emu`` from in-memory stores (device -> key -> tensor); returns the manifest."""
    for device in emu.devices:
        save_shards(directory, emu, device, stores[device])
    return write_manifest(directory, emu)


def load_checkpoint(
    directory: str | Path, target: EMU
) -> tuple[dict[int, dict[str, torch.Tensor]], EMU]:
    """Load every device of ``target``; returns the stores and ``target`` carrying the
    saved logical state."""
    state = LogicalState(**read_manifest(directory)["state"])
    return {d: load_shards(directory, target, d) for d in target.devices}, target.with_(state=state)
