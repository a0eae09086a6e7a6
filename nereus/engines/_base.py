"""What every built-in engine does the same way: build its stage, load or receive weights,
account them against the device budget, expose them by name.

An engine holds one ``DecoderStage`` (this rank's TP shard of this PP stage's layers) and,
for a critic or reward model, a ``ValueHead`` on the last stage. Weights come from a Hugging
Face directory (``model_dir``: each rank reads only its slices) or start random from
``seed`` (only meaningful at TP 1, PP 1, where the shard is the whole model), and can be
overwritten in place by name (``load_named``), which is how the state layer and the
weight sync deliver new shards. A value-head engine also reads a sequence-classification
checkpoint's ``score`` head into its value head (a reward model), and tolerates the folder
having no ``lm_head.weight``.

Device: the stage lives on ``ctx.device`` (CPU by default); batches are moved there and
results come back as CPU tensors (what crosses the wire).

Memory: the stage's parameter bytes are reserved in the device's ``MemoryLedger`` under
``"<name>/weights"`` *before* the stage is built, so an engine that does not fit raises
``OutOfMemory`` instead of allocating. ``close()`` releases every reservation of the engine.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from nereus.config import require
from nereus.engines._pipeline import ValueHead
from nereus.engines.context import EmuContext
from nereus.engines.memory import MemoryLedger, device_ledger, tensors_bytes
from nereus.errors import StateError
from nereus.models.config import ModelConfig
from nereus.models.decoder import DecoderStage, build_stage, torch_dtype
from nereus.models.parallel import ParallelContext

__all__ = ["EngineBase", "stage_param_bytes"]

log = logging.getLogger("nereus.engines")


def stage_param_bytes(config: ModelConfig, ctx: EmuContext, dtype: torch.dtype, value_head: bool = False) -> int:
    """Bytes of this rank's stage parameters, computed on the meta device (no memory)."""
    meta = build_stage(config, ctx.parallel, dtype, device="meta")
    total = tensors_bytes(meta.parameters())
    if value_head and ctx.is_last_stage:
        total += (config.hidden_size + 1) * torch.empty((), dtype=dtype).element_size()
    return total


class EngineBase:
    """Stage + optional value head + weight accounting (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: EmuContext | None = None,
        *,
        model_dir: str | Path | None = None,
        dtype: str | torch.dtype = "float32",
        value_head: bool = False,
        seed: int = 0,
        ledger: MemoryLedger | None = None,
        name: str = "engine",
    ) -> None:
        self.config = config
        self.ctx = ctx or EmuContext(ParallelContext())
        self.dtype = torch_dtype(dtype)
        self.name = name
        self.ledger = ledger or device_ledger()
        require(
            self.ledger.held(f"{name}/weights") == 0,
            "engine name",
            name,
            f"is already used by another engine on device {self.ledger.device}; give each engine its own name",
        )
        self.ledger.reserve(f"{name}/weights", stage_param_bytes(config, self.ctx, self.dtype, value_head))
        try:
            torch.manual_seed(seed)
            self.device = torch.device(self.ctx.device)
            self.stage: DecoderStage = build_stage(config, self.ctx.parallel, self.dtype, device=self.device)
            self.value_head: ValueHead | None = None
            if value_head and self.ctx.is_last_stage:
                self.value_head = ValueHead(config.hidden_size, self.dtype).to(self.device)
            if model_dir is not None:
                from nereus.models.checkpoint import load_stage_weights, read_score_head

                # A value-head engine may load a reward model's folder, which has a score
                # head instead of an LM head; the LM head it builds is then never used.
                optional = ("lm_head.weight",) if value_head else ()
                report = load_stage_weights(self.stage, model_dir, self.ctx.parallel, optional=optional)
                log.info("%s: loaded weights from %s (%s)", name, model_dir, report)
                if self.value_head is not None:
                    head = read_score_head(model_dir, config.hidden_size)
                    if head:
                        with torch.no_grad():
                            self.value_head.weight.copy_(head["weight"].to(self.dtype))
                            self.value_head.bias.copy_(head["bias"].to(self.dtype))
        except BaseException:
            self.ledger.release_prefix(f"{name}/")
            raise

    # --- weights by name --------------------------------------------------------------

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters by ModelSpec name (value head: ``value_head.*``)."""
        if self.stage is None:
            raise StateError(f"{self.name}: the engine is asleep and holds no weights (wake_up first)")
        params = dict(self.stage.named_parameters())
        if self.value_head is not None:
            params.update({f"value_head.{k}": v for k, v in self.value_head.named_parameters()})
        return params

    def named_weights(self) -> dict[str, torch.Tensor]:
        """This rank's weight shards by name (detached views, not copies)."""
        return {k: v.detach() for k, v in self.named_parameters().items()}

    def load_named(self, tensors: dict[str, torch.Tensor], strict: bool = False) -> int:
        """Copy shards into this rank's parameters in place; returns the bytes written.

        Every name must be a parameter of this rank with the same shape (``StateError``
        otherwise); with ``strict`` every parameter must be given."""
        params = self.named_parameters()
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise StateError(f"{self.name}: no parameters named {unknown[:5]} on this rank (pp_rank={self.ctx.pp_rank}, tp_rank={self.ctx.tp_rank})")
        if strict:
            missing = sorted(set(params) - set(tensors))
            require(not missing, f"{self.name}.load_named", missing[:5], "strict load must give every parameter")
        written = 0
        with torch.no_grad():
            for key, src in tensors.items():
                dst = params[key]
                if tuple(src.shape) != tuple(dst.shape):
                    raise StateError(f"{self.name}: shard {key!r} has shape {tuple(src.shape)}, this rank holds {tuple(dst.shape)}")
                dst.copy_(src)
                written += src.numel() * src.element_size()
        return written

    def memory(self) -> dict[str, int]:
        """This engine's reservations on its device (bytes by key)."""
        prefix = f"{self.name}/"
        return {k: v for k, v in self.ledger.breakdown().items() if k.startswith(prefix)}

    def close(self) -> None:
        """Release every reservation of this engine (its tensors go with the object)."""
        self.ledger.release_prefix(f"{self.name}/")
