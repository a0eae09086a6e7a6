"""What every built-in engine does the same way: build its stage over its weights, account
them against the device budget, expose them by name.

An engine holds one ``DecoderStage`` (this rank's TP shard of this PP stage's layers) and,
for a critic or reward model, the stage's ``ValueHead`` on the last stage. Its weights
come from one of two places:

Every engine evaluates forward-only (``logprobs``, ``values``, ``rewards``, in
micro-batches whose activations are reserved in the ledger while they run): the
inference engine's job, and a probe of what any EMU computes. Weights can be
overwritten in place by name (``load_named``). Device: the stage lives on
``ctx.device`` (CPU by default); batches are moved there and results come back as CPU
tensors (what crosses the wire). ``close()`` releases every reservation of the engine.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from nereus.config import require
from nereus.engines._pipeline import activation_bytes, forward_only, token_logprobs
from nereus.engines.context import EmuContext
from nereus.engines.losses import normalize_batch, split_batch
from nereus.engines.memory import device_ledger, tensors_bytes
from nereus.engines.options import EngineOptions
from nereus.errors import StateError
from nereus.models.config import ModelConfig
from nereus.models.decoder import DecoderStage, build_stage, torch_dtype
from nereus.models.parallel import ParallelContext

__all__ = ["EngineBase", "stage_param_bytes"]

log = logging.getLogger("nereus.engines")


def stage_param_bytes(
    config: ModelConfig, ctx: EmuContext, dtype: torch.dtype, value_head: bool = False
) -> int:
    """Bytes of this rank's stage parameters, computed on the meta device (no memory)."""
    meta = build_stage(config, ctx.parallel, dtype, device="meta", value_head=value_head)
    return tensors_bytes(meta.parameters())


