"""Every policy on one scenario: ``simulate(config)`` builds the scenario once and runs
each policy of ``config.policies`` on it (``nereus.sim.run.run_policy``), and the
``oracle`` reference (``nereus.sim.oracle``) when named; every other result then gets
the oracle's compute on its own steps, pools and straggler draws."""

from __future__ import annotations

from nereus.sim.oracle import Oracle, matched_compute, run_oracle
from nereus.sim.policies import ORACLE, POLICIES, make_policy
from nereus.sim.run import (
    PolicyResult,
    Scenario,
    SimConfig,
    SimulationError,
    build_scenario,
    policy_context,
    run_policy,
)
from nereus.sim.truth import TruthParams

__all__ = ["run_policies", "simulate"]


def run_policies(
    scn: Scenario,
    policies: tuple[str, ...] = POLICIES,
    *,
    gamma: float = 0.5,
    k: int = 3,
    join_horizon_steps: float = 20.0,
    min_steps_between: int = 0,
    keep_stopped: bool = False,
) -> list[PolicyResult]:
    """Every policy in ``policies`` on ``scn`` (the same traces, ground truth and seed),
    each with its own transition cache. ``oracle`` is run by ``nereus.sim.oracle``; when
    it runs, every other result gets ``oracle_compute_s`` (the oracle on its own steps,
    pools and straggler draws). A run that ends in ``SimulationError`` raises it, or with
    ``keep_stopped`` is kept up to there with ``stopped`` set to the error and the other
    policies run on."""
    oracle = Oracle(scn) if ORACLE in policies else None
    results = []
    for name in policies:
        if oracle is not None and name == ORACLE:
            results.append(run_oracle(scn, oracle))
            continue
        policy = make_policy(
            name,
            policy_context(scn),
            gamma=gamma,
            k=k,
            join_horizon_steps=join_horizon_steps,
            min_steps_between=min_steps_between,
        )
        try:
            results.append(run_policy(scn, policy))
        except SimulationError as e:
            if not keep_stopped or e.result is None:
                raise
            e.result.stopped = str(e)
            results.append(e.result)
    if oracle is not None:
        for r in results:
            if r.policy != ORACLE:
                r.oracle_compute_s = matched_compute(oracle, r)
    return results


def simulate(
    config: SimConfig, *, params: TruthParams | None = None, scenario: Scenario | None = None
) -> list[PolicyResult]:
    """Every policy of ``config`` on its scenario (built from ``config`` unless given); a
    policy whose run cannot go on is reported up to there (``stopped``), not dropped."""
    scn = scenario or build_scenario(config, params)
    return run_policies(
        scn,
        config.policies,
        gamma=config.gamma,
        k=config.k,
        join_horizon_steps=config.join_horizon_steps,
        min_steps_between=config.min_steps_between,
        keep_stopped=True,
    )
