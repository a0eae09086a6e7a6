"""The ground truth of CPU workers of a fixed capacity: the ``[cpu]`` table.

A cluster whose devices carry a CPU quota (``ClusterSpec.device_cores``: a host's worker
processes, each under a kernel quota) is no GPU: ``GroundTruth`` times and sizes its
steps, moves and restarts here, from what ``python -m benchmarks.cpu_truth`` measured of
the project's engines and transfer plane on such a worker, fitted into per-token,
per-pass and per-byte figures (``ground_truth.toml`` holds them, the measured points and
the command). Written apart from the planner: no cost, memory or explain function of
``nereus.planner`` is imported (a test reads the imports).

- a replica's CPU seconds: generation = call + new tokens x (decode step + rows at once x
  decode row), per wave; inference = micro-batches x pass + tokens x token; training
  likewise plus its step; x the model's parameters over the measured model's (an
  assumption for other models); as wall seconds under the replica's quota (its slowest
  device's): the kernel runs ``quota x period_s`` of a worker's work per period, the
  first from a full budget (its worker idled while others worked; ``elapsed``), so a
  short model-stage runs at a full core. TP t divides the work by t and adds two
  all-reduces per layer and pass; PP p divides inference and training by p over a 1F1B
  pipeline and adds a send per stage and pass (generation gains nothing from PP); DP
  training all-reduces its float32 gradients once per optimizer step: assumptions on
  the measured collectives (wall seconds under the measured quota, scaled by quotas).
- a step runs its model-stages one after the other (``nereus.rl.algorithms``: the sync
  step awaits each in turn), then broadcasts the trained weights to the model-stages
  that generate or infer with them, plus the controller's own work (at a full core).
- memory, as the workers' ledgers count it: parameters x the bytes per parameter each
  kind holds; generation's KV cache (bytes per token, held to the end of the step);
  a micro-batch's activations (bytes per token and per token squared) for inference
  and training; no workspace (the ledger holds tensors only).
- a move: each changed model-stage's group set-up, its state broadcast and its engine
  start, the model-stages side by side on their own workers; a restart: every engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from nereus.planner.cluster import ClusterSpec
from nereus.planner.plan import Plan, StagePlan
from nereus.planner.workload import ModelShape, ModelStage, Workload

__all__ = ["CPU_KEYS", "CpuTruth", "uses_cpu_truth"]

KINDS = ("generation", "inference", "training")
# the [cpu] table's keys (every one a number >= 0; what each is: ground_truth.toml)
CPU_KEYS: tuple[str, ...] = (
    "cores",
    "period_s",
    "params",
    "hidden_size",
    "num_layers",
    "prompt_tokens",
    *(f"{k}_resident_bytes_per_param" for k in KINDS),
    *(f"{k}_start_s" for k in KINDS),
    "generation_call_s",
    "decode_step_s",
    "decode_row_s",
    "inference_micro_batch_s",
    "inference_token_s",
    "training_step_s",
    "training_micro_batch_s",
    "training_token_s",
    "controller_step_s",
    "controller_token_s",
    "generation_bytes_per_token",
    "inference_bytes_per_token",
    "inference_bytes_per_token_squared",
    "training_bytes_per_token",
    "training_bytes_per_token_squared",
    "allreduce_step_s",
    "allreduce_byte_s",
    "broadcast_s",
    "broadcast_byte_s",
    "group_s",
    "group_rank_s",
)
# which model-stages take their weights from which training model-stage after a step
_TRAINED_BY = {"policy": "policy-training", "critic": "critic-training"}


def uses_cpu_truth(cluster: ClusterSpec) -> bool:
    """Whether the ``[cpu]`` table describes ``cluster``'s devices: they carry a quota."""
    return cluster.device_cores is not None


