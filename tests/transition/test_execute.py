"""Executing transition DAGs on the simulated runtime: the paper's three overlap cases, 100
trials each with random durations and tie orders (every trial finishes, no device passes
its cap at any scheduler event, every model-stage stays covered), the estimate
reproduced exactly, a failure part way that leaves a valid collection, and the negative
control that must fail: the real dispatcher with one global rule and its cap check off."""

from __future__ import annotations

import asyncio
import random

import pytest

from nereus.transition import ALL_RULES, LinkModel, simulate
from nereus.transition.execute import NodeResult, SimulatedRuntime, execute_dag
from tests.transition.cases import CASES, RULE_CASES, covered, random_duration

MODEL = LinkModel(intra_bandwidth=1e9, inter_bandwidth=1e8)


class CheckingRuntime(SimulatedRuntime):
    """The simulated runtime, checking caps whenever a node starts and coverage whenever
    one ends (from the live EMUs the nodes leave behind)."""

    def __init__(self, dag, case, duration, fail=None) -> None:
        super().__init__(duration, fail)
        self.dag, self.case = dag, case
        self.live = {e.name: e for emus in case.emus(case.current).values() for e in emus}
        self.used = dict(dag.initial)
        self.over: list[tuple[int, int, int]] = []

    def start(self, node) -> None:
        for d, extra in node.alloc.items():
            self.used[d] = self.used.get(d, 0) + extra
            cap = self.dag.caps.get(d)
            if cap is not None and self.used[d] > cap:
                self.over.append((node.id, d, self.used[d]))
        super().start(node)

    async def next_done(self) -> NodeResult:
        result = await super().next_done()
        node = self.dag.nodes[result.node]
        if result.ok:
            for d, freed in node.release.items():
                self.used[d] -= freed
            from nereus.state.transition import op_step

            for op in node.ops:  # the EMUs the node leaves, as the workers' would
                step = op_step(op, self.live)
                for e in step.freed:
                    self.live.pop(e.name)
                for e in step.created:
                    self.live[e.name] = e
        else:
            for d, extra in node.alloc.items():
                self.used[d] -= extra
        for stage in self.case.current.names:
            emus = [e for e in self.live.values() if e.model_stage == stage]
            assert emus and covered(emus), (self.case.name, stage, sorted(self.live))
        return result


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_hundred_random_trials_finish_within_caps_and_keep_every_stage_covered(case):
    dag = case.dag(duration=MODEL.seconds)
    rng = random.Random(7)
    for trial in range(100):
        runtime = CheckingRuntime(dag, case, random_duration(rng))
        report = asyncio.run(execute_dag(dag, runtime, rng=random.Random(trial)))
        assert report.ok, (trial, report.error)
        assert sorted(report.finished) == [n.id for n in dag.nodes]
        assert not runtime.over, (trial, runtime.over)
        assert all(p <= case.cap() for p in report.peak.values())
        # and the stores end as the target plan says
        final = {}
        for e in runtime.live.values():
            final.setdefault(e.model_stage, set()).add((e.layout.tp, e.layout.pp, e.devices))
        for stage, sp in case.target:
            assert final[stage] == {(sp.tp, sp.pp, d) for d in sp.devices}, stage


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_simulated_runtime_with_modelled_durations_reproduces_the_estimate(case):
    dag = case.dag(duration=MODEL.seconds)
    estimate = simulate(dag, MODEL.seconds)
    report = asyncio.run(execute_dag(dag, SimulatedRuntime(MODEL.seconds), duration=MODEL.seconds))
    assert report.order == estimate.order
    assert {n: (r.start, r.end) for n, r in report.results.items()} == {
        n: (estimate.start[n], estimate.end[n]) for n in estimate.start
    }
    assert report.peak == estimate.peak
    assert report.predicted == {n.id: MODEL.seconds(n) for n in dag.nodes}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_failure_part_way_leaves_a_valid_collection(case):
    dag = case.dag(duration=MODEL.seconds)
    movers = [n.id for n in dag.nodes if n.kind != "destroy"]
    for victim in movers:
        runtime = CheckingRuntime(
            dag, case, MODEL.seconds, fail=lambda node, v=victim: node.id == v
        )
        report = asyncio.run(execute_dag(dag, runtime))
        assert report.failed == [victim] and not report.ok
        assert set(report.finished) | set(report.failed) | set(report.not_started) == {
            n.id for n in dag.nodes
        }
        # coverage was checked after every node by the runtime; what never started is named
        assert all(n not in report.results for n in report.not_started)


def test_memory_makes_model_stages_wait_for_each_others_destroys():
    """At least one resource edge appears in the overlap cases: an acquisition of one
    model-stage waits for a Destroy of another (or its own) on its device."""
    edges = {c.name: c.dag(duration=MODEL.seconds).resource_edges for c in CASES}
    assert sum(edges.values()) >= 1, edges
    dag = CASES[0].dag(duration=MODEL.seconds)
    for n in dag.nodes:
        for r in n.resource_deps:
            src = dag.nodes[r]
            assert src.kind == "destroy" and set(src.devices) & set(n.devices)
            assert n.id not in dag.reachable_from(n.id)  # still acyclic


def test_without_each_rule_and_the_net_the_real_dispatcher_passes_a_cap():
    """The negative control runs the real builder and dispatcher: with one global rule
    off and the dispatcher's cap check dropped, its own count of every device passes the
    cap in the rule's case under random durations; with every rule, never (the workers'
    version of this is ``test_rules``)."""
    over: dict[str, int] = {}
    for rule, case in [("all", c) for c in RULE_CASES.values()] + list(RULE_CASES.items()):
        off = ALL_RULES if rule == "all" else ALL_RULES.without(rule)
        key = f"{rule}: {case.name}"
        over[key] = 0
        rng = random.Random(7)
        for _ in range(50):
            dag = case.dag(
                duration=MODEL.seconds, rules=off if rule == "resource_edges" else ALL_RULES
            )
            runtime = SimulatedRuntime(random_duration(rng))
            report = asyncio.run(
                execute_dag(
                    dag, runtime, rules=None if rule == "resource_edges" else off, check_caps=False
                )
            )
            assert report.ok, report.error  # without the net nothing is ever blocked
            over[key] += any(report.peak[d] > case.cap() for d in report.peak)
    assert all(v == 0 for k, v in over.items() if k.startswith("all")), over
    assert all(v > 0 for k, v in over.items() if not k.startswith("all")), over
