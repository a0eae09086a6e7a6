"""Coordinating model-stages' transitions: the global DAG against local DAGs run apart.

    .venv/bin/python -m benchmarks.coordination [--trials 100] [--deadline-s 5] [--seed 0]

The paper's Table 5: the three overlap types -- the same model across stages (policy
generation and training trade devices), different models in one stage (reference and
critic inference swap and reshape), different models across stages (PPO) -- on 4 real
worker processes whose shard stores keep memory ledgers with the type's cap as budget.
Each trial draws a device assignment (the type's plans on a random permutation of the
devices), a launch time per model-stage (0-200 ms: when its engines let go of its
tensors) and 0-40 ms of delay inside every worker before each plan part it runs; then
runs the transition twice on the same draws:

- ``nereus``: one global DAG (``build_dag`` with every rule, ``execute_dag``); a node of
  a model-stage does not start its primitives before that model-stage's launch time;
- ``per_component``: DynaRL-style, each model-stage's local DAG (``build_dag`` over that
  model-stage alone: its own edges and memory, no cross-stage edge, no other
  model-stage's bytes) run by its own executor, all at once from their launch times.

A trial succeeds when every DAG finishes within ``--deadline-s``, every model-stage's
EMUs are the target's (layouts and devices, read back from the workers) and no worker's
ledger refused an allocation (a budget conflict). The workers are replaced after a
trial past its deadline (a deadlocked exchange leaves them waiting). Reported per type:
success rate, seconds of the successful trials (median), the edges the global DAG adds
across model-stages (resource edges), the failures by kind. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from nereus.actors import Cluster, endpoint
from nereus.errors import OutOfMemory, RemoteError
from nereus.models.config import ModelConfig
from nereus.models.spec import model_spec, shard_tensor
from nereus.planner import Plan, StagePlan
from nereus.state import EMU, Layout, LogicalState, split_key, training_slots
from nereus.state.apply import TORCH_DTYPES
from nereus.state.holder import ShardHolder
from nereus.transfer import release_groups
from nereus.transition import TransitionDAG, build_dag
from nereus.transition.execute import TransitionReport, execute_dag
from nereus.transition.workers import WorkerRuntime
from tests.transition.cases import CASES

SPEC = model_spec(
    ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        architecture="qwen2",
        attention_bias=True,
    ),
    dtype="float32",
)
TRAIN = training_slots("float32")
LAUNCH_S = 0.2  # model-stages' launch times are drawn from 0 .. this
DELAY_S = 0.04  # each worker waits 0 .. this before each plan part


@dataclass(frozen=True)
class Overlap:
    """One overlap type: plans on devices 0-3, each model-stage's slots, the cap in
    copies of the model's weights."""

    name: str
    current: Plan
    target: Plan
    slots: dict[str, tuple[str, ...]]
    cap_factor: float

    @property
    def cap(self) -> int:
        return int(self.cap_factor * SPEC.nbytes)

    def on(self, perm: list[int]) -> tuple[Plan, Plan]:
        """Both plans with device ``d`` renamed ``perm[d]``."""

        def moved(p: Plan) -> Plan:
            return Plan(
                tuple(
                    (
                        n,
                        StagePlan(
                            sp.tp,
                            sp.pp,
                            sp.dp,
                            tuple(tuple(perm[d] for d in r) for r in sp.devices),
                        ),
                    )
                    for n, sp in p
                )
            )

        return moved(self.current), moved(self.target)


# The paper's three overlap types are the cases the DAG's tests run (tests/transition/
# cases.py), named here as Table 5 names them.
TYPE_NAMES = (
    "same model, across stages",
    "different models, one stage",
    "different models, across stages",
)
TYPES = [
    Overlap(name, c.current, c.target, c.slots, c.cap_factor)
    for name, c in zip(TYPE_NAMES, CASES, strict=True)
]


class JitterHolder(ShardHolder):
    """A shard store that waits a random 0-``DELAY_S`` before each plan part it runs."""

    @endpoint
    async def run_plan(
        self,
        part: dict,
        group: str | None = None,
        group_devices=(),
        free=(),
        state: dict | None = None,
    ) -> dict:
        await asyncio.sleep(random.uniform(0.0, DELAY_S))
        return await super().run_plan(part, group, group_devices, free, state)

    @endpoint
    async def set_budget(self, nbytes: int) -> None:
        self.ledger.budget_bytes = nbytes


