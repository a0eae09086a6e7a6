"""Model-stages as EMUs over worker-resident state on a cluster, placed by a plan the job
holds and can change between steps.

``ClusterStages.start(cfg, model_config, model_dir)`` starts ``Cluster.local`` with
``cluster.devices`` CPU worker processes of ``cluster.memory_per_device`` each (or, with
``cluster.mode = "connect"``, attaches to the running cluster at ``cluster.address``,
whose workers outlive the job), spawns one ``EngineHost`` per device (the worker's shard
store and the engines over it), and for every model-stage of the plan fills the stores
with its EMUs' shards (each rank reads only its slices) and starts their engines
(``nereus.engines.spawn_model_stage``).

The plan (``plan``): a ``nereus.planner.Plan`` under the job's model-stage names,
converted from the TOML ``[plan]``. ``await apply_plan(target)`` changes it at a step
boundary over the state the workers hold (nothing goes through the driver, nothing is
reloaded): it plans every changed model-stage's transition and checks every device's
budget (``nereus.rl.change``), refusing with ``OutOfMemory`` before anything moves;
closes the engines (generation gives back its KV cache); runs the primitives on the
workers (``nereus.state.execute_step``), the logical state (update counter, policy
version, sample position) travelling with the tensors; takes a fresh layout epoch
(``Cluster.set_epoch``, stamped on tap events); starts every engine again in that epoch
(training EMUs get their new DP rank and size: the global batch stays fixed, rows per
replica and accumulation follow; generation reserves its KV cache again); releases the
old epoch's groups; and rebuilds the weight-sync plans. It returns a report with the
bytes the plans move and the bytes the workers measured, and the seconds of each part.

Devices: a device the cluster drains (``Cluster.drain``) may not appear in a target and
is retired once the change leaves it empty; devices that join (``Cluster.add_node``, or
a node joining a running controller) get an engine host at the next change that uses
them. Worker deaths and node departures are recorded (``failures``, ``failure_event``)
through ``Cluster.on_failure``.

Work distribution (``nereus.engines.ModelStageHandle``): generation cuts prompts into
``dp`` contiguous chunks (EMU ``i`` samples with ``seed + i``); inference cuts rows the
same way; training cuts rows across the DP replicas and all-reduces gradients, so DP gives
the gradient of one token-mean loss over the whole batch.

Weight sync (``sync_policy``): policy-training's EMUs are the sources and every
policy-generation EMU a target of a ``nereus.state.plan_reshard`` plan (bytes already
resident are not moved, sources load-balanced across replicas), written into the
generation EMUs' tensors in place (``nereus.state.execute_into``: one message per device,
one exchange over a sync group of the epoch). The critic's inference EMUs are synced from
its training EMUs the same way, between any two layouts. A ``weight_sync`` event with
bytes, seconds and GB/s goes on the tap, and the policy version advances.

Checkpoints (``save``/``load``): every training model-stage's first EMU is written by its
workers, each its own shards (``nereus.state.save_to_disk``), with the logical state in
the manifest; ``load`` reads them into whatever layout the job has now.

Refuses (``ConfigError``): a target plan with other model-stages, devices that are not
live or are draining; ``OutOfMemory`` / ``InfeasiblePlan`` for a change that cannot run
(nothing moved).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from nereus.config import require
from nereus.errors import ActorDied
from nereus.rl.change import plan_change, stage_emus
from nereus.rl.config import JobConfig
from nereus.rl.stages import ModelStages, engine_optim, last_token_scores, reward_model
from nereus.state.memory import DEFAULT_BUCKET_BYTES

__all__ = ["ClusterStages", "STAGE_KINDS"]

log = logging.getLogger("nereus.rl")

STAGE_KINDS = {
    "policy_generation": "generation",
    "reference_inference": "inference",
    "critic_inference": "inference",
    "reward_inference": "inference",
    "policy_training": "training",
    "critic_training": "training",
}
_VALUE_HEAD = ("critic_inference", "critic_training", "reward_inference")


class ClusterStages(ModelStages):
    """See the module docstring. Build with ``await ClusterStages.start(...)``."""

    def __init__(self, cfg: JobConfig, cluster: Any, model_config: Any, model_dir: Path) -> None:
        super().__init__()
        self.cfg = cfg
        self.cluster = cluster
        self.model_config = model_config
        self.model_dir = Path(model_dir)
        self.policy_version = 0
        self.epoch = 0
        self.hosts: dict[int, Any] = {}
        self.emus: dict[str, list[Any]] = {}  # model-stage -> its EMUs (DP order)
        self.handles: dict[str, Any] = {}  # model-stage -> ModelStageHandle of its engines
        self.failures: list[Any] = []
        self.failure_event = asyncio.Event()
        self._plan = cfg.job_plan()
        self._host_meshes: list[Any] = []
        self._cache_slots = 0  # slots of the generation KV caches before a change
        self._sync: dict[str, tuple[list[Any], Any]] = {}  # target model-stage -> (plans, group)
        self._owns_cluster = False
        self._models: dict[str, tuple[Any, str]] = {}

    # --- start ------------------------------------------------------------------

    @classmethod
    async def start(cls, cfg: JobConfig, model_config: Any, model_dir: str | Path, cluster: Any = None) -> ClusterStages:
        """Start (or use) a cluster, its engine hosts, and every model-stage of the plan."""
        owns = cluster is None
        if cluster is None:
            from nereus.actors import Cluster

            c = cfg.cluster
            if c.mode == "connect":
                # The same deadline as a local cluster's: spawning a model-stage on a busy host
                # takes longer than the 30 s an attach alone would allow.
                cluster = Cluster.connect(c.address, key_file=c.key_file or None, min_devices=c.devices,
                                          timeout_s=60.0, curve_key_file=c.curve_key_file or None)
            else:
                # A generous heartbeat timeout: on a loaded 2-core machine a busy worker host
                # can miss the default 3 s, and a lost node ends the job.
                cluster = Cluster.local(devices=c.devices, memory_per_device=c.memory_per_device, heartbeat_timeout_s=30.0)
            await cluster.start()
        self = cls(cfg, cluster, model_config, Path(model_dir))
        self._owns_cluster = owns
        cluster.on_failure(self._on_failure)
        try:
            await self._start_all()
        except BaseException:
            await self.close()
            raise
        return self

    def _on_failure(self, failure: Any) -> None:
        log.warning("device %s failed: %s (%s)", failure.device, failure.reason, failure.actor)
        self.failures.append(failure)
        self.failure_event.set()

    @property
    def plan(self) -> Any:
        return self._plan

    def _spec(self, stage: str) -> Any:
        from nereus.models import model_spec

        config, _ = self._models["reward" if stage == "reward_inference" else "policy"]
        return model_spec(config, dtype=self.cfg.model.dtype, value_head=stage in _VALUE_HEAD)

    def _slots(self, stage: str) -> tuple[str, ...]:
        from nereus.state import training_slots

        return training_slots(self.cfg.model.dtype) if STAGE_KINDS[stage] == "training" else ("param",)

    def _options(self, stage: str) -> dict[str, Any]:
        cfg = self.cfg
        kind = STAGE_KINDS[stage]
        if kind == "generation":
            return {}
        if kind == "inference":
            return {"micro_batch_size": cfg.optim.micro_batch_size}
        return {"optim": engine_optim(cfg, critic=stage == "critic_training")}

    async def _ensure_hosts(self, devices: set[int]) -> None:
        """An engine host on every device of ``devices`` that has none yet."""
        from nereus.engines import spawn_hosts

        missing = sorted(d for d in devices if d not in self.hosts)
        if missing:
            mesh = await spawn_hosts(self.cluster, missing, name=f"nereus-hosts-e{self.epoch}-{missing[0]}")
            self._host_meshes.append(mesh)
            self.hosts.update({r.device: r for r in mesh.refs})

    async def _start_all(self) -> None:
        from nereus.engines import spawn_model_stage

        self._models["policy"] = (self.model_config, str(self.model_dir))
        if "reward_inference" in self._plan.names:
            rm_config, rm_dir = reward_model(self.cfg, self.model_config)
            self._models["reward"] = (rm_config, str(rm_dir))
        # layout epochs only grow on a cluster: a job attached to one that ran others goes on
        await self.cluster.refresh_devices()
        self.epoch = self.cluster.epoch + 1
        await self.cluster.set_epoch(self.epoch)
        await self._ensure_hosts(set(self._plan.devices))
        for stage, sp in self._plan:
            emus = stage_emus(stage, sp, self._spec(stage), self._slots(stage), self.epoch)
            config, folder = self._models["reward" if stage == "reward_inference" else "policy"]
            self.handles[stage] = await spawn_model_stage(
                self.cluster, self.hosts, stage, STAGE_KINDS[stage], emus, model_config=config, model_dir=folder,
                seed=self.cfg.run.seed, options=self._options(stage), epoch=self.epoch)
            self.emus[stage] = emus
        await self._plan_syncs()
        if "critic_inference" in self.emus:
            await self._run_sync("critic_inference")

    # --- weight syncs -------------------------------------------------------------

    def _host_of(self, device: int) -> int:
        hosts = {d.index: d.host for d in self.cluster.devices}
        names = sorted(set(hosts.values()))
        return names.index(hosts[device]) if device in hosts else -1

    async def _plan_syncs(self) -> None:
        """Plans (and a group of this epoch) for every in-place sync: policy-training ->
        policy-generation, critic-training -> critic-inference."""
        from nereus.state import plan_reshard
        from nereus.transfer import make_group

        self._sync = {}
        for source, target in (("policy_training", "policy_generation"), ("critic_training", "critic_inference")):
            if source not in self.emus or target not in self.emus:
                continue
            plans = [plan_reshard(self.emus[source], t, self._host_of) for t in self.emus[target]]
            devices = sorted({d for p in plans for d in p.devices()})
            group = None
            if any(p.remote_moves() for p in plans):
                group = await make_group(self.cluster, devices=devices, epoch=self.epoch)
            self._sync[target] = (plans, group)

    async def _run_sync(self, target: str) -> dict[str, Any]:
        from nereus.state import execute_into

        plans, group = self._sync[target]
        t0 = time.perf_counter()
        stats = await execute_into(plans, self.hosts, group)
        seconds = time.perf_counter() - t0
        nbytes = stats.bytes_moved + stats.bytes_local
        return {"bytes": nbytes, "bytes_between_devices": stats.bytes_sent_measured, "seconds": seconds,
                "gbps": nbytes / max(seconds, 1e-9) / 1e9}

    async def sync_policy(self) -> dict[str, Any]:
        event = await self._run_sync("policy_generation")
        self.policy_version += 1
        event["policy_version"] = self.policy_version
        await self._stamp_trained()
        _emit("weight_sync", **event)
        return event

    async def _stamp_trained(self) -> None:
        """The training EMUs' logical state in the stores takes the job's policy version
        and sample position (their update counters the engines keep)."""
        names: dict[int, list[str]] = {}
        for stage, emus in self.emus.items():
            if STAGE_KINDS[stage] == "training":
                for e in emus:
                    for d in e.devices:
                        names.setdefault(d, []).append(e.name)
        fields = {"policy_version": self.policy_version, "sample_position": self.sample_position}
        await asyncio.gather(*(self.hosts[d].stamp_states.call_one(ns, fields) for d, ns in names.items()))

    # --- the ModelStages calls ------------------------------------------------------

    def _cache_sharers(self) -> list[int]:
        """Generation EMUs that share a device with a training model-stage."""
        trainers = {d for s, emus in self.emus.items() if STAGE_KINDS[s] == "training" for e in emus for d in e.devices}
        return [i for i, e in enumerate(self.emus["policy_generation"]) if trainers & set(e.devices)]

    async def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
        handle = self.handles["policy_generation"]
        with self.timed("policy_generation"):
            out = await handle.generate(prompts, params)
            # Idle generation EMUs that share a device with a training model-stage give their
            # KV cache back, so training's activations are accounted against a device that
            # holds only what is live.
            sharers = self._cache_sharers()
            if sharers:
                await asyncio.gather(*(handle.emus[i].free_cache() for i in sharers))
        return {"token_ids": out.token_ids, "logprobs": out.logprobs, "policy_version": [self.policy_version] * len(prompts)}

    def _handle(self, stage: str) -> Any:
        require(stage in self.handles, "plan", sorted(self.handles), f"must place model-stage {stage!r}")
        return self.handles[stage]

    def _check_rows(self, stage: str, batch: dict[str, torch.Tensor]) -> None:
        rows = batch["input_ids"].shape[0]
        dp = len(self.emus[stage])
        require(rows >= dp, f"plan.{stage}.dp", dp, f"must be <= the batch's {rows} rows")

    async def reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        handle = self._handle("reference_inference")
        with self.timed("reference_inference"):
            return await handle.logprobs(batch, self.cfg.sampling.temperature)

    async def critic_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        handle = self._handle("critic_inference")
        with self.timed("critic_inference"):
            return await handle.values(batch)

    async def reward_scores(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        handle = self._handle("reward_inference")
        with self.timed("reward_inference"):
            values = await handle.values(batch)
        return last_token_scores(values, batch["attention_mask"])

    async def train_policy(self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]) -> dict[str, float]:
        handle = self._handle("policy_training")
        self._check_rows("policy_training", batch)
        with self.timed("policy_training"):
            return await handle.train_step(batch, loss, loss_kwargs, self.cfg.optim.micro_batch_size,
                                           self.cfg.sampling.temperature)

    async def train_critic(self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]) -> dict[str, float]:
        handle = self._handle("critic_training")
        self._check_rows("critic_training", batch)
        with self.timed("critic_training"):
            out = await handle.train_step(batch, loss, loss_kwargs, self.cfg.optim.micro_batch_size)
            await self._run_sync("critic_inference")
        return {f"critic_{k}" if not k.startswith("value") else k: v for k, v in out.items()}

    # --- changing the plan ------------------------------------------------------------

    def _device_set(self) -> Any:
        """Every live device's host and budget (indexed by cluster device id)."""
        from nereus.state import DeviceSet

        devs = {d.index: d for d in self.cluster.devices}
        top = max([*devs, *self._plan.devices]) + 1
        return DeviceSet(tuple(self._host_of(i) if i in devs else -1 for i in range(top)),
                         tuple(devs[i].memory_bytes if i in devs else 1 for i in range(top)))

    def _engine_bytes(self, stage: str, emu: Any, device: int) -> int:
        """What ``stage``'s engine adds on ``device`` beyond the store: a training EMU's
        gradients, a generation EMU's KV cache at its last size."""
        from nereus.state import layer_bounds
        from nereus.state.spec import DTYPE_BYTES, grad_bytes_per_param

        kind = STAGE_KINDS[stage]
        if kind == "training":
            params = sum(s.numel for k, (s, _) in emu.shards_on(device).items() if ":" not in k)
            return params * grad_bytes_per_param(self.cfg.model.dtype)
        if kind == "generation" and self._cache_slots:
            c = self.model_config
            pp_rank, tp_rank = emu.position(device)
            bounds = layer_bounds(emu.layout, c.num_hidden_layers)
            layers = bounds[pp_rank + 1] - bounds[pp_rank]
            rows = math.ceil(self.cfg.algorithm.rollouts_per_step / len(self.emus.get(stage, [emu])))
            kv_local = max(1, c.num_key_value_heads // emu.layout.tp)
            return 2 * layers * rows * kv_local * self._cache_slots * c.head_dim * DTYPE_BYTES[self.cfg.model.dtype]
        return 0

    async def _stamp_states(self) -> None:
        """Every EMU's logical state as the workers hold it, with the job's policy version
        and sample position, written back to the stores and kept in the descriptions."""
        from nereus.state import LogicalState

        for stage, emus in self.emus.items():
            states = await asyncio.gather(*(self.hosts[e.devices[0]].get_state.call_one(e.name) for e in emus))
            counts = {s.get("update_count", 0) for s in states}
            require(len(counts) == 1, f"{stage} update counters", sorted(counts), "must agree across replicas")
            state = LogicalState(counts.pop(), self.policy_version, self.sample_position)
            await asyncio.gather(*(self.hosts[d].set_state.call_one(e.name, vars(state)) for e in emus for d in e.devices))
            self.emus[stage] = [e.with_(state=state) for e in emus]

    async def apply_plan(self, target: Any) -> dict[str, Any]:
        """Change the job's plan to ``target`` at a step boundary (see the module
        docstring). Returns a report: ``changed`` model-stages, ``bytes`` the plans move
        between devices, ``bytes_measured`` (the workers' counters), ``seconds`` and its
        parts (``plan_s``, ``engines_stop_s``, ``moves_s``, ``groups_s``, ``engines_s``,
        ``sync_plans_s``), the new ``epoch``."""
        from nereus.planner.plan import Plan
        from nereus.state import execute_step
        from nereus.transfer import release_groups

        t0 = time.perf_counter()
        require(isinstance(target, Plan), "target", type(target).__name__, "must be a nereus.planner.Plan")
        require(set(target.names) == set(self._plan.names), "target plan", target.names,
                f"must place exactly the job's model-stages {sorted(self._plan.names)}")
        await self.cluster.refresh_devices()
        live = {d.index for d in self.cluster.devices}
        draining = set(getattr(self.cluster, "draining", ()))
        bad = sorted(d for d in target.devices if d not in live or d in draining)
        require(not bad, "target plan devices", bad, f"must be live devices that are not draining (live: {sorted(live - draining)})")
        report: dict[str, Any] = {"from": self._plan.to_dict(), "to": target.to_dict(), "epoch_from": self.epoch}
        # what the change moves, checked against every budget before anything moves
        await self._stamp_states()
        if "policy_generation" in self.handles:
            shapes = [await h.cache_shape() for h in self.handles["policy_generation"].emus]
            self._cache_slots = max((s[1] for s in shapes), default=0)
        new_epoch = max(self.epoch, self.cluster.epoch) + 1
        resident = _resident(await self.memory(), [e.name for emus in self.emus.values() for e in emus])
        # between processes of one host peers write into each other's new shards: no bucket
        one_host = len({self._host_of(d) for d in self.hosts}) == 1
        planned = plan_change(self.emus, target, self._device_set(), epoch=new_epoch, resident=resident,
                              engine_bytes=self._engine_bytes, bucket_bytes=0 if one_host else DEFAULT_BUCKET_BYTES)
        t_plan = time.perf_counter()
        report.update(changed=[c.stage for c in planned.changes], bytes=planned.bytes_moved,
                      predicted_peak_bytes=planned.peak)
        # the engines stop (gradients, KV caches and activations leave the ledgers)
        for handle in self.handles.values():
            await handle.stop()
        self.handles = {}
        t_stop = time.perf_counter()
        await self._ensure_hosts(set(target.devices))
        measured = 0
        for change in planned.changes:
            for step in change.transition.steps:
                stats = await execute_step(step, self.hosts, self.cluster, epoch=new_epoch)
                measured += stats.bytes_sent_measured
            renames = [(a, b) for a, b in change.renames if a != b]
            if renames:
                devices = {d for e in change.transition.result for d in e.devices}
                await asyncio.gather(*(self.hosts[d].rename.call_one(dict(renames)) for d in devices))
        # the transition's groups are its own
        await release_groups(self.cluster, new_epoch)
        t_moves = time.perf_counter()
        old_epoch, self.epoch = self.epoch, new_epoch
        self.emus = planned.result
        self._plan = target
        await self.cluster.set_epoch(self.epoch)
        timing = await self._start_engines()
        await release_groups(self.cluster, old_epoch)
        t_engines = time.perf_counter()
        await self._plan_syncs()
        await self._retire_drained()
        t_end = time.perf_counter()
        report.update(epoch=self.epoch, bytes_measured=measured, seconds=t_end - t0, plan_s=t_plan - t0,
                      engines_stop_s=t_stop - t_plan, moves_s=t_moves - t_stop, groups_s=timing["groups_s"],
                      engines_s=t_engines - t_moves - timing["groups_s"], sync_plans_s=t_end - t_engines)
        log.info("plan changed to epoch %d (%s): %d bytes moved in %.3f s", self.epoch, report["changed"],
                 report["bytes"], report["seconds"])
        return report

    async def _start_engines(self) -> dict[str, float]:
        """Every model-stage's engines over the EMUs the stores hold now, in this epoch."""
        from nereus.engines import start_model_stage
        from nereus.engines.stage import stage_groups

        t0 = time.perf_counter()
        for stage, emus in self.emus.items():  # the data plane caches them for start_model_stage
            await stage_groups(self.cluster, STAGE_KINDS[stage], emus, epoch=self.epoch)
        groups_s = time.perf_counter() - t0

        async def start(stage: str, emus: list[Any]) -> None:
            config, _ = self._models["reward" if stage == "reward_inference" else "policy"]
            caches = None
            if STAGE_KINDS[stage] == "generation" and self._cache_slots:
                rows = math.ceil(self.cfg.algorithm.rollouts_per_step / len(emus))
                caches = {e.name: [rows, self._cache_slots] for e in emus}
            self.handles[stage] = await start_model_stage(
                self.cluster, self.hosts, stage, STAGE_KINDS[stage], emus, model_config=config,
                options=self._options(stage), epoch=self.epoch, caches=caches)

        # every model-stage at once: a device's host builds its engines one after another
        await asyncio.gather(*(start(stage, emus) for stage, emus in self.emus.items()))
        return {"groups_s": groups_s}

    async def _retire_drained(self) -> None:
        """Drained devices the plan no longer uses stop."""
        retire = getattr(self.cluster, "retire_drained", None)
        if retire is None:
            return
        idle = [d for d in getattr(self.cluster, "draining", ()) if d not in self._plan.devices]
        for d in idle:
            host = self.hosts.pop(d, None)
            if host is not None:
                held = await host.held.call_one()
                require(not held, f"device {d}", sorted(held), "must hold nothing before it is retired")
        if idle:
            await retire(idle)

    # --- checkpoint -----------------------------------------------------------------

    async def save(self, folder: str | Path) -> None:
        from nereus.state import save_to_disk

        await self._stamp_states()
        out = Path(folder)
        for stage in ("policy_training", "critic_training"):
            if stage in self.emus:
                await save_to_disk(str(out / stage), self.emus[stage][0], self.hosts)

    async def load(self, folder: str | Path) -> None:
        """Read every training model-stage's checkpoint into its EMUs as they are now (any
        saved layout), then sync generation and the critic's inference from them."""
        from nereus.state import load_from_disk

        src = Path(folder)
        state = None
        for stage in ("policy_training", "critic_training"):
            if stage not in self.emus:
                continue
            await self.handles[stage].stop()
            emus = self.emus[stage]
            await asyncio.gather(*(self.hosts[d].drop_shards.call_one([e.name]) for e in emus for d in e.devices))
            loaded = [await load_from_disk(str(src / stage), e, self.hosts) for e in emus]
            self.emus[stage] = loaded
            state = loaded[0].state if stage == "policy_training" else state
            from nereus.engines import start_model_stage

            self.handles[stage] = await start_model_stage(
                self.cluster, self.hosts, stage, "training", loaded, model_config=self.model_config,
                options=self._options(stage), epoch=self.epoch)
        if "critic_inference" in self.emus:
            await self._run_sync("critic_inference")
        await self.sync_policy()
        if state is not None:
            self.policy_version = state.policy_version

    async def memory(self) -> dict[int, dict[str, Any]]:
        """Per device: the ledger's budget, used and peak bytes and who holds them."""
        devices = sorted(self.hosts)
        reports = await asyncio.gather(*(self.hosts[d].memory.call_one() for d in devices))
        return dict(zip(devices, reports, strict=True))

    async def memory_peaks(self, reset: bool = True) -> dict[int, int]:
        """Each device's ledger high-water mark since the last reset (then reset it)."""
        devices = sorted(self.hosts)
        reports = await asyncio.gather(*(self.hosts[d].memory.call_one(reset) for d in devices))
        return {d: r["peak_bytes"] for d, r in zip(devices, reports, strict=True)}

    async def close(self) -> None:
        """Close the engines, stop the engine hosts (their stores go with them), release
        the epoch's groups, and stop the cluster if the job started it."""
        from nereus.transfer import release_groups

        errors: list[BaseException] = []
        for handle in self.handles.values():
            try:
                await handle.stop()
            except Exception as e:  # keep closing; the first error is raised at the end
                errors.append(e)
        self.handles = {}
        try:
            if self.epoch:
                await release_groups(self.cluster, self.epoch)
            for mesh in self._host_meshes:
                await self.cluster.stop_mesh(mesh)
        finally:
            self._host_meshes, self.hosts, self.emus = [], {}, {}
            if self._owns_cluster:
                await self.cluster.close()
                self._owns_cluster = False
        real = [e for e in errors if not isinstance(e, ActorDied)]
        if real:
            raise real[0]


def _resident(memory: dict[int, dict[str, Any]], names: list[str]) -> dict[int, int]:
    """Per device, what its ledger holds besides the job's EMUs (``shards/<name>``), their
    engines (``<name>/...``) and transfers in flight: what a change must work around."""
    mine = tuple(f"shards/{n}" for n in names) + tuple(f"{n}/" for n in names) + ("transfer/",)
    return {d: sum(v for k, v in m["breakdown"].items() if not k.startswith(mine)) for d, m in memory.items()}


def _emit(type_: str, **fields: Any) -> None:
    from nereus.actors import emit

    emit(type_, **fields)

