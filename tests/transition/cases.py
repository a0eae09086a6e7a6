"""The paper's three overlap cases as plans on 4 devices, with caps that make model-stages
compete for memory, and what the tests check a run against (coverage of every tensor,
caps at every scheduler event). Also the negative control: the same per-model-stage
primitive lists run without the global rules."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass

from nereus.planner import Plan, StagePlan
from nereus.state import EMU, Layout, training_slots
from nereus.state.primitives import missing_boxes
from nereus.transition import TransitionDAG, build_dag
from nereus.transition.analytic import SpecBytes
from tests.state.helpers import spec_for

SPEC = spec_for(layers=4, heads=4, kv_heads=2, head_dim=8, intermediate=64, vocab=64)
VALUE = SPEC  # a critic's trunk; the value head does not change what the cases test


def plan(**stages: tuple[int, int, list[list[int]]]) -> Plan:
    return Plan(tuple((n, StagePlan(tp, pp, len(d), tuple(tuple(x) for x in d))) for n, (tp, pp, d) in stages.items()))


@dataclass(frozen=True)
class Case:
    name: str
    current: Plan
    target: Plan
    slots: dict[str, tuple[str, ...]]
    cap_factor: float  # caps: this many copies of the policy's weights (params only)

    @property
    def specs(self) -> dict[str, object]:
        return {n: SPEC for n in self.current.names}

    def cap(self) -> int:
        return int(self.cap_factor * SPEC.nbytes)

    def dag(self, **kw) -> TransitionDAG:
        return build_dag(self.current, self.target, self.specs, lambda d: self.cap(), slots=self.slots, **kw)

    def emus(self, p: Plan, tag: str = "") -> dict[str, list[EMU]]:
        return {s: [EMU(f"{s}.{tag}{i}", s, SPEC, Layout(sp.tp, sp.pp), d, self.slots.get(s, ("param",)))
                    for i, d in enumerate(sp.devices)] for s, sp in p}


TRAIN = training_slots("float32")
CASES = [
    # the same model across stages: policy-generation and policy-training trade devices
    Case("same model across stages",
         plan(policy_generation=(2, 1, [[0, 1]]), policy_training=(1, 2, [[2, 3]])),
         plan(policy_generation=(1, 1, [[2], [3]]), policy_training=(2, 1, [[0, 1]])),
         {"policy_training": TRAIN}, 2.4),
    # different models in one stage: reference- and critic-inference swap and reshape
    Case("different models in one stage",
         plan(reference_inference=(2, 1, [[0, 1]]), critic_inference=(1, 1, [[2], [3]])),
         plan(reference_inference=(1, 1, [[2], [3]]), critic_inference=(2, 1, [[0, 1]])),
         {}, 1.6),
    # different models across stages, PPO with a critic
    Case("different models across stages (PPO)",
         plan(policy_generation=(1, 1, [[0], [1], [2], [3]]), reference_inference=(1, 1, [[2]]),
              critic_inference=(1, 1, [[3]]), policy_training=(2, 1, [[0, 1]]), critic_training=(2, 1, [[2, 3]])),
         plan(policy_generation=(2, 1, [[0, 1], [2, 3]]), reference_inference=(1, 1, [[0]]),
              critic_inference=(1, 1, [[1]]), policy_training=(2, 1, [[2, 3]]), critic_training=(2, 1, [[0, 1]])),
         {"policy_training": TRAIN, "critic_training": TRAIN}, 4.4),
]


def covered(stage_emus: list[EMU]) -> bool:
    """Whether ``stage_emus`` together hold every tensor of their model-stage."""
    ref = stage_emus[0]
    whole = EMU("whole", ref.model_stage, ref.spec, Layout(1, 1), (10_000,), ref.slots)
    return not missing_boxes(whole, stage_emus)


def random_duration(rng: random.Random) -> Callable[[object], float]:
    return lambda node: rng.uniform(0.1, 2.0)


class NaiveRun:
    """The negative control: every model-stage runs its primitives one after another, on
    its own, as independent lists; a primitive's message reaches each of its devices'
    queues at its own moment (a driver sends one message per worker) and takes its turn
    there (a worker runs one at a time, in arrival order); it runs once it heads them
    all; nothing checks memory. Deadlocks (a cycle of primitives each waiting at the head
    of a queue the other holds) and cap violations are what the global rules prevent."""

    def __init__(self, dag: TransitionDAG, rng: random.Random) -> None:
        self.dag, self.rng = dag, rng

    def run(self) -> tuple[bool, bool]:
        """(deadlocked, broke a cap)."""
        dag, rng = self.dag, self.rng
        by_stage: dict[str, list[int]] = {}
        for n in dag.nodes:
            by_stage.setdefault(n.stage, []).append(n.id)
        nxt = {s: 0 for s in by_stage}
        queues: dict[int, list[int]] = {d: [] for d in dag.devices()}
        used = dict(dag.initial)
        broke = False
        clock, events, running = 0.0, [], set()
        arrivals: list[tuple[float, int, int]] = []

        def submit(t: float, nid: int) -> None:
            for d in dag.nodes[nid].devices:  # each worker's message arrives on its own
                heapq.heappush(arrivals, (t + rng.uniform(0, 0.3), nid, d))

        for s in by_stage:  # each list submits its first primitive after a random delay
            submit(rng.uniform(0, 1), by_stage[s][0])
        done = 0
        while done < len(dag.nodes):
            # arrivals join every device queue of their primitive
            while arrivals and (not events or arrivals[0][0] <= events[0][0]):
                t, nid, d = heapq.heappop(arrivals)
                clock = max(clock, t)
                queues[d].append(nid)
            started = True
            while started:
                started = False
                for nid in {q[0] for q in queues.values() if q}:
                    node = dag.nodes[nid]
                    if nid not in running and all(queues[d] and queues[d][0] == nid for d in node.devices):
                        running.add(nid)
                        for d, extra in node.alloc.items():
                            used[d] = used.get(d, 0) + extra
                            cap = dag.caps.get(d)
                            broke |= cap is not None and used[d] > cap
                        heapq.heappush(events, (clock + rng.uniform(0.1, 2.0), nid))
                        started = True
            if not events:
                if arrivals:
                    continue
                return True, broke  # nothing runs, nothing comes: a circular wait
            clock, nid = heapq.heappop(events)
            running.discard(nid)
            node = dag.nodes[nid]
            for d, freed in node.release.items():
                used[d] = used.get(d, 0) - freed
            for d in node.devices:
                queues[d].remove(nid)
            done += 1
            stage = node.stage
            nxt[stage] += 1
            if nxt[stage] < len(by_stage[stage]):
                submit(clock + rng.uniform(0, 0.5), by_stage[stage][nxt[stage]])
        return False, broke


def table(case: Case, stage: str) -> SpecBytes:
    return SpecBytes(SPEC, case.slots.get(stage, ("param",)))