class LaunchedRuntime(WorkerRuntime):
    """``WorkerRuntime`` whose nodes of a model-stage wait for that model-stage's launch
    time (seconds after ``t0``) before running their primitives."""

    def __init__(self, *args: Any, launch: dict[str, float], t0: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.launch, self.t0 = launch, t0

    def running(self) -> list[asyncio.Task]:
        return list(self._tasks)

    async def _run(self, node):
        await asyncio.sleep(max(0.0, self.t0 + self.launch[node.stage] - time.perf_counter()))
        return await super()._run(node)


STATE = LogicalState(3, 2, 40)


def _emus(plan: Plan, slots: dict[str, tuple[str, ...]]) -> dict[str, list[EMU]]:
    return {
        s: [
            EMU(f"{s}.{i}", s, SPEC, Layout(sp.tp, sp.pp), d, slots.get(s, ("param",))).with_(
                state=STATE
            )
            for i, d in enumerate(sp.devices)
        ]
        for s, sp in plan
    }


def _full(emu: EMU, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        key: torch.randn(SPEC[split_key(key)[1]].shape, generator=gen).to(
            TORCH_DTYPES[emu.slot_dtype(split_key(key)[0], SPEC[split_key(key)[1]])]
        )
        for key in emu.keys()
    }


async def _load(refs: dict, emus: dict[str, list[EMU]], seed: int) -> None:
    for stage_emus in emus.values():
        full = _full(stage_emus[0], seed)
        for e in stage_emus:
            for d in e.devices:
                _, tp_rank = e.position(d)
                shards = {
                    k: shard_tensor(SPEC[split_key(k)[1]], full[k], tp_rank, e.layout.tp)
                    for k in e.shards_on(d)
                }
                await refs[d].put_shards.call_one(e.name, shards, vars(STATE))


def _local(plan: Plan, stage: str) -> Plan:
    """``plan`` of ``stage`` alone: a local DAG sees only its own model-stage's EMUs."""
    return Plan(((stage, plan[stage]),))


def _cross_edges(dag: TransitionDAG) -> int:
    """Edges between nodes of different model-stages (resource edges)."""
    return sum(1 for n in dag.nodes for d in n.deps if dag.nodes[d].stage != n.stage)


def _reached(target: Plan, live: dict[str, EMU], stage: str) -> bool:
    final = sorted(
        (e.layout.tp, e.layout.pp, e.devices) for e in live.values() if e.model_stage == stage
    )
    sp = target[stage]
    return final == sorted((sp.tp, sp.pp, tuple(d)) for d in sp.devices)


def _conflict(error: BaseException | None) -> bool:
    return isinstance(error, OutOfMemory) or (
        isinstance(error, RemoteError) and error.remote_type == "OutOfMemory"
    )


@dataclass
class Trial:
    ok: bool
    seconds: float
    why: str
    edges: int = 0


class Bench:
    """A local cluster of 4 workers, replaced by a new one when a trial left them stuck."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.cluster: Cluster | None = None
        self.refs: dict[int, Any] = {}
        self.epoch = 1000

    async def fresh(self) -> None:
        await self.close()
        self.cluster = await Cluster.local(
            devices=4, memory_per_device=self.budget, heartbeat_timeout_s=60.0
        ).start()
        mesh = await self.cluster.spawn("coordination", JitterHolder, devices=[0, 1, 2, 3])
        self.refs = {r.device: r for r in mesh.refs}

    async def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            await cluster.close()

    async def clear(self, trial: Trial) -> None:
        """Drop every shard after a trial; new workers when it ran past its deadline (an
        exchange may still wait) or a ledger still accounts bytes."""
        if trial.why == "deadline":
            await self.fresh()
            return
        for ref in self.refs.values():
            held = await ref.held.call_one()
            await ref.drop_shards.call_one(list(held))
        used = [(await ref.ledger_report.call_one())["used_bytes"] for ref in self.refs.values()]
        if any(used):
            await self.fresh()

    async def run(
        self,
        kind: Overlap,
        mode: str,
        perm: list[int],
        launch: dict[str, float],
        seed: int,
        deadline_s: float,
    ) -> Trial:
        current, target = kind.on(perm)
        cluster = self.cluster
        assert cluster is not None, "fresh() first"
        for ref in self.refs.values():
            await ref.set_budget.call_one(kind.cap)
        emus = _emus(current, kind.slots)
        await _load(self.refs, emus, seed)
        by_name = {e.name: e for es in emus.values() for e in es}
        caps = {"devices": lambda d: kind.cap, "slots": kind.slots}
        t0 = time.perf_counter()
        runs: list[tuple[str | None, TransitionDAG, LaunchedRuntime]] = []
        if mode == "nereus":
            dag = build_dag(
                current,
                target,
                dict.fromkeys(current.names, SPEC),
                caps["devices"],
                slots=kind.slots,
            )
            runs.append(
                (
                    None,
                    dag,
                    LaunchedRuntime(
                        by_name, self.refs, cluster, epoch=self.epoch, launch=launch, t0=t0
                    ),
                )
            )
        else:
            for i, stage in enumerate(current.names):
                dag = build_dag(
                    _local(current, stage),
                    _local(target, stage),
                    {stage: SPEC},
                    caps["devices"],
                    slots=kind.slots,
                )
                runs.append(
                    (
                        stage,
                        dag,
                        LaunchedRuntime(
                            by_name,
                            self.refs,
                            cluster,
                            epoch=self.epoch + 1 + i,
                            launch=launch,
                            t0=t0,
                        ),
                    )
                )
        self.epoch += 1 + len(current.names)
        rng = random.Random(seed)
        tasks = [
            asyncio.ensure_future(execute_dag(dag, rt, rng=random.Random(rng.random())))
            for _, dag, rt in runs
        ]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        seconds = time.perf_counter() - t0
        edges = sum(_cross_edges(dag) for _, dag, _ in runs)
        if pending:  # a deadlock (or a run past the deadline): stop waiting for its nodes
            for t in [*pending, *(n for _, _, rt in runs for n in rt.running())]:
                t.cancel()
            await asyncio.gather(
                *pending, *(n for _, _, rt in runs for n in rt.running()), return_exceptions=True
            )
            return Trial(False, seconds, "deadline", edges)
        for _, _, rt in runs:  # every group the trial made (each holds sockets in every worker)
            await release_groups(cluster, rt.epoch, tag=rt.group_tag)
        reports: list[TransitionReport] = [t.result() for t in tasks]
        errors = [r.error for r in reports if r.error is not None]
        if any(_conflict(e) for e in errors):
            return Trial(False, seconds, "budget", edges)
        if errors or not all(r.ok for r in reports):
            return Trial(
                False, seconds, f"error: {type(errors[0]).__name__ if errors else 'not ok'}", edges
            )
        held = {d: await ref.held.call_one() for d, ref in self.refs.items()}
        for stage, _, rt in runs:
            for s in [stage] if stage is not None else list(current.names):
                final = [e for e in rt.live.values() if e.model_stage == s]
                if not _reached(target, rt.live, s) or any(
                    e.name not in held[d] for e in final for d in e.devices
                ):
                    return Trial(False, seconds, "target", edges)
        return Trial(True, seconds, "", edges)


async def measure(trials: int, deadline_s: float, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    bench = Bench(max(k.cap for k in TYPES))
    await bench.fresh()
    try:
        for kind in TYPES:
            rng = random.Random(f"{seed}:{kind.name}")
            rows: dict[str, list[Trial]] = {"nereus": [], "per_component": []}
            for t in range(trials):
                perm = rng.sample(range(4), 4)
                launch = {s: rng.uniform(0.0, LAUNCH_S) for s in kind.current.names}
                for mode in rows:
                    trial = await bench.run(
                        kind, mode, perm, launch, seed * 100_003 + t, deadline_s
                    )
                    rows[mode].append(trial)
                    await bench.clear(trial)
            out[kind.name] = rows
            for mode, got in rows.items():
                ok = [r for r in got if r.ok]
                whys: dict[str, int] = {}
                for r in got:
                    if not r.ok:
                        whys[r.why] = whys.get(r.why, 0) + 1
                secs = statistics.median(r.seconds for r in ok) if ok else float("nan")
                edges = statistics.mean(r.edges for r in got)
                print(
                    f"{kind.name:34} {mode:14} success {len(ok)}/{len(got)}  successful median "
                    f"{secs:.3f} s  cross-stage edges {edges:.2f}  failures {whys}",
                    flush=True,
                )
    finally:
        await bench.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trials", type=int, default=100, help="trials per overlap type (each runs both ways)"
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=5.0,
        help="a trial's DAGs must all finish within this (a successful one takes under a second)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = asyncio.run(measure(args.trials, args.deadline_s, args.seed))

    def rate(kind: str, mode: str) -> float:
        got = rows[kind][mode]
        return sum(r.ok for r in got) / len(got)

    result = {
        "nereus_success": min(rate(k.name, "nereus") for k in TYPES),
        "per_component_success": {k.name: rate(k.name, "per_component") for k in TYPES},
        "nereus_success_by_type": {k.name: rate(k.name, "nereus") for k in TYPES},
        "successful_seconds_median": {
            k.name: {
                m: round(statistics.median([r.seconds for r in rows[k.name][m] if r.ok]), 3)
                if any(r.ok for r in rows[k.name][m])
                else None
                for m in ("nereus", "per_component")
            }
            for k in TYPES
        },
        "edges_added": {
            k.name: round(statistics.mean(r.edges for r in rows[k.name]["nereus"]), 2)
            for k in TYPES
        },
        "trials": args.trials,
        "deadline_s": args.deadline_s,
        "seed": args.seed,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
