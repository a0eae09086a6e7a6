"""``nereus plan``: search a plan and explain it so it can be checked by hand.

    nereus plan --cluster a100-256 --model llama-8b --algo ppo --length 4096

prints the cluster and workload as the planner sees them, the chosen plan, the step
time as phases of overlapping groups, every model-stage's terms with their formulas
(ideal seconds / efficiency = seconds), memory per device by kind against the usable
memory, and the next-best placements with why each lost. ``--json`` prints the plan and
its predicted times as one JSON object instead.

Exit status: 0 with a plan, 1 when no plan fits (the reason is printed), 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from nereus.config import parse_size
from nereus.errors import ConfigError, InfeasiblePlan, exit_status
from nereus.planner.candidates import stage_candidates
from nereus.planner.cluster import PRESETS, ClusterSpec, cluster_preset
from nereus.planner.cost import CONSERVATIVE, Efficiency, usable_bytes
from nereus.planner.explain import Explanation, explain
from nereus.planner.plan_text import plan_text, stage_plan_text
from nereus.planner.search import SearchResult, search
from nereus.planner.workload import ALGORITHMS, MODEL_PRESETS, LengthStats, Workload, model_preset

__all__ = ["main"]

GiB = 2**30


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nereus plan", description="Search and explain a plan for an RL job."
    )
    p.add_argument("--cluster", default="a100-256", help=f"one of {sorted(PRESETS)} or local-cpu")
    p.add_argument("--nodes", type=int, help="override the preset's node count")
    p.add_argument(
        "--devices", type=int, help="device budget (default: every device of the cluster)"
    )
    p.add_argument("--local-devices", type=int, default=4, help="local-cpu: worker processes")
    p.add_argument("--memory", default="2GiB", help="local-cpu: memory budget per worker")
    p.add_argument(
        "--cores-per-device",
        default="shared",
        help="local-cpu: each worker's CPU cores (a number, one per worker like 0.25,0.5, "
        "or 'shared')",
    )
    p.add_argument(
        "--model", default="llama-8b", help=f"policy and reference: one of {sorted(MODEL_PRESETS)}"
    )
    p.add_argument("--value-model", help="critic and reward trunk (default: the policy's)")
    p.add_argument("--algo", default="ppo", choices=ALGORITHMS)
    p.add_argument(
        "--no-reward-model", action="store_true", help="rule-based reward (no reward-inference)"
    )
    p.add_argument("--length", type=int, default=4096, help="maximum response length (tokens)")
    p.add_argument("--mean-length", type=float, help="mean response length (default 0.5 x length)")
    p.add_argument("--p95-length", type=float, help="95th percentile (default 0.9 x length)")
    p.add_argument("--prompt-length", type=int, default=512)
    p.add_argument("--prompts", type=int, default=256, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: all)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per forward/backward pass")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def _cluster(args: argparse.Namespace) -> ClusterSpec:
    if args.cluster == "local-cpu":
        from nereus.planner._probe import local_cpu_cluster_probed

        return local_cpu_cluster_probed(
            args.local_devices,
            parse_size(args.memory, "--memory"),
            device_cores=_device_cores(args.cores_per_device, args.local_devices),
        )
    return cluster_preset(args.cluster, args.nodes)


def _device_cores(text: str, devices: int) -> list[float] | None:
    if text == "shared":
        return None
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            f"--cores-per-device={text!r} must be 'shared', a number or one per worker"
        ) from None
    if len(values) == 1:
        values *= devices
    if len(values) != devices or min(values) <= 0:
        raise ConfigError(
            f"--cores-per-device={text!r} must give {devices} numbers > 0 (one per worker)"
        )
    return values


def _workload(args: argparse.Namespace) -> Workload:
    policy = model_preset(args.model)
    value = model_preset(args.value_model).as_value_model() if args.value_model else None
    mean = args.mean_length if args.mean_length is not None else 0.5 * args.length
    p95 = args.p95_length if args.p95_length is not None else max(mean, 0.9 * args.length)
    return Workload.for_models(
        args.algo,
        policy,
        prompts_per_step=args.prompts,
        samples_per_prompt=args.samples,
        prompt_length=args.prompt_length,
        lengths=LengthStats(mean, p95, args.length),
        value=value,
        reward_model=not args.no_reward_model,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _print_tables(
    console: Console,
    result: SearchResult,
    ex: Explanation,
    work: Workload,
    cluster: ClusterSpec,
    eff: Efficiency,
) -> None:
    c = cluster
    console.print(
        f"[bold]cluster[/] {c.name}: {c.nodes} nodes x {c.devices_per_node} devices, "
        f"{_gib(c.device_memory_bytes)} GiB/device (usable {_gib(ex.memory[0].usable)} after "
        "10% headroom), "
        f"peak {c.peak_flops:.3g} FLOP/s, memory {c.memory_bandwidth:.3g} B/s, intra-node "
        f"{c.intra_node_bandwidth:.3g} B/s, "
        f"inter-node {c.inter_node_bandwidth:.3g} B/s per node "
        f"({c.device_share_of_inter_node():.3g} per device)"
    )
    models = ", ".join(
        f"{role}={m.name} ({_count(m.num_params)} params)"
        for role, m in sorted(work.models.items())
    )
    console.print(
        f"[bold]workload[/] {work.algorithm}: {models}; {work.prompts_per_step} prompts x "
        f"{work.samples_per_prompt} "
        f"samples = {work.sequences} sequences, prompt {work.prompt_length} tok, response "
        f"mean {work.lengths.mean:.0f} / "
        f"p95 {work.lengths.p95:.0f} / max {work.lengths.max} tok, optimizer batch "
        f"{work.batch}, micro-batch {work.micro_batch}"
    )
    console.print(
        "[bold]efficiency[/] " + ", ".join(f"{k}={v:.2f}" for k, v in eff.as_dict().items())
    )

    t = Table(title=f"plan: {result.step_seconds:.3f} s/step predicted")
    for col in ("model-stage", "phase", "plan", "devices", "links (pp, dp)", "seconds"):
        t.add_column(col)
    for s in ex.stages:
        t.add_row(
            s.name,
            str(s.phase),
            stage_plan_text(s.plan),
            str(s.plan.num_devices),
            f"{'inter' if s.pp_inter else 'intra'}, {'inter' if s.dp_inter else 'intra'}",
            f"{s.cost.seconds:.3f}",
        )
    console.print(t)

    lines = []
    for ph in ex.phases:
        parts = [
            " + ".join(g) + f" = {sec:.3f}"
            for g, sec in zip(ph.groups, ph.group_seconds, strict=True)
        ]
        lines.append(f"phase {ph.phase}: max( {' | '.join(parts)} ) = {ph.seconds:.3f} s")
    lines.append(
        f"step = {' + '.join(f'{p.seconds:.3f}' for p in ex.phases)} = {ex.step_seconds:.3f} s "
        "(phases run one after another; groups sharing devices serialize, '|' overlap)"
    )
    console.print("\n".join(lines))

    t = Table(title="terms: seconds = Σ ideal_c / efficiency_c")
    for col in ("model-stage", "term", "ideal s by op class", "seconds", "formula"):
        t.add_column(col, overflow="fold")
    for s in ex.stages:
        for term in s.cost.terms:
            ideal = ", ".join(f"{cl} {v:.4g}/{eff[cl]:.2f}" for cl, v in term.ideal)
            t.add_row(s.name, term.name, ideal, f"{term.seconds(eff):.4f}", term.formula)
    console.print(t)

    t = Table(title="memory per device (GiB): workspace + Σ resident + largest transient <= usable")
    for col in (
        "devices",
        "resident (params+grads+optimizer) per model-stage",
        "transient (largest)",
        "workspace",
        "total",
        "usable",
        "fits",
    ):
        t.add_column(col, overflow="fold")
    groups: dict[tuple, list[int]] = {}
    for m in ex.memory:
        groups.setdefault((m.resident, m.transient_of, m.transient), []).append(m.device)
    by_name = {s.name: s for s in ex.stages}
    for (resident, peak_of, _transient), devs in groups.items():
        m = next(x for x in ex.memory if x.device == devs[0])
        res = "; ".join(
            f"{n} {_gib(by_name[n].memory.params)}+{_gib(by_name[n].memory.grads)}+"
            f"{_gib(by_name[n].memory.optimizer)}"
            for n, _ in resident
        )
        pm = by_name[peak_of].memory
        tr = (
            f"{peak_of}: act {_gib(pm.activations)} + KV {_gib(pm.kv_cache)} + logits "
            f"{_gib(pm.logits)}"
        )
        t.add_row(
            f"{devs[0]}-{devs[-1]} ({len(devs)})",
            res,
            tr,
            _gib(m.workspace),
            _gib(m.total),
            _gib(m.usable),
            "yes" if m.fits else "[red]NO[/]",
        )
    console.print(t)

    _print_layouts(console, ex, work, cluster, eff)

    if result.alternatives:
        t = Table(title="next-best placements and why each lost")
        for col in ("placement", "s/step", "vs chosen", "why it lost", "plan"):
            t.add_column(col, overflow="fold")
        for alt in result.alternatives:
            aex = explain(alt.plan, work, cluster, eff)
            worst = max(
                zip(aex.phases, ex.phases, strict=True),
                key=lambda pair: pair[0].seconds - pair[1].seconds,
            )
            a_ph, c_ph = worst
            slow = max(
                (s for s in aex.stages if s.phase == a_ph.phase), key=lambda s: s.cost.seconds
            )
            chosen = ex.stage(slow.name)
            why = (
                f"phase {a_ph.phase} {a_ph.seconds:.3f} s vs {c_ph.seconds:.3f} s; its "
                "slowest model-stage "
                f"{slow.name} runs {stage_plan_text(slow.plan)} in {slow.cost.seconds:.3f} s "
                f"(chosen: {stage_plan_text(chosen.plan)} in {chosen.cost.seconds:.3f} s)"
            )
            t.add_row(
                alt.label,
                f"{alt.step_seconds:.3f}",
                f"+{alt.step_seconds - result.step_seconds:.3f} s",
                why,
                plan_text(alt.plan),
            )
        console.print(t)


def _print_layouts(
    console: Console, ex: Explanation, work: Workload, cluster: ClusterSpec, eff: Efficiency
) -> None:
    """For each model-stage, the next layouts on the same devices and why each lost."""
    t = Table(title="other layouts on the same devices (the three fastest) and why each lost")
    for col in ("model-stage", "layout", "seconds", "resident+transient GiB", "why it lost"):
        t.add_column(col, overflow="fold")
    usable = usable_bytes(cluster)
    index = {s.name: i for i, s in enumerate(work.stages)}
    for s in ex.stages:
        n = s.plan.num_devices
        # what the other model-stages on these devices keep resident, and their largest transient
        others = [
            o for o in ex.stages if o.name != s.name and o.plan.device_set & s.plan.device_set
        ]
        other_res = sum(o.memory.resident for o in others)
        other_tr = max((o.memory.transient for o in others), default=0)
        chosen = (s.plan.tp, s.plan.pp, s.plan.dp, s.plan.recompute, s.plan.waves)
        cands = [
            c
            for c in stage_candidates(work, cluster, eff, index[s.name], n, prune=False)
            if (c.tp, c.pp, c.dp, c.recompute, c.waves) != chosen
        ]
        for c in sorted(cands, key=lambda c: c.seconds)[:3]:
            need = cluster.workspace_bytes + other_res + c.resident + max(other_tr, c.transient)
            if need > usable:
                why = (
                    f"does not fit: {_gib(need)} GiB with workspace and co-residents > "
                    f"{_gib(usable)} usable"
                )
            elif c.seconds > s.cost.seconds:
                why = f"slower by {c.seconds - s.cost.seconds:.3f} s"
            else:
                why = (
                    "as fast or faster alone, but the plan as a whole is not (memory or the other "
                    "phases)"
                )
            extra = ("·recompute" if c.recompute else "") + (
                f"·{c.waves} waves" if c.waves > 1 else ""
            )
            t.add_row(
                s.name,
                f"tp{c.tp}·pp{c.pp}·dp{c.dp}{extra}",
                f"{c.seconds:.3f}",
                _gib(c.resident + c.transient),
                why,
            )
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return exit_status("nereus plan", lambda: _plan(args), failure=(InfeasiblePlan,))


def _plan(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    work = _workload(args)
    eff = CONSERVATIVE
    result = search(work, cluster, eff, budget=args.devices)
    ex = explain(result.plan, work, cluster, eff)
    if args.json:
        out = {
            "plan": result.plan.to_dict(),
            "step_seconds": result.step_seconds,
            "explain": ex.to_dict(eff),
            "alternatives": [
                {"label": a.label, "step_seconds": a.step_seconds, "plan": a.plan.to_dict()}
                for a in result.alternatives
            ],
        }
        print(json.dumps(out))
        return 0
    _print_tables(Console(width=200), result, ex, work, cluster, eff)
    return 0


if __name__ == "__main__":
    sys.exit(main())