class EngineBase:
    """Stage + optional value head + weight accounting (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: EmuContext | None = None,
        *,
        options: EngineOptions | None = None,
        value_head: bool = False,
        default_name: str = "engine",
    ) -> None:
        options = options or EngineOptions()
        name, tensors, model_dir = options.named(default_name), options.tensors, options.model_dir
        self.config = config
        self.ctx = ctx or EmuContext(ParallelContext())
        self.dtype = torch_dtype(options.dtype)
        self.name = name
        self.ledger = options.ledger or device_ledger()
        self.owns_weights = tensors is None
        require(
            not self.ledger.breakdown().keys()
            & {f"{name}/weights", f"{name}/grads", f"{name}/kv_cache"},
            "engine name",
            name,
            f"is already used by another engine on device {self.ledger.device}; give each "
            "engine its own name",
        )
        if self.owns_weights:
            self.ledger.reserve(
                f"{name}/weights", stage_param_bytes(config, self.ctx, self.dtype, value_head)
            )
        try:
            self.device = torch.device(self.ctx.device)
            if tensors is not None:
                self.stage: DecoderStage = build_stage(
                    config,
                    self.ctx.parallel,
                    self.dtype,
                    device=self.device,
                    value_head=value_head,
                    tensors=tensors,
                )
            else:
                torch.manual_seed(options.seed)
                self.stage = build_stage(
                    config, self.ctx.parallel, self.dtype, device=self.device, value_head=value_head
                )
                if model_dir is not None:
                    self._load(model_dir, value_head)
        except BaseException:
            self.ledger.release_prefix(f"{name}/")
            raise

    def _load(self, model_dir: str | Path, value_head: bool) -> None:
        from nereus.models.checkpoint import load_stage_weights

        # A value-head engine may load a policy's folder (no score head: the head starts at
        # zero) or a reward model's (a score head instead of an LM head, never used here).
        optional = ("lm_head.weight", "value_head.weight", "value_head.bias") if value_head else ()
        report = load_stage_weights(self.stage, model_dir, self.ctx.parallel, optional=optional)
        log.info("%s: loaded weights from %s (%s)", self.name, model_dir, report)

    @property
    def value_head(self):
        """The stage's value head (last stage of a critic or reward model), or None."""
        return None if self.stage is None else self.stage.value_head

    # --- forward-only evaluation (any engine: what its EMU computes) --------------------

    micro_batch_size = 16

    def _run(
        self, batch: dict[str, Any], head, output: str, micro_batch_size: int | None
    ) -> torch.Tensor:
        data = {k: v.to(self.device) for k, v in normalize_batch(batch).items()}
        mbs = split_batch(data, micro_batch_size or self.micro_batch_size)
        rows = mbs[0]["input_ids"].shape[0]
        need = activation_bytes(
            self.config, self.ctx, rows, data["input_ids"].shape[1], self.dtype, training=False
        )
        self.ledger.reserve(f"{self.name}/activations", need)
        try:
            return forward_only(self.stage, self.ctx, mbs, head, output=output).cpu()
        finally:
            self.ledger.release(f"{self.name}/activations")

    def logprobs(
        self, batch: dict[str, Any], temperature: float = 1.0, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """Per-token log-probabilities ``[B, T]`` float32: ``out[b, t] = log softmax(logits /
        temperature)[input_ids[b, t]]`` given the tokens before ``t`` (``out[:, 0] = 0``),
        computed vocab-parallel (never full logits)."""
        require(temperature > 0, "temperature", temperature, "must be > 0")

        def head(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            return token_logprobs(logits, mb["input_ids"], self.ctx, temperature)

        return self._run(batch, head, "logits", micro_batch_size)

    def values(self, batch: dict[str, Any], micro_batch_size: int | None = None) -> torch.Tensor:
        """Per-token values ``[B, T]`` from the value head."""
        require(
            self.value_head is not None or not self.ctx.is_last_stage,
            f"{self.name}.values",
            "no value head",
            "needs an engine of a critic or reward model (value_head=True)",
        )

        def head(hidden: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            assert self.value_head is not None
            return self.value_head(hidden)

        return self._run(batch, head, "hidden", micro_batch_size)

    def rewards(self, batch: dict[str, Any], micro_batch_size: int | None = None) -> torch.Tensor:
        """A reward model's score per row ``[B]``: the value head at the last real token."""
        data = normalize_batch(batch)
        values = self.values(data, micro_batch_size)
        last = data["attention_mask"].sum(dim=1).clamp(min=1) - 1
        return values.gather(1, last.unsqueeze(1)).squeeze(1)

    # --- weights by name --------------------------------------------------------------

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters by ModelSpec name (value head: ``value_head.*``)."""
        if self.stage is None:
            raise StateError(
                f"{self.name}: the engine is asleep and holds no weights (wake_up first)"
            )
        return dict(self.stage.named_parameters())

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
            raise StateError(
                f"{self.name}: no parameters named {unknown[:5]} on this rank "
                f"(pp_rank={self.ctx.pp_rank}, tp_rank={self.ctx.tp_rank})"
            )
        if strict:
            missing = sorted(set(params) - set(tensors))
            require(
                not missing,
                f"{self.name}.load_named",
                missing[:5],
                "strict load must give every parameter",
            )
        written = 0
        with torch.no_grad():
            for key, src in tensors.items():
                dst = params[key]
                if tuple(src.shape) != tuple(dst.shape):
                    raise StateError(
                        f"{self.name}: shard {key!r} has shape {tuple(src.shape)}, this rank "
                        f"holds {tuple(dst.shape)}"
                    )
                dst.copy_(src)
                written += src.numel() * src.element_size()
        return written

    def memory(self) -> dict[str, int]:
        """This engine's reservations on its device (bytes by key)."""
        prefix = f"{self.name}/"
        return {k: v for k, v in self.ledger.breakdown().items() if k.startswith(prefix)}

    def close(self) -> None:
        """Release every reservation of this engine (its tensors go with the object; a
        store's tensors stay the store's)."""
        self.ledger.release_prefix(f"{self.name}/")
