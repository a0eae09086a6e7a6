"""Model-stages as EMUs over worker-resident state on a cluster, placed by a plan the job
holds and can change between steps.

``ClusterStages.start(cfg, model_config, model_dir)`` starts ``Cluster.local`` with
``cluster.devices`` CPU worker processes of ``cluster.memory_per_device`` each (or, with
``cluster.mode = "connect"``, attaches to the running cluster at ``cluster.address``,
whose workers outlive the job), spawns one ``EngineHost`` per device (the worker's shard
store and the engines over it), and for every model-stage of the plan fills the stores
with its EMUs' shards (each rank reads only its slices) and starts their engines
(``nereus.engines.spawn_model_stage``); a ``plan`` event on the tap says where they are.

The plan (``plan``): a ``nereus.planner.Plan`` under the job's model-stage names,
converted from the TOML ``[plan]``. ``await apply_plan(target)`` changes it at a step
boundary over the state the workers hold (nothing goes through the driver, nothing is
reloaded) through ONE transition DAG across every model-stage that moves
(``nereus.transition.build_dag``): planned and checked against every device's budget
first (``InfeasibleTransition`` or ``OutOfMemory`` before anything moves); the moving
model-stages' engines stop (generation gives back its KV cache); the DAG runs on the
workers (``execute_dag`` with ``WorkerRuntime``: ready primitives on disjoint devices at
once, the logical state -- update counter, policy version, sample position --
travelling with the tensors; every node's predicted and measured seconds on the tap as
``transition_node``, the whole as ``transition``, and into the calibration that prices
the next one); the cluster takes a fresh layout epoch (``Cluster.set_epoch``, stamped
on tap events); the moved model-stages' engines start again in it (training EMUs get
their new DP rank and size: the global batch stays fixed, rows per replica and
accumulation follow; generation reserves its KV cache again); groups nothing uses any
more are released; the weight-sync plans are rebuilt. Engines of model-stages that do
not move keep running. With ``overlap=True`` the DAG runs in the background: model-stages
on devices it does not touch go on with the next step (``transition_done()`` waits).

Devices: every live device gets an engine host at start; a device the cluster drains
(``Cluster.drain``) may not appear in a target and is retired once the change leaves it
empty; devices that join (``Cluster.add_node``, or a node joining a running controller)
get an engine host when the controller loop sees them (``ensure_hosts``) or at the
next change that uses them. Worker deaths and node departures are recorded (``failures``, ``failure_event``)
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
its training EMUs the same way, between any two layouts. With ``sampling.engine =
"vllm"`` each generation EMU's vLLM engine loads the written shards in place before the
sync returns (``EngineHost.run_into``). A ``weight_sync`` event with bytes, seconds and
GB/s goes on the tap, and the policy version advances.

Devices: on GPU workers (``cluster.mode = "connect"`` to nodes started with ``--gpus``)
every shard, reshard target, sync target and engine is on the worker's ``cuda:0``, so
the groups made for them are NCCL's; on CPU workers everything is on the CPU and the
groups are gloo's. Generation runs the built-in engine, or vLLM with ``sampling.engine
= "vllm"`` (its weights and KV cache reserved in the device's ledger, and counted by a
change's memory check).

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
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nereus.config import require
from nereus.errors import ActorDied
from nereus.rl.change import check_after, emu_name, stage_changed, stage_emus
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
        self._transition: asyncio.Future | None = None  # a change running in the background
        self._waiting: set[str] = set()  # model-stages that wait for it
        self.last_transition: dict[str, Any] | None = None  # the report of the last change
        self.learn_transitions = True  # measured transition nodes refit the link model
        self._sync: dict[str, tuple[list[Any], Any]] = {}  # target model-stage -> (plans, group)
        self._owns_cluster = False
        self._models: dict[str, tuple[Any, str]] = {}
        # seconds a change spends per model-stage it restarts beyond the DAG's moves
        # (engines stopped and started, their groups, the sync plans): measured
        self._restart_s: deque[float] = deque(maxlen=4)
        # model-stages a fault left without an intact EMU: the next change builds them
        # (nereus.rl.recovery)
        self._missing: set[str] = set()
        self._spawn_s: list[float] = []  # spawning each model-stage at start: the guess before any change

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

    def _generation_rows(self, sp: Any) -> int:
        """Sequences one generation EMU decodes at once under ``sp``: its share of the
        step's rollouts, in ``sp.waves`` successive batches."""
        return math.ceil(math.ceil(self.cfg.algorithm.rollouts_per_step / sp.dp) / sp.waves)

    def _options(self, stage: str, sp: Any = None) -> dict[str, Any]:
        """The engine options of ``stage`` under its plan ``sp`` (default: the current one):
        generation decodes in ``sp.waves`` batches, training recomputes with ``sp.recompute``."""
        cfg = self.cfg
        sp = sp if sp is not None else self._plan[stage]
        kind = STAGE_KINDS[stage]
        if kind == "generation" and cfg.sampling.engine == "vllm":
            return {"engine": "vllm", "model_dir": self._models["policy"][1],
                    "kv_cache_bytes": self._vllm_cache_bytes(sp), "seed": cfg.run.seed}
        if kind == "generation":
            return {"max_batch": self._generation_rows(sp)}
        if kind == "inference":
            return {"micro_batch_size": cfg.optim.micro_batch_size}
        return {"optim": engine_optim(cfg, critic=stage == "critic_training"), "recompute": sp.recompute}

    def _vllm_cache_bytes(self, sp: Any) -> int:
        """vLLM's KV cache per rank of a generation EMU under ``sp``: its rows at the
        model's full length, rounded up to whole blocks of 128 slots (the largest block
        vLLM's backends use), twice over (vLLM's CPU backend fits half the tokens that
        the keys' and values' bytes alone would give)."""
        from nereus.state.spec import DTYPE_BYTES

        c = self.model_config
        slots = -(-c.max_position_embeddings // 128) * 128
        kv_local = max(1, c.num_key_value_heads // sp.tp)
        per_token = 2 * c.num_hidden_layers * kv_local * c.head_dim * DTYPE_BYTES[self.cfg.model.dtype]
        return 2 * per_token * slots * self._generation_rows(sp)

    async def ensure_hosts(self, devices: set[int]) -> None:
        """An engine host on every device of ``devices`` that has none yet (a device that
        joined gets one at once, before any change uses it)."""
        await self._ensure_hosts(set(devices))

    async def _ensure_hosts(self, devices: set[int]) -> None:
        """An engine host on every device of ``devices`` that has none yet."""
        from nereus.engines import spawn_hosts

        missing = sorted(d for d in devices if d not in self.hosts)
        if missing:
            mesh = await spawn_hosts(self.cluster, missing, name=f"nereus-hosts-e{self.epoch}-{missing[0]}")
            self._host_meshes.append(mesh)
            self.hosts.update({r.device: r for r in mesh.refs})
        if self.cfg.adapt.enabled:
            # a job that changes its plan may build training engines on any of its
            # devices; their one-time process cost is paid here, not inside a change
            training = {d for stage in ("policy_training", "critic_training") if stage in self._plan.names
                        for d in self._plan[stage].devices}
            idle = [d for d in sorted(devices) if d in self.hosts and d not in training]
            await asyncio.gather(*(self.hosts[d].warm_up.call_one() for d in idle))

    async def _start_all(self) -> None:
        from nereus.engines import spawn_model_stage
        from nereus.planner import Calibrator
        from nereus.planner._probe import local_cpu_cluster_probed, local_cpu_efficiency
        from nereus.transition import LinkModel

        # what transitions are priced with: this machine's rates (probed once, cached),
        # refitted from every measured transition node
        budget = min((d.memory_bytes for d in self.cluster.devices), default=2**30)
        self.cluster_spec = local_cpu_cluster_probed(max(1, len(self.cluster.devices)), max(budget, 2))
        # firm priors: one plan's timings cannot tell apart classes that scale together
        self.calibrator = Calibrator(prior=local_cpu_efficiency(), prior_weight=0.05)
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
        await self._ensure_hosts({d.index for d in self.cluster.devices} - set(getattr(self.cluster, "draining", ())))
        for stage, sp in self._plan:
            emus = stage_emus(stage, sp, self._spec(stage), self._slots(stage))
            config, folder = self._models["reward" if stage == "reward_inference" else "policy"]
            t = time.perf_counter()
            self.handles[stage] = await spawn_model_stage(
                self.cluster, self.hosts, stage, STAGE_KINDS[stage], emus, model_config=config, model_dir=folder,
                seed=self.cfg.run.seed, options=self._options(stage), epoch=self.epoch)
            # a first guess at what restarting a model-stage's engines costs in a change
            self._spawn_s.append(time.perf_counter() - t)
            self.emus[stage] = emus
        await self._plan_syncs()
        if "critic_inference" in self.emus:
            await self._run_sync("critic_inference")
        # the plan the job starts in; it was given ([plan]), not searched: no prediction
        _emit("plan", plan=self._plan.to_dict(), predicted_step_seconds=None)

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
        await self._ready("policy_training")
        await self._ready("policy_generation")
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
        return {"token_ids": out.token_ids, "logprobs": out.logprobs, "policy_version": [self.policy_version] * len(prompts)}

    def _handle(self, stage: str) -> Any:
        require(stage in self.handles, "plan", sorted(self.handles), f"must place model-stage {stage!r}")
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

    async def train_policy(self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]) -> dict[str, float]:
        await self._ready("policy_training")
        handle = self._handle("policy_training")
        self._check_rows("policy_training", batch)
        with self.timed("policy_training"):
            return await handle.train_step(batch, loss, loss_kwargs, self.cfg.optim.micro_batch_size,
                                           self.cfg.sampling.temperature)

    async def train_critic(self, batch: dict[str, torch.Tensor], loss: str, loss_kwargs: dict[str, Any]) -> dict[str, float]:
        await self._ready("critic_training")
        await self._ready("critic_inference")
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

    def _engine_bytes(self, stage: str, sp: Any, emu: Any, device: int) -> int:
        """What ``stage``'s engine (under its plan ``sp``) adds on ``device`` beyond the
        store: a training EMU's gradients, a generation EMU's KV cache at its last size."""
        from nereus.state import layer_bounds
        from nereus.state.spec import DTYPE_BYTES, grad_bytes_per_param

        kind = STAGE_KINDS[stage]
        if kind == "training":
            params = sum(s.numel for k, (s, _) in emu.shards_on(device).items() if ":" not in k)
            return params * grad_bytes_per_param(self.cfg.model.dtype)
        if kind == "generation" and self.cfg.sampling.engine == "vllm":
            # vLLM's own copy of the weights and the KV cache it is given
            params = sum(s.numel for k, (s, _) in emu.shards_on(device).items() if ":" not in k)
            return params * DTYPE_BYTES[self.cfg.model.dtype] + self._vllm_cache_bytes(sp)
        if kind == "generation" and self._cache_slots:
            c = self.model_config
            pp_rank, tp_rank = emu.position(device)
            bounds = layer_bounds(emu.layout, c.num_hidden_layers)
            layers = bounds[pp_rank + 1] - bounds[pp_rank]
            rows = self._generation_rows(sp)
            kv_local = max(1, c.num_key_value_heads // emu.layout.tp)
            return 2 * layers * rows * kv_local * self._cache_slots * c.head_dim * DTYPE_BYTES[self.cfg.model.dtype]
        return 0

    async def _stamp_states(self, stages: list[str] | None = None) -> None:
        """The logical state of ``stages``' EMUs (default: all) as the workers hold it,
        with the job's policy version and sample position, written back to the stores
        and kept in the descriptions."""
        from nereus.state import LogicalState

        for stage in stages if stages is not None else list(self.emus):
            emus = self.emus[stage]
            states = await asyncio.gather(*(self.hosts[e.devices[0]].get_state.call_one(e.name) for e in emus))
            counts = {s.get("update_count", 0) for s in states}
            require(len(counts) == 1, f"{stage} update counters", sorted(counts), "must agree across replicas")
            state = LogicalState(counts.pop(), self.policy_version, self.sample_position)
            await asyncio.gather(*(self.hosts[d].set_state.call_one(e.name, vars(state)) for e in emus for d in e.devices))
            self.emus[stage] = [e.with_(state=state) for e in emus]

    def _current_plan(self, stage: str) -> Any:
        from nereus.planner.plan import StagePlan

        emus = self.emus[stage]
        return StagePlan(emus[0].layout.tp, emus[0].layout.pp, len(emus), tuple(e.devices for e in emus))

    async def change_inputs(self) -> dict[str, Any]:
        """What pricing a change needs from the workers, read once per boundary: every
        device's ledger (what it holds besides the job's EMUs) and the generation KV
        caches' slots."""
        gen = self.handles["policy_generation"].emus if "policy_generation" in self.handles else []
        memory, *shapes = await asyncio.gather(self.memory(), *(h.cache_shape() for h in gen))
        return {"memory": memory, "cache_slots": max((s[1] for s in shapes), default=0)}

    def plan_change(self, target: Any, inputs: dict[str, Any]) -> tuple[Any, float]:
        """The transition DAG from the job's plan to ``target`` (device ids) and its
        predicted seconds (the scheduler's makespan under the link model); pure over
        ``inputs`` (``change_inputs``). Raises ``InfeasibleTransition`` when the DAG
        cannot keep a device under its cap and ``OutOfMemory`` when the restarted engines
        would not fit after it."""
        from nereus.planner.plan import Plan
        from nereus.transition import build_dag

        moving = [s for s in self._plan.names if stage_changed(self._current_plan(s), target[s])]
        if self._missing:  # the DAG moves what exists; a missing model-stage is built after it
            target = Plan(tuple((s, target[s]) for s in self._plan.names))
        resident = _resident(inputs["memory"], [e.name for emus in self.emus.values() for e in emus],
                             engines=[e.name for s in moving for e in self.emus[s]])
        one_host = len({self._host_of(d) for d in self.hosts}) == 1
        dag = build_dag(
            self._plan, target, {s: es[0].spec for s, es in self.emus.items()}, self._device_set(),
            slots={s: es[0].slots for s, es in self.emus.items()},
            names={s: [e.name for e in es] for s, es in self.emus.items()}, resident=resident,
            host_of=self._host_of, bucket_bytes=0 if one_host else DEFAULT_BUCKET_BYTES, duration=self.link.seconds,
            share=self.link.sharing)
        slots, self._cache_slots = self._cache_slots, inputs["cache_slots"] if "policy_generation" in moving else 0
        try:
            engines: dict[int, int] = {}
            for stage in moving:
                for rep in dag.results[stage]:
                    emu = self.emus[stage][0].with_(name=rep.name, layout=rep.layout, devices=rep.devices)
                    for d in rep.devices:
                        engines[d] = engines.get(d, 0) + self._engine_bytes(stage, target[stage], emu, d)
        finally:
            self._cache_slots = slots
        check_after(dag, engines)
        return dag, self.link.total(dag, dag.schedule.makespan)

    @property
    def restart_seconds(self) -> float:
        """What a change costs per model-stage it restarts beyond the DAG's moves: the
        mean of the last measured changes (before any: of spawning them at start, which
        also loaded the weights, an upper bound)."""
        seen = self._restart_s or self._spawn_s
        return sum(seen) / len(seen) if seen else 0.0

    def estimate_change(self, target: Any, inputs: dict[str, Any]) -> tuple[float, int]:
        """(predicted seconds, bytes moved) of changing to ``target``: the DAG's makespan
        plus ``restart_seconds`` per model-stage whose engines restart; ``(inf, 0)`` when
        the change cannot run (``plan_change`` refused it)."""
        from nereus.errors import InfeasiblePlan, OutOfMemory

        try:
            dag, seconds = self.plan_change(target, inputs)
        except (InfeasiblePlan, OutOfMemory) as e:
            log.info("a change to %s cannot run: %s", target.to_dict(), e)
            return math.inf, 0
        restarted = [s for s in self._plan.names if self._plan[s] != target[s]]
        return seconds + len(restarted) * self.restart_seconds, dag.bytes

    async def apply_plan(self, target: Any, *, overlap: bool = False) -> dict[str, Any]:
        """Change the job's plan to ``target`` at a step boundary through one transition
        DAG over every model-stage that moves (see the module docstring).

        Refused before anything moves: a target with other model-stages or devices that
        are not live or are draining (``ConfigError``), one whose DAG cannot keep every
        device under its cap (``InfeasibleTransition``) or whose engines would not fit
        after it (``OutOfMemory``). With ``overlap``, the DAG runs in the background and
        this returns once it started: model-stages on devices it does not touch go on
        with the next step's work, the others wait for it (``transition_done()`` waits
        too). Returns (or, with ``overlap``, ``transition_done()`` returns) a report:
        ``changed`` model-stages, ``bytes`` the plans move between devices,
        ``bytes_measured`` (the workers' counters), ``predicted_seconds`` (the DAG's
        makespan), ``seconds`` and its parts (``plan_s``, ``engines_stop_s``, ``moves_s``,
        ``groups_s``, ``engines_s``, ``sync_plans_s``), ``nodes``, ``resource_edges``,
        the new ``epoch``."""
        from nereus.planner.plan import Plan
        from nereus.transition.workers import WorkerRuntime

        await self.transition_done()
        t0 = time.perf_counter()
        require(isinstance(target, Plan), "target", type(target).__name__, "must be a nereus.planner.Plan")
        stages = set(self._plan.names) | self._missing
        require(set(target.names) == stages, "target plan", target.names,
                f"must place exactly the job's model-stages {sorted(stages)}")
        await self.cluster.refresh_devices()
        live = {d.index for d in self.cluster.devices}
        draining = set(getattr(self.cluster, "draining", ()))
        bad = sorted(d for d in target.devices if d not in live or d in draining)
        require(not bad, "target plan devices", bad, f"must be live devices that are not draining (live: {sorted(live - draining)})")
        report: dict[str, Any] = {"from": self._plan.to_dict(), "to": target.to_dict(), "epoch_from": self.epoch}
        moving = [s for s in self._plan.names if stage_changed(self._current_plan(s), target[s])]
        # what the change moves, checked against every budget before anything moves; the
        # engines of model-stages that do not move stay as they are, with their groups
        await self._stamp_states(moving)
        inputs = await self.change_inputs()
        dag, predicted = self.plan_change(target, inputs)
        self._cache_slots = inputs["cache_slots"] if "policy_generation" in moving else 0
        # model-stages that keep their EMUs but decode in other waves or (stop) recompute,
        # and those whose engines a fault stopped (nereus.rl.recovery)
        retuned = [s for s in self._plan.names
                   if s not in moving and (self._plan[s] != target[s] or s not in self.handles)]
        missing = sorted(self._missing)
        new_epoch = max(self.epoch, self.cluster.epoch) + 1
        t_plan = time.perf_counter()
        report.update(changed=list(dag.results), retuned=retuned, rebuilt=missing, bytes=dag.bytes,
                      predicted_seconds=predicted, nodes=len(dag.nodes), resource_edges=dag.resource_edges)
        # the moving model-stages' engines stop (gradients, KV caches and activations
        # leave the ledgers); their groups go once nothing else uses them
        retired = []
        for stage in [*moving, *retuned]:
            handle = self.handles.pop(stage, None)
            if handle is not None:
                await handle.stop()
                retired += handle.groups
        t_stop = time.perf_counter()
        report.update(plan_s=t_plan - t0, engines_stop_s=t_stop - t_plan)
        await self._ensure_hosts(set(target.devices))
        touched = dag.devices()
        self._waiting = {s for s in self._plan.names
                         if s in moving or s in retuned or not touched.isdisjoint(self._current_plan(s).device_set)}
        self._waiting |= set(missing)
        runtime = WorkerRuntime({e.name: e for es in self.emus.values() for e in es}, self.hosts, self.cluster,
                                epoch=new_epoch)
        work = self._finish_change(dag, runtime, target, moving, retuned, retired, new_epoch, report, t0, missing)
        if not overlap:
            self.last_transition = await work
            return self.last_transition
        self._transition = asyncio.ensure_future(work)
        return report

    async def transition_done(self) -> dict[str, Any] | None:
        """Wait for a change started with ``overlap``; its report (None when none runs).
        Raises what the change raised."""
        task, self._transition = self._transition, None
        if task is None:
            return None
        try:
            self.last_transition = await task
            return self.last_transition
        finally:
            self._waiting = set()

    async def _ready(self, stage: str) -> None:
        """Return once ``stage`` may work: at once, unless an overlapped change is moving
        it or runs on its devices."""
        if self._transition is not None and stage in self._waiting:
            await self.transition_done()

    async def _finish_change(self, dag: Any, runtime: Any, target: Any, moving: list[str], retuned: list[str],
                             retired: list[Any], new_epoch: int, report: dict[str, Any], t0: float,
                             missing: list[str] = ()) -> dict[str, Any]:
        from nereus.transfer import release_groups
        from nereus.transition.execute import execute_dag

        t_moves0 = time.perf_counter()
        report["moves_started_at"] = t_moves0
        result = await execute_dag(dag, runtime, duration=self.link.seconds, on_node=self._node_event(t_moves0))
        report["moves_ended_at"] = time.perf_counter()
        # the transition's groups are its own
        await release_groups(self.cluster, new_epoch, tag="transition")
        report.update(bytes_measured=result.bytes_measured, nodes_finished=len(result.finished))
        if not result.ok:
            from nereus.rl.recovery import salvage

            report.update(ok=False, seconds=time.perf_counter() - t0)
            _emit_transition(report, dag)
            await salvage(self, runtime)  # what the DAG left, as the job's plan
            raise result.error if result.error is not None else RuntimeError("the transition stopped part way")
        from nereus.rl.recovery import is_fault
        died: list[BaseException] = []
        for stage in moving:
            reps = dag.results[stage]
            renames = {rep.name: emu_name(stage, i) for i, rep in enumerate(reps) if rep.name != emu_name(stage, i)}
            if renames:
                devices = sorted({d for rep in reps for d in rep.devices})
                done = await asyncio.gather(*(self.hosts[d].rename.call_one(renames) for d in devices),
                                            return_exceptions=True)
                for r in done:
                    if isinstance(r, BaseException):
                        if not is_fault(r):
                            raise r
                        died.append(r)
            self.emus[stage] = [runtime.live[rep.name].with_(name=emu_name(stage, i)) for i, rep in enumerate(reps)]
        t_moves = time.perf_counter()  # the span the estimate predicts: the nodes, the groups' release, the renames
        if self.learn_transitions and not died:
            self._learn_transition(dag, result, t_moves - report["moves_ended_at"])
        self.epoch = new_epoch
        self._plan = target
        if died:
            # every move landed and the survivors hold the new names: the job's plan is the
            # target, and the fault is the job's to recover from there, like one mid-step
            report.update(ok=False, seconds=time.perf_counter() - t0)
            _emit_transition(report, dag)
            await self.cluster.set_epoch(self.epoch)
            raise died[0]
        await self.cluster.set_epoch(self.epoch)
        timing = await self._start_engines([*moving, *retuned])
        await self._build_missing(missing)
        t_engines = time.perf_counter()
        retired += [group for _, group in self._sync.values() if group is not None]
        await self._plan_syncs()
        for stage in missing:  # built from the model folder: the in-place syncs give them today's weights
            if stage in self._sync:
                await self._run_sync(stage)
        await self._release_unused(retired)
        await self._retire_drained()
        t_end = time.perf_counter()
        report.update(ok=True, epoch=self.epoch, seconds=t_end - t0, moves_s=t_moves - t_moves0,
                      groups_s=timing["groups_s"], engines_s=t_engines - t_moves - timing["groups_s"],
                      sync_plans_s=t_end - t_engines, measured_seconds=t_moves - t_moves0)
        if moving or retuned:
            self._restart_s.append((report["seconds"] - report["measured_seconds"]) / len([*moving, *retuned]))
        _emit_transition(report, dag)
        log.info("plan changed to epoch %d (%s): %d bytes moved in %.3f s (predicted %.3f s)", self.epoch,
                 report["changed"], report["bytes"], report["seconds"], report["predicted_seconds"])
        return report

    async def _build_missing(self, missing: list[str]) -> None:
        """Model-stages a fault left without an intact EMU, built at the plan's placement
        from the model folder (a training one holds the initial weights until the job
        restores a checkpoint into it)."""
        from nereus.engines import spawn_model_stage

        for stage in missing:
            emus = stage_emus(stage, self._plan[stage], self._spec(stage), self._slots(stage))
            config, folder = self._models["reward" if stage == "reward_inference" else "policy"]
            self.handles[stage] = await spawn_model_stage(
                self.cluster, self.hosts, stage, STAGE_KINDS[stage], emus, model_config=config, model_dir=folder,
                seed=self.cfg.run.seed, options=self._options(stage), epoch=self.epoch)
            self.emus[stage] = emus
            self._missing.discard(stage)

    def _node_event(self, t0: float) -> Callable[[Any, Any], None]:
        def emit_node(node: Any, result: Any) -> None:
            _emit("transition_node", node=node.id, kind=node.kind, model_stage=node.stage, count=node.count,
                  devices=list(node.devices), bytes=node.bytes, predicted_seconds=self.link.seconds(node),
                  measured_seconds=result.seconds, start_seconds=result.start - t0, end_seconds=result.end - t0,
                  ok=result.ok)

        return emit_node

    def _learn_transition(self, dag: Any, result: Any, outside_s: float) -> None:
        """What a transition took teaches the next estimate: each node's time at a
        device's full rate (nodes that ran at once shared the cores), and the time
        spent outside the nodes (a fixed cost and releasing the groups the nodes made)."""
        from nereus.transition import full_rate_seconds

        spans = {n.id: (result.results[n.id].start, result.results[n.id].end, len(n.devices)) for n in dag.nodes}
        alone = full_rate_seconds(spans, self.link.sharing)
        for node in dag.nodes:
            self.calibrator.observe_transition(self.link.ideal(node), max(alone[node.id], 1e-6))
        self.calibrator.observe_transition(self.link.outside(dag), max(outside_s, 1e-6))
        self._refit_link()

    def _refit_link(self) -> None:
        from nereus.transition import LinkModel

        self.link = LinkModel.of(self.cluster_spec, self.calibrator.fit())

    async def _release_unused(self, groups: list[Any]) -> None:
        """Destroy ``groups`` that no engine and no sync uses any more."""
        used = {g.group_id for h in self.handles.values() for g in h.groups}
        used |= {g.group_id for _, g in self._sync.values() if g is not None}
        gone: dict[str, Any] = {g.group_id: g for g in groups if g.group_id not in used}
        for group in gone.values():
            await group.destroy()

    async def _start_engines(self, stages: list[str]) -> dict[str, float]:
        """``stages``' engines over the EMUs the stores hold now, in this epoch."""
        from nereus.engines import start_model_stage
        from nereus.engines.stage import stage_groups

        t0 = time.perf_counter()
        for stage in stages:  # made one after another; start_model_stage finds them made
            await stage_groups(self.cluster, STAGE_KINDS[stage], self.emus[stage], epoch=self.epoch)
        groups_s = time.perf_counter() - t0

        async def start(stage: str, emus: list[Any]) -> None:
            config, _ = self._models["reward" if stage == "reward_inference" else "policy"]
            caches = None
            if STAGE_KINDS[stage] == "generation" and self._cache_slots:
                rows = self._generation_rows(self._plan[stage])
                caches = {e.name: [rows, self._cache_slots] for e in emus}
            self.handles[stage] = await start_model_stage(
                self.cluster, self.hosts, stage, STAGE_KINDS[stage], emus, model_config=config,
                options=self._options(stage), epoch=self.epoch, caches=caches)

        # every model-stage at once: a device's host builds its engines one after another
        await asyncio.gather(*(start(stage, self.emus[stage]) for stage in stages))
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

        await self.transition_done()
        await self._stamp_states()
        out = Path(folder)
        for stage in ("policy_training", "critic_training"):
            if stage in self.emus:
                await save_to_disk(str(out / stage), self.emus[stage][0], self.hosts)

    async def load(self, folder: str | Path) -> None:
        """Read every training model-stage's checkpoint into its EMUs as they are now (any
        saved layout), then sync generation and the critic's inference from them."""
        from nereus.state import load_from_disk

        await self.transition_done()
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
        if self._transition is not None:
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


def _resident(memory: dict[int, dict[str, Any]], names: list[str], engines: list[str]) -> dict[int, int]:
    """Per device, what its ledger holds besides the job's EMUs (``shards/<name>``), the
    engines that stop for the change (``<name>/...``) and transfers in flight: what a
    change must work around."""
    mine = tuple(f"shards/{n}" for n in names) + tuple(f"{n}/" for n in engines) + ("transfer/",)
    return {d: sum(v for k, v in m["breakdown"].items() if not k.startswith(mine)) for d, m in memory.items()}


def _emit_transition(report: dict[str, Any], dag: Any) -> None:
    _emit("transition", from_plan=report["from"], to_plan=report["to"], changed=report.get("changed", []),
          bytes=report.get("bytes", 0), bytes_measured=report.get("bytes_measured", 0),
          predicted_seconds=report.get("predicted_seconds", 0.0), measured_seconds=report.get("seconds", 0.0),
          nodes=len(dag.nodes), resource_edges=dag.resource_edges, epoch_from=report["epoch_from"],
          ok=report.get("ok", False), moves_seconds=report.get("measured_seconds", 0.0),
          parts_seconds={k.removesuffix("_s"): report[k] for k in _PARTS if k in report})


_PARTS = ("plan_s", "engines_stop_s", "moves_s", "groups_s", "engines_s", "sync_plans_s")


def _emit(type_: str, **fields: Any) -> None:
    from nereus.actors import emit

    emit(type_, **fields)

