"""Hugging Face checkpoints: read this rank's slices into a stage, write a full model.

Names: nereus fuses q/k/v (``self_attn.qkv_proj``) and gate/up (``mlp.gate_up_proj``);
Hugging Face stores them separately (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``,
``up_proj``). Every other name is the same on both sides (see ``nereus.models.decoder``).

``load_stage_weights(stage, model_dir)`` promises:
- reads ``model.safetensors`` or, when present, the sharded index
  ``model.safetensors.index.json`` (any single ``*.safetensors`` file also works);
- reads only the slices this TP rank holds, with safetensors' slice API
  (``safe_open(...).get_slice(name)[rows]`` / ``[:, cols]``), and only the tensors of this
  pipeline stage: never a whole model, never a tensor another rank owns (replicated
  tensors -- norms, row-parallel biases -- are read whole, as every rank holds them);
- handles tied embeddings (``lm_head.weight`` may be absent; the head borrows the
  embedding) and GQA kv replication (``tp > num_key_value_heads``: each rank reads the
  one kv head it replicates);
- checks every tensor's global shape against the stage's config, converts dtype, and
  returns a ``LoadReport`` (bytes and tensors read).

Refuses (``ConfigError``): a directory with no safetensors, a missing tensor (unless the
caller lists it as ``optional``: a reward model's folder has no ``lm_head.weight``), a
tensor whose shape disagrees with the config -- naming the tensor, the file, the shapes.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nereus.errors import ConfigError, StateError
from nereus.models.decoder import DecoderStage, torch_dtype
from nereus.models.layers import ShardedModule, component_range
from nereus.models.parallel import ParallelContext

__all__ = [
    "LoadReport",
    "load_stage_weights",
    "read_score_head",
    "save_checkpoint",
    "hf_state_dict",
    "hf_tensor_names",
    "INDEX_FILE",
    "SINGLE_FILE",
]

log = logging.getLogger("nereus.models")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Fused nereus module -> the Hugging Face modules of its components, in row order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_tensor_names(name: str) -> list[str]:
    """The Hugging Face tensor(s) a nereus parameter is made of, in row order (a value
    head is a sequence classifier's ``score`` head)."""
    if name.startswith("value_head."):
        return ["score." + name.removeprefix("value_head.")]
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        return [".".join([*parts[:-2], hf, parts[-1]]) for hf in _FUSED[parts[-2]]]
    return [name]


@dataclass
class LoadReport:
    """What one ``load_stage_weights`` call read."""

    params: int = 0
    tensors_read: int = 0
    bytes_read: int = 0
    files: list[str] = field(default_factory=list)


class _CheckpointReader:
    """Tensor name -> file, and sliced reads through safetensors' slice API."""

    def __init__(self, model_dir: Path, stack: ExitStack) -> None:
        self.dir = model_dir
        self._stack = stack
        self._handles: dict[str, Any] = {}
        self.report = LoadReport()
        index = model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ConfigError(
                    f"{str(index)!r} is not a safetensors index (needs a 'weight_map'): {e}"
                ) from None
            self.files = dict(weight_map)
            return
        single = model_dir / SINGLE_FILE
        candidates = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
        if len(candidates) != 1:
            raise ConfigError(
                f"model_dir={str(model_dir)!r} must hold {SINGLE_FILE}, {INDEX_FILE} or "
                "exactly one "
                f"*.safetensors file; found {[p.name for p in candidates]}"
            )
        handle = self._open(candidates[0].name)
        self.files = {name: candidates[0].name for name in handle.keys()}

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            path = self.dir / file
            if not path.is_file():
                raise ConfigError(
                    f"checkpoint file {str(path)!r} (named by {INDEX_FILE}) does not exist"
                )
            self._handles[file] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            self.report.files.append(file)
        return self._handles[file]

    def has(self, name: str) -> bool:
        return name in self.files

    def read(
        self,
        name: str,
        expected: tuple[int, ...],
        dim: int | None = None,
        start: int = 0,
        stop: int = 0,
    ) -> torch.Tensor:
        """Tensor ``name`` (global shape must be ``expected``), or its ``[start, stop)``
        range along ``dim``; only those bytes are read."""
        if name not in self.files:
            raise ConfigError(f"checkpoint in {str(self.dir)!r} has no tensor {name!r}")
        sl = self._open(self.files[name]).get_slice(name)
        shape = tuple(sl.get_shape())
        if shape != tuple(expected):
            raise ConfigError(
                f"checkpoint tensor {name!r} in {self.files[name]!r} has shape {shape}, "
                f"but the model config expects {tuple(expected)}"
            )
        if dim is None:
            tensor = sl[:]
        elif dim == 0:
            tensor = sl[start:stop]
        else:
            tensor = sl[:, start:stop]
        self.report.tensors_read += 1
        self.report.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def _read_param(
    reader: _CheckpointReader, module: ShardedModule, local: str, name: str, pc: ParallelContext
) -> torch.Tensor:
    rule, components = module.shard_rules[local]
    shape = module.global_shapes[local]
    sources = hf_tensor_names(name)
    if rule == "replicated":
        return reader.read(sources[0], shape)
    if rule == "row":
        start, stop = component_range(shape[1], shape[1], pc.tp_rank, pc.tp_size, name)
        return reader.read(sources[0], shape, 1, start, stop)
    # column or vocab: split along dim 0, per component when fused
    comps = [(c.size, c.units) for c in components] or [(shape[0], shape[0])]
    if len(sources) != len(comps):
        raise StateError(
            f"{name!r} has {len(comps)} components but maps to {len(sources)} checkpoint tensors"
        )
    pieces = []
    for src, (size, units) in zip(sources, comps, strict=True):
        start, stop = component_range(size, units, pc.tp_rank, pc.tp_size, f"{name}:{src}")
        pieces.append(reader.read(src, (size, *shape[1:]), 0, start, stop))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def load_stage_weights(
    stage: DecoderStage,
    model_dir: str | Path,
    parallel_ctx: ParallelContext | None = None,
    optional: Collection[str] = (),
) -> LoadReport:
    """Fill every parameter of ``stage`` with its slice of the checkpoint in ``model_dir``.

    ``parallel_ctx`` defaults to the one the stage was built with (and must agree with it).
    Parameters named in ``optional`` that the checkpoint lacks keep their initial values."""
    pc = parallel_ctx or stage.pc
    if (pc.tp_rank, pc.tp_size, pc.pp_rank, pc.pp_size) != (
        stage.pc.tp_rank,
        stage.pc.tp_size,
        stage.pc.pp_rank,
        stage.pc.pp_size,
    ):
        raise ConfigError(f"parallel_ctx={pc!r} disagrees with the stage's {stage.pc!r}")
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"model_dir={str(model_dir)!r} is not a directory")
    with ExitStack() as stack, torch.no_grad():
        reader = _CheckpointReader(model_dir, stack)
        for module_name, module in stage.named_modules():
            for local, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{local}" if module_name else local
                if not isinstance(module, ShardedModule):
                    raise StateError(
                        f"parameter {name!r} is owned by {type(module).__name__}, which "
                        "declares no shard rule"
                    )
                if name in optional and not all(reader.has(src) for src in hf_tensor_names(name)):
                    continue
                tensor = _read_param(reader, module, local, name, pc)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise StateError(
                        f"{name!r}: read a shard of shape {tuple(tensor.shape)} for a "
                        f"parameter of shape {tuple(param.shape)}"
                    )
                param.copy_(tensor.to(param.dtype))
                reader.report.params += 1
        report = reader.report
    log.info(
        "loaded %d parameters (%.1f MiB) for tp %d/%d pp %d/%d from %s",
        report.params,
        report.bytes_read / 2**20,
        pc.tp_rank,
        pc.tp_size,
        pc.pp_rank,
        pc.pp_size,
        model_dir,
    )
    return report