class CpuTruth:
    """The ``[cpu]`` table applied to one job on one cluster (module docstring)."""

    def __init__(self, table: Mapping[str, float], cluster: ClusterSpec, work: Workload) -> None:
        self.t, self.cluster, self.work = dict(table), cluster, work
        self.cores = tuple(cluster.device_cores or ())

    # --- rates --------------------------------------------------------------------------

    def _quota(self, devices: object) -> float:
        """The cores a replica on ``devices`` runs at: its slowest device's quota."""
        ids = [d for d in devices if 0 <= d < len(self.cores)]  # type: ignore[attr-defined]
        return min((self.cores[d] for d in ids), default=min(self.cores, default=1.0))

    def _slow(self, devices: object) -> float:
        """How much longer than measured a wall-time figure (a collective, an engine start,
        measured under the measured quota) takes on ``devices``: the quotas' ratio."""
        return self.t["cores"] / self._quota(devices)

    def elapsed(self, cpu_s: float, quota: float) -> float:
        """Wall seconds of ``cpu_s`` CPU seconds of one thread's work under a quota of
        ``quota`` cores: ``quota x period_s`` of work a period, the last part at a full
        core, from a full budget (the worker idled before)."""
        budget = min(1.0, quota) * self.t["period_s"]
        if quota >= 1.0 or cpu_s <= budget:
            return cpu_s
        periods = math.ceil(cpu_s / budget) - 1
        return periods * self.t["period_s"] + (cpu_s - periods * budget)

    def _size(self, model: ModelShape) -> float:
        return model.num_params / self.t["params"]

    def allreduce_s(self, nbytes: float, ranks: int, slow: float = 1.0) -> float:
        """A gloo ring all-reduce of ``nbytes`` over ``ranks`` workers."""
        if ranks <= 1:
            return 0.0
        steps = 2.0 * (ranks - 1)
        t = self.t
        return slow * (
            steps * t["allreduce_step_s"] + steps / ranks * nbytes * t["allreduce_byte_s"]
        )

    def broadcast_s(self, nbytes: float, slow: float = 1.0) -> float:
        """A broadcast (or one send) of ``nbytes`` to other workers."""
        return slow * (self.t["broadcast_s"] + nbytes * self.t["broadcast_byte_s"])

    # --- a model-stage ---------------------------------------------------------------------

    def stage_seconds(self, stage: ModelStage, sp: StagePlan, mean: float, longest: int) -> float:
        """One replica of ``stage`` on ``sp`` at the step's mean and longest response."""
        work, t = self.work, self.t
        model = work.models[stage.model]
        quota, size = self._quota(sp.device_set), self._size(model)
        seqs = math.ceil(work.sequences / sp.dp)
        h, layers = model.hidden_size, model.num_layers
        if stage.kind == "generation":
            at_once = max(1, math.ceil(seqs / sp.waves))
            waves = math.ceil(seqs / at_once)
            decode = longest * (t["decode_step_s"] + at_once * t["decode_row_s"])
            body = self.elapsed(waves * (t["generation_call_s"] + decode) * size / sp.tp, quota)
            if sp.tp > 1:
                body += waves * longest * 2 * layers * self.allreduce_s(at_once * h * 4, sp.tp)
            if sp.pp > 1:
                body += waves * longest * (sp.pp - 1) * self.broadcast_s(at_once * h * 4)
            return body
        train = stage.kind == "training"
        seq_len = work.prompt_length + mean
        epochs = work.epochs if train else 1
        micro = max(1, math.ceil(seqs / work.micro_batch)) * epochs
        tokens = seqs * seq_len * epochs
        if train:
            ideal = (
                work.optimizer_steps * t["training_step_s"]
                + micro * t["training_micro_batch_s"]
                + tokens * t["training_token_s"]
            )
        else:
            ideal = micro * t["inference_micro_batch_s"] + tokens * t["inference_token_s"]
        body = self.elapsed(ideal * size / (sp.tp * sp.pp), quota)
        passes = 2 if train else 1
        message = work.micro_batch * seq_len * h * 4
        if sp.tp > 1:
            body += micro * passes * 2 * layers * self.allreduce_s(message, sp.tp)
        if sp.pp > 1:
            per_step = micro / (work.optimizer_steps if train else 1)
            body *= (per_step + sp.pp - 1) / per_step
            body += micro * passes * (sp.pp - 1) * self.broadcast_s(message)
        if train and sp.dp > 1:
            grads = 4.0 * model.num_params / (sp.tp * sp.pp)  # float32 gradients
            body += work.optimizer_steps * self.allreduce_s(grads, sp.dp, self._slow(sp.device_set))
        return body

    def sync_seconds(self, plan: Plan) -> float:
        """The weights a step trained, broadcast to the model-stages that use them."""
        seconds = 0.0
        for stage in self.work.stages:
            source = _TRAINED_BY.get(stage.model)
            if stage.kind == "training" or source is None or source not in plan.names:
                continue
            model = self.work.models[stage.model]
            devices = plan[stage.name].device_set | plan[source].device_set
            seconds += self.broadcast_s(4.0 * model.num_params, self._slow(devices))
        return seconds

    def step_seconds(self, plan: Plan, mean: float) -> float:
        """A step's seconds beyond its model-stages: weight broadcasts and the controller."""
        return self.sync_seconds(plan) + self.controller_seconds(mean)

    def device_bytes(
        self, plan: Plan, resident: Mapping[str, int], transient: Mapping[str, int]
    ) -> dict[int, int]:
        """Each device's ledger peak in a step: its model-stages' resident bytes,
        generation's KV cache (held to the step's end) and the largest other transient
        (the model-stages run one after the other)."""
        stages = {s.name: s for s in self.work.stages}
        on: dict[int, list[str]] = {}
        for name, sp in plan:
            for d in sp.device_set:
                on.setdefault(d, []).append(name)
        out = {}
        for d, names in sorted(on.items()):
            held = [n for n in names if self.held(stages[n])]
            rest = [transient[n] for n in names if n not in held]
            need = sum(resident[n] for n in names) + sum(transient[n] for n in held)
            out[d] = need + max(rest, default=0)
        return out

    def controller_seconds(self, mean: float) -> float:
        """The controller's own work in a step (rewards, advantages, batches): its CPU
        seconds, at a full core (the driver runs under no quota)."""
        tokens = self.work.sequences * (self.work.prompt_length + mean)
        return self.t["controller_step_s"] + tokens * self.t["controller_token_s"]

    # --- memory ----------------------------------------------------------------------------

    def stage_bytes(self, stage: ModelStage, sp: StagePlan, longest: int) -> tuple[int, int]:
        """(resident, transient) ledger bytes of one device of ``stage`` on ``sp``."""
        work, t = self.work, self.t
        model = work.models[stage.model]
        share = sp.tp * sp.pp
        resident = model.num_params * t[f"{stage.kind}_resident_bytes_per_param"] / share
        width = self._width(model)
        seq_len = work.prompt_length + longest
        if stage.kind == "generation":
            at_once = max(1, math.ceil(math.ceil(work.sequences / sp.dp) / sp.waves))
            per_token = t["generation_bytes_per_token"] * width / share
            return int(resident), int(at_once * seq_len * per_token)
        per = t[f"{stage.kind}_bytes_per_token"] * seq_len
        per += t[f"{stage.kind}_bytes_per_token_squared"] * seq_len * seq_len
        transient = work.micro_batch * per * width / sp.tp
        if sp.pp > 1:
            # a stage holds its layers' share for the micro-batches in flight
            micro = max(1, math.ceil(math.ceil(work.sequences / sp.dp) / work.micro_batch))
            in_flight = min(sp.pp, micro) if stage.kind == "training" else 1
            transient *= in_flight / sp.pp
        return int(resident), int(transient)

    def _width(self, model: ModelShape) -> float:
        """A token's cached and activation bytes against the measured model's: in
        proportion to hidden size x layers (an assumption for other models)."""
        measured = self.t["hidden_size"] * self.t["num_layers"]
        return model.hidden_size * model.num_layers / measured

    @staticmethod
    def held(stage: ModelStage) -> bool:
        """Whether the model-stage's transient bytes stay reserved to the end of the step
        (generation's KV cache, as the ledger shows after a step)."""
        return stage.kind == "generation"

    # --- moves -----------------------------------------------------------------------------

    def _place_s(self, stage: ModelStage, sp: StagePlan) -> float:
        """Placing ``stage`` on ``sp``'s devices: a group over its replicas, its state
        broadcast, its engine started."""
        t = self.t
        model = self.work.models[stage.model]
        slow = self._slow(sp.device_set)
        ranks = len(sp.device_set)
        state = 4.0 * model.num_params / (sp.tp * sp.pp)
        if stage.kind == "training":
            state *= 3  # weights and both AdamW moments
        return slow * (
            t["group_s"]
            + ranks * t["group_rank_s"]
            + t[f"{stage.kind}_start_s"] * self._size(model)
        ) + self.broadcast_s(state, slow)

    def move_seconds(self, current: Plan, target: Plan) -> float:
        """A live move ``current`` -> ``target``: every model-stage whose EMUs change is
        placed again, side by side on their own workers (the longest counts)."""
        if current == target:
            return 0.0
        return max(
            (
                self._place_s(s, target[s.name])
                for s in self.work.stages
                if current[s.name] != target[s.name]
            ),
            default=0.0,
        )

    def restart_seconds(self, plan: Plan) -> float:
        """A restart onto ``plan``: every model-stage placed, one after the other."""
        return sum(self._place_s(s, plan[s.name]) for s in self.work.stages)

    def bandwidth(self) -> float:
        """Bytes per second of a large broadcast between two workers at the measured quota."""
        return 1.0 / max(self.t["broadcast_byte_s"], 1e-15)
