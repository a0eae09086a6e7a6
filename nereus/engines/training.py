"""The training engine: one optimizer step over a batch at any TP x PP x DP.

One ``TrainingEngine`` per rank of a training EMU (policy-training or critic-training);
every rank of the EMU gets the same batch; DP replicas (EMUs of the same model-stage)
each get their own slice of the global batch.

``train_step(batch, loss="module:function", loss_kwargs={}, micro_batch_size=None)``:

Returns metrics (floats): ``loss`` and the loss function's metrics (token-weighted means
over the global batch; complete on the last pipeline stage, the other stages return only
``grad_norm``, ``lr``, ``step``), ``grad_norm`` (before clipping), ``lr``, ``step``.

Refuses (``ConfigError``): a bad optimizer config, an unknown loss path, a batch that
breaks the batch format.

More (how it works): docs/engines.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from nereus.config import require
from nereus.engines._base import EngineBase
from nereus.engines._pipeline import (
    activation_bytes,
    forward_backward_1f1b,
    forward_backward_gpipe,
    in_flight_micro_batches,
    token_logprobs,
)
from nereus.engines.context import EmuContext
from nereus.engines.losses import normalize_batch, resolve_callable, split_batch
from nereus.engines.options import EngineOptions
from nereus.errors import StateError
from nereus.models.config import ModelConfig
from nereus.models.layers import ColumnParallelLinear, ShardedModule
from nereus.state.emu import tensor_key
from nereus.state.spec import grad_bytes_per_param, optimizer_bytes_per_param, optimizer_slots

__all__ = ["OptimConfig", "TrainingEngine", "MOMENTS", "adamw_kernel"]

log = logging.getLogger("nereus.engines")

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and clipping settings of a training engine. The job's ``[optim]`` section
    (``nereus.job.config.TrainingConfig``) is one of these plus the critic's learning
    rate and the micro-batch size."""

    FIELD: ClassVar[str] = "OptimConfig"  # what errors call these settings

    lr: float = 1e-5
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # the largest gradient norm; 0 = no clipping

    def __post_init__(self) -> None:
        f = self.FIELD
        require(self.lr > 0, f"{f}.lr", self.lr, "must be > 0")
        require(0 <= self.beta1 < 1, f"{f}.beta1", self.beta1, "must be in [0, 1)")
        require(0 <= self.beta2 < 1, f"{f}.beta2", self.beta2, "must be in [0, 1)")
        require(self.eps > 0, f"{f}.eps", self.eps, "must be > 0")
        require(self.weight_decay >= 0, f"{f}.weight_decay", self.weight_decay, "must be >= 0")
        require(self.grad_clip >= 0, f"{f}.grad_clip", self.grad_clip, "must be >= 0 (0 = off)")

    @classmethod
    def from_any(cls, value: OptimConfig | dict[str, Any] | None) -> OptimConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        from nereus.config import from_dict

        return from_dict(cls, dict(value), "optim")


def adamw_kernel(device: torch.device) -> dict[str, bool]:
    """How AdamW steps on ``device``: on CUDA with its multi-tensor kernels (``foreach``:
    a few launches per step instead of several per parameter; the step counters stay on
    the CPU, as torch keeps them); on CPU one parameter at a time, which is no slower
    there and allocates no temporaries for all parameters at once."""
    return {"foreach": device.type == "cuda"}


class TrainingEngine(EngineBase):
    """One rank of a training EMU (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: EmuContext | None = None,
        *,
        options: EngineOptions | None = None,
        step: int = 0,
        optim: OptimConfig | dict[str, Any] | None = None,
        critic: bool = False,
        schedule: str = "1f1b",
        recompute: bool = False,
    ) -> None:
        options = options or EngineOptions()
        self.optim_config = OptimConfig.from_any(optim)
        require(
            isinstance(recompute, bool),
            "TrainingEngine.recompute",
            recompute,
            "must be true or false",
        )
        self.recompute = recompute
        require(
            schedule in ("1f1b", "gpipe"),
            "TrainingEngine.schedule",
            schedule,
            "must be '1f1b' or 'gpipe'",
        )
        require(
            isinstance(step, int) and step >= 0,
            "TrainingEngine.step",
            step,
            "must be an integer >= 0",
        )
        self.schedule = schedule
        super().__init__(config, ctx, options=options, value_head=critic, default_name="training")
        name, tensors = self.name, options.tensors
        try:
            self.critic = critic
            self.stage.recompute_activations = recompute
            params = self.named_parameters()
            dtype_name = str(self.dtype).removeprefix("torch.")
            self.slots = optimizer_slots(dtype_name)
            numel = sum(p.numel() for p in params.values())
            self.ledger.reserve(f"{name}/grads", numel * grad_bytes_per_param(dtype_name))
            if self.owns_weights:
                self.ledger.reserve(
                    f"{name}/optimizer", numel * optimizer_bytes_per_param(dtype_name)
                )
            state = self._optimizer_state(params, tensors)
            # master copies (mixed precision) are what AdamW steps; else the parameters
            self._master = {
                k: torch.nn.Parameter(st["master"], requires_grad=False)
                for k, st in state.items()
                if "master" in st
            }
            stepped = [self._master.get(k, p) for k, p in params.items()]
            oc = self.optim_config
            self.optimizer = torch.optim.AdamW(
                stepped,
                lr=oc.lr,
                betas=(oc.beta1, oc.beta2),
                eps=oc.eps,
                weight_decay=oc.weight_decay,
                **adamw_kernel(stepped[0].device if stepped else torch.device("cpu")),
            )
            for (k, _), p in zip(params.items(), stepped, strict=True):
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(step)),
                    "exp_avg": state[k]["exp_avg"],
                    "exp_avg_sq": state[k]["exp_avg_sq"],
                }
            self._norm_weights = self._grad_norm_weights()
            self.step = step
            self.stage.train()
        except BaseException:
            self.close()
            raise

    def _optimizer_state(
        self, params: dict[str, torch.nn.Parameter], tensors: Mapping[str, torch.Tensor] | None
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Per parameter, its optimizer slots: the store's (checked), or new ones."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in params.items():
            slots: dict[str, torch.Tensor] = {}
            for slot in self.slots:
                key = tensor_key(slot, name)
                if tensors is not None:
                    t = tensors.get(key)
                    if t is None:
                        raise StateError(
                            f"{self.name}: the shard store holds no {key!r} (a training EMU "
                            f"of dtype {self.dtype} needs slots {list(self.slots)})"
                        )
                    if tuple(t.shape) != tuple(p.shape) or t.dtype != torch.float32:
                        raise StateError(
                            f"{self.name}: {key!r} is {tuple(t.shape)} {t.dtype}, "
                            f"expected {tuple(p.shape)} torch.float32"
                        )
                elif slot == "master":
                    t = p.detach().float().clone()
                else:
                    t = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                slots[slot] = t
            out[name] = slots
        return out

    # --- gradient norm bookkeeping ------------------------------------------------

    def _grad_norm_weights(self) -> dict[str, torch.Tensor | float]:
        """Per parameter, how much of its squared norm this rank contributes so that the
        all-reduced sum counts every global element once: 1 for split tensors, 1/tp for
        replicated ones, per-row 1/replicas for replicated k/v rows, 0 for the last
        stage's copy of a tied embedding."""
        tp = self.ctx.tp_size
        weights: dict[str, torch.Tensor | float] = {}
        for mod_name, module in self.stage.named_modules():
            if not isinstance(module, ShardedModule):
                continue
            for local, (rule, _) in module.shard_rules.items():
                full = f"{mod_name}.{local}" if mod_name else local
                if rule == "replicated":
                    weights[full] = 1.0 / tp
                elif isinstance(module, ColumnParallelLinear) and any(
                    tp > c.units for c in module.components
                ):
                    rows = torch.cat(
                        [
                            torch.full(
                                (size,),
                                1.0 / (tp // c.units) if tp > c.units else 1.0,
                                device=self.device,
                            )
                            for c, size in zip(module.components, module.local_sizes, strict=True)
                        ]
                    )
                    weights[full] = rows
                else:
                    weights[full] = 1.0
        tied = self.config.tie_word_embeddings and self.ctx.pp_size > 1
        if tied and self.ctx.is_last_stage and not self.ctx.is_first_stage:
            weights["model.embed_tokens.weight"] = 0.0
        return weights

    def _global_grad_norm(self, params: dict[str, torch.nn.Parameter]) -> float:
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for name, p in params.items():
            if p.grad is None:
                continue
            w = self._norm_weights.get(name, 1.0)
            sq = p.grad.double().pow(2)
            if isinstance(w, torch.Tensor):
                total += (
                    (sq.sum(dim=tuple(range(1, sq.dim()))) * w.double()).sum()
                    if sq.dim() > 1
                    else (sq * w.double()).sum()
                )
            else:
                total += sq.sum() * w
        self.ctx.tp_all_reduce(total)
        self.ctx.pp_all_reduce(total)
        return math.sqrt(float(total))

    # --- the step -----------------------------------------------------------------

    def _reduce_grads(self, params: dict[str, torch.nn.Parameter]) -> None:
        ctx = self.ctx
        self.stage.reduce_replicated_grads()
        if (
            self.config.tie_word_embeddings
            and ctx.pp_size > 1
            and (ctx.is_first_stage or ctx.is_last_stage)
        ):
            emb = params["model.embed_tokens.weight"]
            if emb.grad is None:
                emb.grad = torch.zeros_like(emb)
            ctx.exchange_first_last(emb.grad)
        if ctx.dp_size > 1:
            # Parameters without a gradient (a critic's unused LM head) have none on every
            # replica alike: leave them out rather than decay them with a zero gradient.
            grads = [p.grad for p in params.values() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            ctx.dp_all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def train_step(
        self,
        batch: dict[str, Any],
        loss: str = "nereus.engines.losses:nll_loss",
        loss_kwargs: dict[str, Any] | None = None,
        micro_batch_size: int | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (see the module docstring)."""
        require(temperature > 0, "temperature", temperature, "must be > 0")
        loss_fn = resolve_callable(loss, "loss")
        kwargs = dict(loss_kwargs or {})
        data = {k: v.to(self.device) for k, v in normalize_batch(batch).items()}
        rows, length = data["input_ids"].shape
        require(
            rows >= 1,
            "batch.input_ids",
            tuple(data["input_ids"].shape),
            "must hold at least one row",
        )
        mbs = split_batch(data, micro_batch_size or rows)
        ctx = self.ctx
        # Token weights over the global batch (all DP replicas).
        counts = torch.tensor([float(mb["response_mask"].sum()) for mb in mbs], dtype=torch.float64)
        total = counts.sum().reshape(1).to(self.device)
        ctx.dp_all_reduce(total)
        scale = (counts / total.cpu().clamp(min=1.0)).tolist()
        sums: dict[str, float] = {}

        def loss_of(out: torch.Tensor, mb: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            if self.critic:
                assert self.value_head is not None
                outputs = {"values": self.value_head(out)}
            else:
                outputs = {"logprobs": token_logprobs(out, mb["input_ids"], ctx, temperature)}
            value, metrics = loss_fn(outputs, mb, **kwargs)
            require(
                isinstance(value, torch.Tensor) and value.dim() == 0,
                f"loss {loss}",
                type(value).__name__,
                "must return a scalar tensor first",
            )
            sums["loss"] = sums.get("loss", 0.0) + float(value.detach()) * scale[i]
            for key, v in (metrics or {}).items():
                sums[key] = sums.get(key, 0.0) + float(v) * scale[i]
            return value * scale[i]

        params = self.named_parameters()
        for p in params.values():
            p.grad = None
        held = in_flight_micro_batches(ctx, len(mbs), self.schedule)
        need = (
            activation_bytes(
                self.config,
                ctx,
                mbs[0]["input_ids"].shape[0],
                length,
                self.dtype,
                training=True,
                recompute=self.recompute,
            )
            * held
        )
        self.ledger.reserve(f"{self.name}/activations", need)
        run = forward_backward_1f1b if self.schedule == "1f1b" else forward_backward_gpipe
        try:
            run(self.stage, ctx, mbs, loss_of, output="hidden" if self.critic else "logits")
        finally:
            self.ledger.release(f"{self.name}/activations")
        self._reduce_grads(params)
        grad_norm = self._global_grad_norm(params)
        max_norm = self.optim_config.grad_clip
        if not math.isfinite(grad_norm):
            raise StateError(
                f"{self.name}: gradient norm is {grad_norm} at step {self.step}; the step was "
                "not applied"
            )
        if max_norm > 0 and grad_norm > max_norm:
            coef = max_norm / (grad_norm + 1e-6)
            for p in params.values():
                if p.grad is not None:
                    p.grad.mul_(coef)
        for name, master in self._master.items():
            grad = params[name].grad
            master.grad = None if grad is None else grad.float()
        self.optimizer.step()
        if self._master:
            with torch.no_grad():
                for name, master in self._master.items():
                    params[name].copy_(master)
                    master.grad = None
        self.step += 1
        result = {
            "grad_norm": grad_norm,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "step": float(self.step),
        }
        if ctx.is_last_stage:
            keys = sorted(sums)
            packed = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
            ctx.dp_all_reduce(packed)
            result.update(dict(zip(keys, packed.cpu().tolist(), strict=True)))
        return result

    # --- state for the state layer ---------------------------------------------------

    def named_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and optimizer slots by state-layer key (views)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters().items():
            out[name] = p.detach()
            stepped = self._master.get(name, p)
            state = self.optimizer.state[stepped]
            for m in MOMENTS:
                out[tensor_key(m, name)] = state[m]
            if name in self._master:
                out[tensor_key("master", name)] = self._master[name].detach()
        return out

    def load_named_state(self, tensors: dict[str, torch.Tensor], step: int | None = None) -> int:
        """Write parameters and/or optimizer slots in place (shapes checked); returns bytes
        written."""
        params = self.named_parameters()
        plain = {k: v for k, v in tensors.items() if k in params}
        written = self.load_named(plain)
        current = self.named_state()
        with torch.no_grad():
            for key, src in tensors.items():
                if key in params:
                    continue
                dst = current.get(key)
                if dst is None:
                    raise StateError(f"{self.name}: no state named {key!r} on this rank")
                if tuple(src.shape) != tuple(dst.shape):
                    raise StateError(
                        f"{self.name}: state {key!r} has shape {tuple(src.shape)}, this rank "
                        f"holds {tuple(dst.shape)}"
                    )
                dst.copy_(src)
                written += src.numel() * src.element_size()
        if step is not None:
            self.set_step(step)
        return written

    def set_step(self, step: int) -> None:
        """Set the update counter (AdamW's bias correction follows it)."""
        require(step >= 0, "step", step, "must be >= 0")
        self.step = int(step)
        for p in self.optimizer.state:
            self.optimizer.state[p]["step"].fill_(float(step))
