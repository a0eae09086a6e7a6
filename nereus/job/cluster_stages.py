"""Model-stages as EMUs over worker-resident state on a cluster, placed by a plan the job
holds and can change between steps.

The plan (``plan``): a ``nereus.planner.Plan`` under the job's model-stage names,
converted from the TOML ``[plan]``; ``await apply_plan(target)`` changes it at a step
boundary over the state the workers hold, through one transition DAG across every
model-stage that moves (``nereus.job.plan_changes.PlanChanges``, held as ``changes``:
pricing, checking and running a change). Both read and write the placement through one
``nereus.job.stages_state.StagesState`` (``state``).

Devices: every live device gets an engine host at start; a device the cluster drains
(``Cluster.drain``) may not appear in a target and is retired once the change leaves it
empty; devices that join (``Cluster.add_node``, or a node joining a running controller)
get an engine host when the controller loop sees them (``ensure_hosts``) or at the
next change that uses them. Worker deaths and node departures are recorded (``failures``,
``failure_event``) through ``Cluster.on_failure``.

Refuses (``ConfigError``): work for a model-stage the plan does not place, a DP larger
than the batch's rows, training replicas whose update counters disagree; a change's
refusals are ``PlanChanges``'s.

More (how it works): docs/rl-jobs.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from nereus.actors import Cluster, Failure
from nereus.actors.gpu_memory import VLLM_WORKSPACE_BYTES
from nereus.config import require
from nereus.engines import spawn_hosts, spawn_model_stage, start_model_stage
from nereus.errors import ActorDied
from nereus.job.change import STAGE_KINDS, stage_emus
from nereus.job.config import JobConfig, resolve_model_dtype
from nereus.job.local_stages import reward_model
from nereus.job.plan_changes import PlanChanges, emit_event
from nereus.job.stages_state import StagesState
from nereus.models import ModelConfig, model_spec
from nereus.planner import Calibrator, local_cpu_cluster_probed, local_cpu_efficiency
from nereus.planner.plan import Plan, StagePlan
from nereus.rl.stages import ModelStages, last_token_scores
from nereus.state import (
    EMU,
    DeviceSet,
    LogicalState,
    execute_into,
    layer_bounds,
    load_from_disk,
    plan_reshard,
    save_to_disk,
    training_slots,
)
from nereus.state.spec import DTYPE_BYTES, ModelSpec, grad_bytes_per_param
from nereus.transfer import make_group, release_groups
from nereus.transition import LinkModel, TransitionDAG

__all__ = ["ClusterStages", "STAGE_KINDS", "CALIBRATION_PRIOR_WEIGHT"]

log = logging.getLogger("nereus.rl")

_VALUE_HEAD = ("critic_inference", "critic_training", "reward_inference")
# the pull of the calibration toward its probed prior: firm, since one plan's timings
# cannot tell apart op classes that scale together (the simulator replays a job with it)
CALIBRATION_PRIOR_WEIGHT = 0.05


def _shared(name: str) -> Any:
    """An attribute of ``ClusterStages`` kept in its ``StagesState`` (read and written there)."""

    def get(self: ClusterStages) -> Any:
        return getattr(self.state, name)

    def set_(self: ClusterStages, value: Any) -> None:
        setattr(self.state, name, value)

    return property(get, set_, doc=f"``StagesState.{name}``")


class ClusterStages(ModelStages):
    """See the module docstring. Build with ``await ClusterStages.start(...)``."""

    # what plan changes share with the work (nereus.job.stages_state)
    cfg = _shared("cfg")
    cluster = _shared("cluster")
    model_config = _shared("model_config")
    epoch = _shared("epoch")
    hosts = _shared("hosts")
    emus = _shared("emus")
    handles = _shared("handles")
    _plan = _shared("plan")
    _sync = _shared("sync")
    _models = _shared("models")
    _missing = _shared("missing")
    _cache_slots = _shared("cache_slots")
    _spawn_s = _shared("spawn_s")
    last_transition = _shared("last_transition")
    learn_transitions = _shared("learn_transitions")
    cluster_spec = _shared("cluster_spec")
    calibrator = _shared("calibrator")
    link = _shared("link")

    def __init__(
        self, cfg: JobConfig, cluster: Cluster, model_config: ModelConfig, model_dir: Path
    ) -> None:
        super().__init__()
        self.state = StagesState(cfg, cluster, model_config, cfg.job_plan())
        self.changes = PlanChanges(self.state, self)  # pricing, checking and running a change
        self.model_dir = Path(model_dir)
        self.policy_version = 0
        self.failures: list[Failure] = []
        self.failure_event = asyncio.Event()
        self._host_meshes: list[Any] = []
        self._owns_cluster = False

    # --- plan changes (nereus.job.plan_changes) --------------------------------------

    async def change_inputs(self) -> dict[str, Any]:
        return await self.changes.change_inputs()

    def plan_change(self, target: Plan, inputs: dict[str, Any]) -> tuple[TransitionDAG, float]:
        return self.changes.plan_change(target, inputs)

    @property
    def restart_seconds(self) -> float:
        return self.changes.restart_seconds

    def estimate_change(self, target: Plan, inputs: dict[str, Any]) -> tuple[float, int]:
        return self.changes.estimate_change(target, inputs)

    async def apply_plan(self, target: Any, *, overlap: bool | str = False) -> dict[str, Any]:
        return await self.changes.apply_plan(target, overlap=overlap)

    async def transition_done(self) -> dict[str, Any] | None:
        return await self.changes.transition_done()

    async def _ready(self, stage: str) -> None:
        await self.changes.ready(stage)

    # --- start ------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        cfg: JobConfig,
        model_config: ModelConfig,
        model_dir: str | Path,
        cluster: Cluster | None = None,
        on_cluster: Callable[[Cluster], Awaitable[None]] | None = None,
    ) -> ClusterStages:
        """Start (or use) a cluster, its engine hosts, and every model-stage of the plan."""
        owns = cluster is None
        if cluster is None:
            c = cfg.cluster
            if c.mode == "connect":
                # The same deadline as a local cluster's: spawning a model-stage on a busy host
                # takes longer than the 30 s an attach alone would allow.
                cluster = Cluster.connect(
                    c.address,
                    key_file=c.key_file or None,
                    min_devices=c.devices,
                    timeout_s=60.0,
                    curve_key_file=c.curve_key_file or None,
                )
            else:
                # A generous heartbeat timeout: on a loaded 2-core machine a busy worker host
                # can miss the default 3 s, and a lost node ends the job.
                cluster = Cluster.local(
                    devices=c.devices,
                    memory_per_device=c.memory_per_device,
                    heartbeat_timeout_s=30.0,
                    cores_per_device=c.cores_per_device,
                )
            await cluster.start()
        cfg = resolve_model_dtype(cfg, [d.kind for d in cluster.devices[: cfg.cluster.devices]])
        self = cls(cfg, cluster, model_config, Path(model_dir))
        self._owns_cluster = owns
        cluster.on_failure(self._on_failure)
        try:
            if on_cluster is not None:
                await on_cluster(cluster)
            await self._start_all()
        except BaseException:
            await self.close()
            raise
        return self

    def _on_failure(self, failure: Failure) -> None:
        log.warning("device %s failed: %s (%s)", failure.device, failure.reason, failure.actor)
        self.failures.append(failure)
        self.failure_event.set()

    @property
    def plan(self) -> Plan:
        return self._plan

    def _spec(self, stage: str) -> ModelSpec:
        config, _ = self._models["reward" if stage == "reward_inference" else "policy"]
        return model_spec(config, dtype=self.cfg.model.dtype, value_head=stage in _VALUE_HEAD)

    def _slots(self, stage: str) -> tuple[str, ...]:
        return (
            training_slots(self.cfg.model.dtype) if STAGE_KINDS[stage] == "training" else ("param",)
        )

    def _generation_rows(self, sp: StagePlan) -> int:
        """Sequences one generation EMU decodes at once under ``sp``: its share of the
        step's rollouts, in ``sp.waves`` successive batches."""
        return math.ceil(math.ceil(self.cfg.algorithm.rollouts_per_step / sp.dp) / sp.waves)

    def _options(self, stage: str, sp: StagePlan | None = None) -> dict[str, Any]:
        """The engine options of ``stage`` under its plan ``sp`` (default: the current one):
        generation decodes in ``sp.waves`` batches, training recomputes with ``sp.recompute``."""
        cfg = self.cfg
        sp = sp if sp is not None else self._plan[stage]
        kind = STAGE_KINDS[stage]
        if kind == "generation" and cfg.sampling.engine == "vllm":
            return {
                "engine": "vllm",
                "model_dir": self._models["policy"][1],
                "kv_cache_bytes": self._vllm_cache_bytes(sp),
                "seed": cfg.run.seed,
            }
        if kind == "generation":
            return {"max_batch": self._generation_rows(sp)}
        if kind == "inference":
            return {"micro_batch_size": cfg.optim.micro_batch_size}
        return {
            "optim": cfg.optim.for_engine(critic=stage == "critic_training"),
            "recompute": sp.recompute,
        }

    def _vllm_cache_bytes(self, sp: StagePlan) -> int:
        """vLLM's KV cache per rank of a generation EMU under ``sp``: its rows at the
        model's full length, rounded up to whole blocks of 128 slots (the largest block
        vLLM's backends use), twice over (vLLM's CPU backend fits half the tokens that
        the keys' and values' bytes alone would give)."""
        c = self.model_config
        slots = -(-c.max_position_embeddings // 128) * 128
        kv_local = max(1, c.num_key_value_heads // sp.tp)
        per_token = (
            2 * c.num_hidden_layers * kv_local * c.head_dim * DTYPE_BYTES[self.cfg.model.dtype]
        )
        return 2 * per_token * slots * self._generation_rows(sp)

    async def ensure_hosts(self, devices: set[int]) -> None:
        """An engine host on every device of ``devices`` that has none yet (a device that
        joined gets one at once, before any change uses it)."""
        await self._ensure_hosts(set(devices))

    async def _ensure_hosts(self, devices: set[int]) -> None:
        """An engine host on every device of ``devices`` that has none yet."""
        missing = sorted(d for d in devices if d not in self.hosts)
        if missing:
            mesh = await spawn_hosts(
                self.cluster, missing, name=f"nereus-hosts-e{self.epoch}-{missing[0]}"
            )
            self._host_meshes.append(mesh)
            self.hosts.update({r.device: r for r in mesh.refs})
        if self.cfg.adapt.enabled:
            # a job that changes its plan may build training engines on any of its
            # devices; their one-time process cost is paid here, not inside a change
            training = {
                d
                for stage in ("policy_training", "critic_training")
                if stage in self._plan.names
                for d in self._plan[stage].devices
            }
            idle = [d for d in sorted(devices) if d in self.hosts and d not in training]
            await asyncio.gather(*(self.hosts[d].warm_up.call_one() for d in idle))

    def fixed_compute(self, devices: list[int]) -> bool:
        """Whether each of ``devices`` is a fixed unit of compute: a GPU, or a CPU worker
        under a core quota (``Cluster.cores_of``). Shared cores, and the devices of nodes
        started elsewhere (whose limits this job does not know), are not."""
        kinds = {d.index: d.kind for d in self.cluster.devices}
        cores_of = getattr(self.cluster, "cores_of", None)
        return all(
            kinds.get(d) == "cuda" or (cores_of is not None and cores_of(d) is not None)
            for d in devices
        )

    def device_cores(self, devices: list[int]) -> list[float] | None:
        """The CPU cores of each of ``devices`` (cluster ids) where every one has a limit
        (``Cluster.cores_of``), else None: shared cores."""
        cores_of = getattr(self.cluster, "cores_of", None)
        cores = [cores_of(d) for d in devices] if cores_of is not None else [None]
        return None if not cores or any(c is None for c in cores) else cores

    async def _start_all(self) -> None:
        # what transitions are priced with: this machine's rates (probed once, cached),
        # refitted from every measured transition node
        budget = min((d.memory_bytes for d in self.cluster.devices), default=2**30)
        cores = self.device_cores([d.index for d in self.cluster.devices])
        self.cluster_spec = local_cpu_cluster_probed(
            max(1, len(self.cluster.devices)), max(budget, 2), device_cores=cores
        )
        self.calibrator = Calibrator(
            prior=local_cpu_efficiency(cores=min(cores) if cores else None),
            prior_weight=CALIBRATION_PRIOR_WEIGHT,
        )
        self.link = LinkModel.of(self.cluster_spec, self.calibrator.fit())

        self._models["policy"] = (self.model_config, str(self.model_dir))
        if "reward_inference" in self._plan.names:
            rm_config, rm_dir = reward_model(self.cfg, self.model_config)
            self._models["reward"] = (rm_config, str(rm_dir))
        # layout epochs only grow on a cluster: a job attached to one that ran others goes on
        await self.cluster.refresh_devices()
        self.epoch = self.cluster.epoch + 1
        await self.cluster.set_epoch(self.epoch)
        # a host on every live device, used or not: a change that takes one up pays for
        # the state it moves, not for starting a process's engines
        await self._ensure_hosts(
            {d.index for d in self.cluster.devices} - set(getattr(self.cluster, "draining", ()))
        )
        for stage, sp in self._plan:
            emus = stage_emus(stage, sp, self._spec(stage), self._slots(stage))
            config, folder = self._models["reward" if stage == "reward_inference" else "policy"]
            t = time.perf_counter()
            self.handles[stage] = await spawn_model_stage(
                self.cluster,
                self.hosts,
                stage,
                STAGE_KINDS[stage],
                emus,
                model_config=config,
                model_dir=folder,
                seed=self.cfg.run.seed,
                options=self._options(stage),
                epoch=self.epoch,
            )
            # a first guess at what restarting a model-stage's engines costs in a change
            self._spawn_s.append(time.perf_counter() - t)
            self.emus[stage] = emus
        await self._plan_syncs()
        if "critic_inference" in self.emus:
            await self._run_sync("critic_inference")
        # the plan the job starts in; it was given ([plan]), not searched: no prediction. The
        # budgets too: a subscriber that came after the devices joined has not seen them
        emit_event(
            "plan",
            plan=self._plan.to_dict(),
            predicted_step_seconds=None,
            device_memory_bytes={str(d.index): d.memory_bytes for d in self.cluster.devices},
        )

    # --- weight syncs -------------------------------------------------------------

    def _host_of(self, device: int) -> int:
        hosts = {d.index: d.host for d in self.cluster.devices}
        names = sorted(set(hosts.values()))
        return names.index(hosts[device]) if device in hosts else -1

    async def _plan_syncs(self) -> None:
        """Plans (and a group of this epoch) for every in-place sync: policy-training ->
        policy-generation, critic-training -> critic-inference."""
        self._sync = {}
        for source, target in (
            ("policy_training", "policy_generation"),
            ("critic_training", "critic_inference"),
        ):
            if source not in self.emus or target not in self.emus:
                continue
            plans = [plan_reshard(self.emus[source], t, self._host_of) for t in self.emus[target]]
            devices = sorted({d for p in plans for d in p.devices()})
            group = None
            if any(p.remote_moves() for p in plans):
                group = await make_group(self.cluster, devices=devices, epoch=self.epoch)
            self._sync[target] = (plans, group)

    async def _run_sync(self, target: str) -> dict[str, Any]:
        plans, group = self._sync[target]
        t0 = time.perf_counter()
        stats = await execute_into(plans, self.hosts, group)
        seconds = time.perf_counter() - t0
        nbytes = stats.bytes_moved + stats.bytes_local
        return {
            "bytes": nbytes,
            "bytes_between_devices": stats.bytes_sent_measured,
            "seconds": seconds,
            "gbps": nbytes / max(seconds, 1e-9) / 1e9,
        }

    async def sync_policy(self) -> dict[str, Any]:
        # a change running beside the step rebuilds every sync plan and touches the
        # training EMUs the stamp below writes: the sync waits for all of it
        await self.transition_done()
        event = await self._run_sync("policy_generation")
        self.policy_version += 1
        event["policy_version"] = self.policy_version
        await self._stamp_trained()
        emit_event("weight_sync", **event)
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
        await asyncio.gather(
            *(self.hosts[d].stamp_states.call_one(ns, fields) for d, ns in names.items())
        )

    # --- the ModelStages calls ------------------------------------------------------

    def _cache_sharers(self) -> list[int]:
        """Generation EMUs that share a device with a training model-stage."""
        trainers = {
            d
            for s, emus in self.emus.items()
            if STAGE_KINDS[s] == "training"
            for e in emus
            for d in e.devices
        }
        return [
            i for i, e in enumerate(self.emus["policy_generation"]) if trainers & set(e.devices)
        ]

    async def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
        await self._ready("policy_generation")
        handle = self.handles["policy_generation"]
        with self.timed("policy_generation"):
            out = await handle.generate(prompts, params)
            # Idle generation EMUs that share a device with a training model-stage give their
            # KV cache back, so training's activations are accounted against a device that
            # holds only what is live.
            sharers = self._cache_sharers()
            if sharers:
                await asyncio.gather(*(handle.emus[i].free_cache() for i in sharers))
        return {
            "token_ids": out.token_ids,
            "logprobs": out.logprobs,
            "policy_version": [self.policy_version] * len(prompts),
        }

    def _handle(self, stage: str) -> Any:
        require(
            stage in self.handles, "plan", sorted(self.handles), f"must place model-stage {stage!r}"
        )
        return self.handles[stage]

    def _check_rows(self, stage: str, batch: dict[str, torch.Tensor]) -> None:
        rows = batch["input_ids"].shape[0]
        dp = len(self.emus[stage])
        require(rows >= dp, f"plan.{stage}.dp", dp, f"must be <= the batch's {rows} rows")

    async def reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        await self._ready("reference_inference")
        handle = self._handle("reference_inference")
        with self.timed("reference_inference"):
            return await handle.logprobs(batch, self.cfg.sampling.temperature)

    async def proximal_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token log-probabilities of ``batch`` under policy-training's weights now (the
        proximal policy of the decoupled objective, ``nereus.rl.decoupled``)."""
        await self._ready("policy_training")
        handle = self._handle("policy_training")
        with self.timed("policy_training"):
            return await handle.logprobs(batch, self.cfg.sampling.temperature)

    async def critic_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        await self._ready("critic_inference")
        handle = self._handle("critic_inference")
        with self.timed("critic_inference"):
            return await handle.values(batch)

    async def reward_scores(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        await self._ready("reward_inference")
        handle = self._handle("reward_inference")
        with self.timed("reward_inference"):
            values = await handle.values(batch)
        return last_token_scores(values, batch["attention_mask"])

    async def train_policy(
        self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]
    ) -> dict[str, float]:
        await self._ready("policy_training")
        handle = self._handle("policy_training")
        self._check_rows("policy_training", batch)
        with self.timed("policy_training"):
            return await handle.train_step(
                batch,
                loss,
                loss_kwargs,
                self.cfg.optim.micro_batch_size,
                self.cfg.sampling.temperature,
            )

    async def train_critic(
        self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]
    ) -> dict[str, float]:
        await self._ready("critic_training")
        await self._ready("critic_inference")
        handle = self._handle("critic_training")
        self._check_rows("critic_training", batch)
        with self.timed("critic_training"):
            out = await handle.train_step(batch, loss, loss_kwargs, self.cfg.optim.micro_batch_size)
            await self.transition_done()  # the sync plans are rebuilt by a change beside the step
            await self._run_sync("critic_inference")
        return {f"critic_{k}" if not k.startswith("value") else k: v for k, v in out.items()}

    # --- changing the plan ------------------------------------------------------------

    def _device_set(self) -> DeviceSet:
        """Every live device's host and budget (indexed by cluster device id)."""
        devs = {d.index: d for d in self.cluster.devices}
        top = max([*devs, *self._plan.devices]) + 1
        return DeviceSet(
            tuple(self._host_of(i) if i in devs else -1 for i in range(top)),
            tuple(devs[i].memory_bytes if i in devs else 1 for i in range(top)),
        )

    def _engine_bytes(self, stage: str, sp: StagePlan, emu: EMU, device: int) -> int:
        """What ``stage``'s engine (under its plan ``sp``) adds on ``device`` beyond the
        store: a training EMU's gradients, a generation EMU's KV cache at its last size."""
        kind = STAGE_KINDS[stage]
        if kind == "training":
            params = sum(s.numel for k, (s, _) in emu.shards_on(device).items() if ":" not in k)
            return params * grad_bytes_per_param(self.cfg.model.dtype)
        if kind == "generation" and self.cfg.sampling.engine == "vllm":
            # vLLM's own copy of the weights, the KV cache it is given and, on a GPU, its
            # workspace (what VllmGenerationEngine reserves)
            params = sum(s.numel for k, (s, _) in emu.shards_on(device).items() if ":" not in k)
            on_gpu = any(d.index == device and d.kind == "cuda" for d in self.cluster.devices)
            return (
                params * DTYPE_BYTES[self.cfg.model.dtype]
                + self._vllm_cache_bytes(sp)
                + (VLLM_WORKSPACE_BYTES if on_gpu else 0)
            )
        if kind == "generation" and self._cache_slots:
            c = self.model_config
            pp_rank, tp_rank = emu.position(device)
            bounds = layer_bounds(emu.layout, c.num_hidden_layers)
            layers = bounds[pp_rank + 1] - bounds[pp_rank]
            rows = self._generation_rows(sp)
            kv_local = max(1, c.num_key_value_heads // emu.layout.tp)
            return (
                2
                * layers
                * rows
                * kv_local
                * self._cache_slots
                * c.head_dim
                * DTYPE_BYTES[self.cfg.model.dtype]
            )
        return 0

    async def _stamp_states(self, stages: list[str] | None = None) -> None:
        """The logical state of ``stages``' EMUs (default: all) as the workers hold it,
        with the job's policy version and sample position, written back to the stores
        and kept in the descriptions."""
        for stage in stages if stages is not None else list(self.emus):
            emus = self.emus[stage]
            states = await asyncio.gather(
                *(self.hosts[e.devices[0]].get_state.call_one(e.name) for e in emus)
            )
            counts = {s.get("update_count", 0) for s in states}
            require(
                len(counts) == 1,
                f"{stage} update counters",
                sorted(counts),
                "must agree across replicas",
            )
            state = LogicalState(counts.pop(), self.policy_version, self.sample_position)
            await asyncio.gather(
                *(
                    self.hosts[d].set_state.call_one(e.name, vars(state))
                    for e in emus
                    for d in e.devices
                )
            )
            self.emus[stage] = [e.with_(state=state) for e in emus]

    def _current_plan(self, stage: str) -> StagePlan:
        emus = self.emus[stage]
        return StagePlan(
            emus[0].layout.tp, emus[0].layout.pp, len(emus), tuple(e.devices for e in emus)
        )

    # --- checkpoint -----------------------------------------------------------------

    async def save(self, folder: str | Path) -> None:
        await self.transition_done()
        await self._stamp_states()
        out = Path(folder)
        for stage in ("policy_training", "critic_training"):
            if stage in self.emus:
                await save_to_disk(str(out / stage), self.emus[stage][0], self.hosts)

    async def load(self, folder: str | Path) -> None:
        """Read every training model-stage's checkpoint into its EMUs as they are now (any
        saved layout), then sync generation and the critic's inference from them."""
        await self.transition_done()
        src = Path(folder)
        state = None
        for stage in ("policy_training", "critic_training"):
            if stage not in self.emus:
                continue
            await self.handles[stage].stop()
            emus = self.emus[stage]
            await asyncio.gather(
                *(self.hosts[d].drop_shards.call_one([e.name]) for e in emus for d in e.devices)
            )
            loaded = [await load_from_disk(str(src / stage), e, self.hosts) for e in emus]
            self.emus[stage] = loaded
            state = loaded[0].state if stage == "policy_training" else state

            self.handles[stage] = await start_model_stage(
                self.cluster,
                self.hosts,
                stage,
                "training",
                loaded,
                model_config=self.model_config,
                options=self._options(stage),
                epoch=self.epoch,
            )
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
        errors: list[BaseException] = []
        if self.changes.running:
            try:
                await self.transition_done()
            except Exception as e:  # keep closing; raised at the end
                errors.append(e)
        groups = [g for _, g in self._sync.values() if g is not None]
        for handle in self.handles.values():
            groups += handle.groups
            try:
                await handle.stop()
            except Exception as e:  # keep closing; the first error is raised at the end
                errors.append(e)
        self.handles, self._sync = {}, {}
        try:
            for group in {g.group_id: g for g in groups}.values():
                await group.destroy()
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
