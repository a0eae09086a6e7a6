"""Model-stages as EMUs on an embedded local cluster, placed by the job's static plan.

``ClusterStages.start(cfg, model_config, model_dir)`` starts ``Cluster.local`` with
``cluster.devices`` CPU worker processes of ``cluster.memory_per_device`` each (or, with
``cluster.mode = "connect"``, attaches to the running cluster at ``cluster.address``, whose
workers outlive the job: closing stops only the job's actors), and for
every model-stage of the plan spawns one ``StageActor`` mesh per EMU (DP replica) on
the devices the plan lists. Model-stages that share a device run in the same worker
process: their calls are serialized there and their memory is accounted on the same
ledger: weights of idle model-stages stay co-resident; a generation EMU that shares a
device with a training model-stage gives its KV cache back after each generation.

Work distribution (all ``ModelStages`` calls, ``nereus.rl.stages``):
- generation: prompts cut into ``dp`` contiguous chunks, one per EMU, all concurrently;
  EMU ``i`` samples with seed ``seed + i`` so replicas never repeat each other;
- reference and critic inference: the batch's rows cut the same way;
- training: rows cut across the DP replicas; the engines weight each micro-batch by its
  share of the global token count and all-reduce gradients over the DP group, so DP
  gives the gradient of one token-mean loss over the whole batch.

Weight sync (``sync_policy``): policy-training's EMUs are the sources and each
policy-generation EMU a target of a ``nereus.state.plan_reshard`` plan (bytes already
resident are not moved, sources load-balanced across replicas); every device taking
part gets its parts of every plan in one call, and moves its bytes in one bucketed
exchange over a sync group made once (``nereus.transfer.make_group``). A ``weight_sync``
event with bytes, seconds and GB/s goes on the tap, and the policy version advances;
every rollout records the version that generated it.

TP and PP live inside an EMU: its mesh has axes ``pp`` x ``tp`` (row-major, TP
innermost, the state layer's device order); every rank gets the same request, and the
engines talk over TP and PP groups made per EMU (and DP groups per position across a
training model-stage's EMUs), each model-stage in its own group epoch so co-resident
model-stages never share a communicator. Results come from the last rank (the last
pipeline stage holds the complete training metrics).

The reward model (``reward.kind = "model"``) runs as ``reward_inference`` EMUs built
from its own folder and config (``nereus.rl.stages.reward_model``); its rows are cut
across replicas like the reference's.

Checkpoints hold one file per rank of the first EMU of each training model-stage, so a
job resumes on the same layouts (a changed layout goes through the state layer's
checkpoint reshard, not here).

Refuses (``ConfigError``): critic-inference and critic-training with different layouts
(the critic's weights are copied rank to rank), a model-stage with more DP replicas than
the rows it is given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import torch

from nereus.config import require, to_dict
from nereus.engines.losses import even_slices
from nereus.rl.config import JobConfig
from nereus.rl.stages import (
    ModelStages,
    engine_optim,
    last_token_scores,
    read_state,
    reward_model,
    write_state,
)

__all__ = ["ClusterStages"]

log = logging.getLogger("nereus.rl")

_KINDS = {
    "policy_generation": "generation",
    "reference_inference": "inference",
    "critic_inference": "inference",
    "reward_inference": "inference",
    "policy_training": "training",
    "critic_training": "training",
}


def _rows(batch: dict[str, torch.Tensor], s: slice) -> dict[str, torch.Tensor]:
    return {k: v[s] for k, v in batch.items()}


class ClusterStages(ModelStages):
    """See the module docstring. Build with ``await ClusterStages.start(...)``."""

    def __init__(self, cfg: JobConfig, cluster: Any, model_config: Any, model_dir: Path) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.model_config = model_config
        self.model_dir = Path(model_dir)
        self.emus: dict[str, list[Any]] = {}  # model-stage -> one ActorMesh per EMU
        self.policy_version = 0
        self._sync_group: Any = None
        self._groups: list[Any] = []
        self._cache_sharers: list[int] = []

    @classmethod
    async def start(cls, cfg: JobConfig, model_config: Any, model_dir: str | Path, cluster: Any = None) -> ClusterStages:
        """Start (or use) a local cluster and spawn every model-stage of the plan."""
        if "critic_training" in cfg.plan:
            a, b = cfg.plan["critic_training"], cfg.plan.get("critic_inference", cfg.plan["critic_training"])
            require((a.tp, a.pp) == (b.tp, b.pp), "plan.critic_inference", f"tp={b.tp} pp={b.pp}", f"must equal critic_training's tp={a.tp} pp={a.pp}")
        owns = cluster is None
        if cluster is None:
            from nereus.actors import Cluster

            c = cfg.cluster
            if c.mode == "connect":
                cluster = Cluster.connect(c.address, key_file=c.key_file or None, min_devices=c.devices,
                                          curve_key_file=c.curve_key_file or None)
            else:
                # A generous heartbeat timeout: on a loaded 2-core machine a busy worker host
                # can miss the default 3 s, and a lost node ends the job.
                cluster = Cluster.local(devices=c.devices, memory_per_device=c.memory_per_device, heartbeat_timeout_s=30.0)
            await cluster.start()
        self = cls(cfg, cluster, model_config, Path(model_dir))
        self._owns_cluster = owns
        try:
            await self._spawn_all()
        except BaseException:
            await self.close()
            raise
        return self

    def _options(self, stage: str) -> dict[str, Any]:
        cfg = self.cfg
        common = {"dtype": cfg.model.dtype, "seed": cfg.run.seed}
        if stage == "policy_generation":
            return common
        if stage == "reference_inference":
            return {**common, "micro_batch_size": cfg.optim.micro_batch_size}
        if stage in ("critic_inference", "reward_inference"):
            return {**common, "micro_batch_size": cfg.optim.micro_batch_size, "value_head": True}
        critic = stage == "critic_training"
        return {**common, "optim": engine_optim(cfg, critic=critic), "critic": critic}

    async def _group(self, devices: list[int], epoch: int) -> str | None:
        from nereus.transfer.group import make_group

        if len(devices) < 2:
            return None
        group = await make_group(self.cluster, devices=devices, epoch=epoch)
        self._groups.append(group)
        return group.group_id

    async def _stage_groups(self, stage: str, epoch: int) -> list[dict[str, Any]]:
        """Per EMU: the TP, PP (and for training DP) group ids its ranks need."""
        p = self.cfg.plan[stage]
        emus = p.emu_devices()
        dp_ids: list[Any] = []
        if _KINDS[stage] == "training" and p.dp > 1:
            dp_ids = [await self._group([e[pos] for e in emus], epoch) for pos in range(p.tp * p.pp)]
        out = []
        for i, devs in enumerate(emus):
            tp_ids = [await self._group(devs[pp * p.tp:(pp + 1) * p.tp], epoch) for pp in range(p.pp)] if p.tp > 1 else []
            pp_ids = [await self._group(devs[t::p.tp], epoch) for t in range(p.tp)] if p.pp > 1 else []
            # Only training replicas talk to each other (gradients); other EMUs are independent.
            dp_rank, dp_size = (i, p.dp) if dp_ids else (0, 1)
            out.append({"tp": tp_ids, "pp": pp_ids, "dp": dp_ids, "tp_size": p.tp, "pp_size": p.pp, "dp_rank": dp_rank, "dp_size": dp_size})
        return out

    async def _spawn_all(self) -> None:
        from nereus.rl._stage_actor import StageActor

        models = {"policy": (to_dict(self.model_config), str(self.model_dir))}
        if "reward_inference" in self.cfg.plan:
            rm_config, rm_dir = reward_model(self.cfg, self.model_config)
            models["reward"] = (to_dict(rm_config), str(rm_dir))
        for epoch, stage in enumerate(sorted(self.cfg.plan, key=_KINDS.__getitem__), start=1):
            p = self.cfg.plan[stage]
            groups = await self._stage_groups(stage, epoch)
            config, folder = models["reward" if stage == "reward_inference" else "policy"]
            meshes = await asyncio.gather(*(
                self.cluster.spawn(
                    f"{stage}-{i}", StageActor, devices=devs, axes={"pp": p.pp, "tp": p.tp},
                    args=(stage, _KINDS[stage], config, folder, self._options(stage), groups[i]),
                )
                for i, devs in enumerate(p.emu_devices())
            ))
            self.emus[stage] = list(meshes)
        if "critic_inference" in self.emus:
            await self._copy_critic()
        train, gen = self.cfg.plan["policy_training"], self.cfg.plan["policy_generation"]
        devices = sorted(set(train.devices) | set(gen.devices))
        if len(devices) > 1:
            from nereus.transfer.group import make_group

            self._sync_group = await make_group(self.cluster, devices=devices)
            self._groups.append(self._sync_group)
        self._rank_of = {d: r for r, d in enumerate(devices)}
        self._sync_parts = self._plan_sync()
        trainers = {d for s, p in self.cfg.plan.items() if _KINDS[s] == "training" for d in p.devices}
        self._cache_sharers = [i for i, devs in enumerate(gen.emu_devices()) if trainers & set(devs)]

    # --- weight sync ----------------------------------------------------------------

    def _plan_sync(self) -> dict[int, list[dict[str, Any]]]:
        """Parts of the policy-training -> policy-generation plans, per device."""
        from nereus.models import model_spec
        from nereus.state import EMU, Layout, plan_part, plan_reshard

        spec = model_spec(self.model_config, dtype=self.cfg.model.dtype)
        train, gen = self.cfg.plan["policy_training"], self.cfg.plan["policy_generation"]
        sources = [EMU(f"policy_training/{i}", "policy_training", spec, Layout(train.tp, train.pp), tuple(d)) for i, d in enumerate(train.emu_devices())]
        parts: dict[int, list[dict[str, Any]]] = {}
        self._sync_bytes = 0
        for j, devs in enumerate(gen.emu_devices()):
            plan = plan_reshard(sources, EMU(f"policy_generation/{j}", "policy_generation", spec, Layout(gen.tp, gen.pp), tuple(devs)))
            self._sync_bytes += plan.bytes_moved + plan.bytes_local
            for device in plan.devices():
                parts.setdefault(device, []).append(plan_part(plan, device))
        return parts

    def _actor_on(self, device: int) -> Any:
        for stage in ("policy_generation", "policy_training"):
            for mesh in self.emus[stage]:
                for ref in mesh.refs:
                    if ref.device == device:
                        return ref
        raise AssertionError(f"no policy actor on device {device}")

    async def sync_policy(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        sources = {f"policy_training/{i}": "policy_training" for i in range(self.cfg.plan["policy_training"].dp)}
        group_id = self._sync_group.group_id if self._sync_group is not None else ""
        results = await asyncio.gather(*(
            self._actor_on(device).sync.call_one(parts, group_id, self._rank_of, sources, "policy_generation")
            for device, parts in self._sync_parts.items()
        ))
        seconds = time.perf_counter() - t0
        self.policy_version += 1
        moved = sum(r["bytes_moved"] for r in results) // 2
        event = {"bytes": self._sync_bytes, "bytes_between_devices": moved, "seconds": seconds,
                 "gbps": self._sync_bytes / max(seconds, 1e-9) / 1e9, "policy_version": self.policy_version}
        _emit("weight_sync", **event)
        return event

    async def _copy_critic(self) -> None:
        """critic-inference gets critic-training's weights (value head included), rank to
        rank (both have the same layout)."""
        states = await self.emus["critic_training"][0].state.call()
        weights = [{k: v for k, v in st["tensors"].items() if not k.endswith(("exp_avg", "exp_avg_sq"))} for st in states]
        await asyncio.gather(*(
            ref.load_state.call_one(w) for m in self.emus["critic_inference"] for ref, w in zip(m.refs, weights, strict=True)
        ))

    # --- the ModelStages calls ------------------------------------------------------

    async def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
        meshes = self.emus["policy_generation"]
        slices = even_slices(len(prompts), len(meshes))
        seed = params.get("seed") or 0
        outs = await asyncio.gather(*(
            m.generate.call(prompts[s], {**params, "seed": seed + i})
            for i, (m, s) in enumerate(zip(meshes, slices, strict=True)) if s.stop > s.start
        ))
        # Idle generation EMUs that share a device with a training model-stage give their
        # KV cache back, so training's activations are accounted against a device that
        # holds only what is live.
        if self._cache_sharers:
            await asyncio.gather(*(meshes[i].free_cache.call() for i in self._cache_sharers))
        token_ids = [t for o in outs for t in o[-1]["token_ids"]]
        logprobs = [lp for o in outs for lp in o[-1]["logprobs"]]
        return {"token_ids": token_ids, "logprobs": logprobs, "policy_version": [self.policy_version] * len(prompts)}

    async def _rows_call(self, stage: str, method: str, batch: dict[str, torch.Tensor], *args: Any) -> list[Any]:
        require(stage in self.emus, "plan", sorted(self.emus), f"must place model-stage {stage!r}")
        meshes = self.emus[stage]
        rows = batch["input_ids"].shape[0]
        require(rows >= len(meshes), f"plan.{stage}.dp", len(meshes), f"must be <= the batch's {rows} rows")
        slices = even_slices(rows, len(meshes))
        per_emu = await asyncio.gather(*(m.endpoint(method).call(_rows(batch, s), *args) for m, s in zip(meshes, slices, strict=True)))
        return [ranks[-1] for ranks in per_emu]  # every rank agrees; the last holds full metrics

    async def reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat(await self._rows_call("reference_inference", "logprobs", batch, self.cfg.sampling.temperature))

    async def critic_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat(await self._rows_call("critic_inference", "values", batch))

    async def reward_scores(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        values = torch.cat(await self._rows_call("reward_inference", "values", batch))
        return last_token_scores(values, batch["attention_mask"])

    async def train_policy(self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]) -> dict[str, float]:
        out = await self._rows_call("policy_training", "train_step", batch, loss, loss_kwargs, self.cfg.optim.micro_batch_size, self.cfg.sampling.temperature)
        return out[0]

    async def train_critic(self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]) -> dict[str, float]:
        out = await self._rows_call("critic_training", "train_step", batch, loss, loss_kwargs, self.cfg.optim.micro_batch_size)
        await self._copy_critic()
        return {f"critic_{k}" if not k.startswith("value") else k: v for k, v in out[0].items()}

    # --- checkpoint -----------------------------------------------------------------

    async def save(self, folder: str | Path) -> None:
        out = Path(folder)
        for stage in ("policy_training", "critic_training"):
            if stage not in self.emus:
                continue
            states = await self.emus[stage][0].state.call()
            for rank, st in enumerate(states):
                meta = {"step": st["step"], "policy_version": self.policy_version}
                # Off the event loop: the embedded controller and node heartbeat on it.
                await asyncio.to_thread(write_state, out, f"{stage}.rank{rank}", st["tensors"], meta)

    async def load(self, folder: str | Path) -> None:
        src = Path(folder)
        meta: dict[str, Any] = {}
        for stage in ("policy_training", "critic_training"):
            if stage not in self.emus:
                continue
            calls = []
            for mesh in self.emus[stage]:  # every DP replica holds the whole state
                for rank, ref in enumerate(mesh.refs):
                    tensors, meta_r = await asyncio.to_thread(read_state, src, f"{stage}.rank{rank}")
                    calls.append(ref.load_state.call_one(tensors, int(meta_r["step"])))
                    if stage == "policy_training":
                        meta = meta_r
            await asyncio.gather(*calls)
        if "critic_inference" in self.emus:
            await self._copy_critic()
        await self.sync_policy()
        self.policy_version = int(meta["policy_version"])

    async def memory(self) -> dict[int, dict[str, int]]:
        """Reservations per device, by model-stage (for the tap and the summary)."""
        out: dict[int, dict[str, int]] = {}
        for meshes in self.emus.values():
            for m in meshes:
                for ref, mem in zip(m.refs, await m.memory.call(), strict=True):
                    out.setdefault(ref.device, {}).update(mem)
        return out

    async def close(self) -> None:
        for group in self._groups:
            try:
                await group.destroy()
            except Exception as e:  # a dead member must not keep the cluster alive
                log.warning("destroying group %s failed: %s", getattr(group, "group_id", "?"), e)
        self._groups = []
        for meshes in self.emus.values():
            for m in meshes:
                try:  # the engines give their memory back to the device ledgers
                    await m.close.options(timeout_s=30.0).call()
                except Exception as e:  # a dead worker has nothing left to release
                    log.warning("closing the engines of %s failed: %s", m.name, e)
                await self.cluster.stop_mesh(m)
        self.emus = {}
        if getattr(self, "_owns_cluster", False):
            await self.cluster.close()
            self._owns_cluster = False


def _emit(type_: str, **fields: Any) -> None:
    from nereus.actors import emit

    emit(type_, **fields)