def read_score_head(model_dir: str | Path, hidden_size: int) -> dict[str, torch.Tensor]:
    """``{"weight": [1, hidden], "bias": [1]}`` of a sequence-classification checkpoint's
    ``score`` head (a missing bias reads as zero), or ``{}`` when there is none."""
    model_dir = Path(model_dir)
    with ExitStack() as stack:
        reader = _CheckpointReader(model_dir, stack)
        if not reader.has("score.weight"):
            return {}
        weight = reader.read("score.weight", (1, hidden_size))
        bias = (
            reader.read("score.bias", (1,))
            if reader.has("score.bias")
            else torch.zeros(1, dtype=weight.dtype)
        )
    return {"weight": weight, "bias": bias}


def hf_state_dict(model: DecoderStage) -> dict[str, torch.Tensor]:
    """A whole model's weights under Hugging Face names (fused tensors split)."""
    if model.pc.tp_size != 1 or model.pc.pp_size != 1:
        raise StateError(
            f"hf_state_dict needs the whole model (tp=1, pp=1), got tp={model.pc.tp_size} "
            f"pp={model.pc.pp_size}"
        )
    out: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            sources = hf_tensor_names(name)
            if len(sources) == 1:
                out[name] = param.detach().contiguous()
                continue
            _, components = module.shard_rules[local]
            for src, piece in zip(
                sources,
                torch.split(param.detach(), [c.size for c in components], dim=0),
                strict=True,
            ):
                out[src] = piece.contiguous()
    return out


def save_checkpoint(
    model: DecoderStage,
    directory: str | Path,
    max_shard_bytes: int | None = None,
    dtype: str | None = None,
) -> Path:
    """Write ``model`` (TP 1, PP 1) as a Hugging Face folder: config.json plus
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards and the index
    when ``max_shard_bytes`` is given. Returns the directory."""
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = torch_dtype(dtype) if dtype else None
    tensors = {k: (v.to(target) if target else v).clone() for k, v in hf_state_dict(model).items()}
    config = model.config
    if dtype:
        config = config.replace(torch_dtype=dtype)
    config.save(out_dir)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(out_dir / SINGLE_FILE), metadata=meta)
        return out_dir
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata=meta)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir
