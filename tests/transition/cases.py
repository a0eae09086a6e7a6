"""The paper's three overlap cases as plans on 4 devices, with caps that make model-stages
compete for memory, and what the tests check a run against (coverage of every tensor,
caps at every scheduler event). ``RULE_CASES``: for each global rule, a case that needs
it (run without it and without the dispatcher's cap check, a worker's ledger overflows)."""

from __future__ import annotations

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
    return Plan(
        tuple(
            (n, StagePlan(tp, pp, len(d), tuple(tuple(x) for x in d)))
            for n, (tp, pp, d) in stages.items()
        )
    )


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
        return build_dag(
            self.current, self.target, self.specs, lambda d: self.cap(), slots=self.slots, **kw
        )

    def emus(self, p: Plan, tag: str = "") -> dict[str, list[EMU]]:
        return {
            s: [
                EMU(
                    f"{s}.{tag}{i}", s, SPEC, Layout(sp.tp, sp.pp), d, self.slots.get(s, ("param",))
                )
                for i, d in enumerate(sp.devices)
            ]
            for s, sp in p
        }


TRAIN = training_slots("float32")
CASES = [
    # the same model across stages: policy-generation and policy-training trade devices
    Case(
        "same model across stages",
        plan(policy_generation=(2, 1, [[0, 1]]), policy_training=(1, 2, [[2, 3]])),
        plan(policy_generation=(1, 1, [[2], [3]]), policy_training=(2, 1, [[0, 1]])),
        {"policy_training": TRAIN},
        2.4,
    ),
    # different models in one stage: reference- and critic-inference swap and reshape
    Case(
        "different models in one stage",
        plan(reference_inference=(2, 1, [[0, 1]]), critic_inference=(1, 1, [[2], [3]])),
        plan(reference_inference=(1, 1, [[2], [3]]), critic_inference=(2, 1, [[0, 1]])),
        {},
        1.6,
    ),
    # different models across stages, PPO with a critic
    Case(
        "different models across stages (PPO)",
        plan(
            policy_generation=(1, 1, [[0], [1], [2], [3]]),
            reference_inference=(1, 1, [[2]]),
            critic_inference=(1, 1, [[3]]),
            policy_training=(2, 1, [[0, 1]]),
            critic_training=(2, 1, [[2, 3]]),
        ),
        plan(
            policy_generation=(2, 1, [[0, 1], [2, 3]]),
            reference_inference=(1, 1, [[0]]),
            critic_inference=(1, 1, [[1]]),
            policy_training=(2, 1, [[2, 3]]),
            critic_training=(2, 1, [[0, 1]]),
        ),
        {"policy_training": TRAIN, "critic_training": TRAIN},
        4.4,
    ),
]


# a generation Merge frees more than it takes on devices 0-1; the training Extend onto
# them fits only after it. The training model-stage is listed first (lower node ids), so
# only the generation -> inference -> training tie order starts the Merge first.
STAGE_ORDER = Case(
    "generation before training on shared devices",
    plan(policy_training=(2, 1, [[2, 3]]), policy_generation=(1, 1, [[0], [1]])),
    plan(policy_training=(2, 1, [[0, 1]]), policy_generation=(2, 1, [[0, 1]])),
    {"policy_training": TRAIN},
    2.2,
)
# the rule (a ``Rules`` field) -> a case that overflows a cap without it
RULE_CASES = {"release_first": CASES[1], "stage_order": STAGE_ORDER, "resource_edges": CASES[0]}


def covered(stage_emus: list[EMU]) -> bool:
    """Whether ``stage_emus`` together hold every tensor of their model-stage."""
    ref = stage_emus[0]
    whole = EMU("whole", ref.model_stage, ref.spec, Layout(1, 1), (10_000,), ref.slots)
    return not missing_boxes(whole, stage_emus)


def random_duration(rng: random.Random) -> Callable[[object], float]:
    return lambda node: rng.uniform(0.1, 2.0)


def table(case: Case, stage: str) -> SpecBytes:
    return SpecBytes(SPEC, case.slots.get(stage, ("param",)))
