"""Record a real job's monitoring tap as JSONL: the dashboard tests' recorded stream.

    python -m tests.monitor.record_tap tests/assets/tap/grpo_live_layouts.jsonl \
        tests/assets/tap/grpo_job_recording.jsonl

What it runs: a controller with its tap, a subscriber attached before anything joins
(so the stream holds every ``worker_join`` with its budget), two node daemons of two
CPU devices each, and a GRPO job attached to them (``RLJob.start(cluster=...)``). The
job takes 7 steps under a rising length cap and changes its plan twice through
``RLJob.apply_plan``: once after a length-drift decision, once after device 3 is
drained (the change leaves it, and it is retired). Everything on the tap is real
(``plan``, ``step``, ``weight_sync``, ``transition``, ``transition_node``, ``epoch``,
``device_drain``, ``worker_retire``, joins and leaves) except two kinds of event the
job does not emit itself, which this script emits through the same tap: a
``decision`` before each change (and one rejected in between; the controller loop
that makes them is not part of a plain job) with the saving and cost a planner would
report, and a ``memory`` event per device after every step, read from the devices'
ledgers. ``call_span`` and ``transfer_bucket`` events are left out of the file (the
dashboard does not show them; they are most of the volume).

The second file is the job's own recording of the same run (``out_dir/tap.jsonl``, as
``make demo`` leaves it), with the same types left out: its recorder subscribed when the
job started, after the devices had joined, so it holds no ``worker_join`` of them.

The file is committed; ``tests/monitor/test_dashboard.py`` replays it and checks the
recorder still runs (``record``). Timings differ from run to run; the story does not.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from nereus.actors import Cluster, Controller, NodeDaemon, emit
from nereus.job.loop import RLJob
from nereus.monitor import Subscriber, to_json
from nereus.planner import Plan, StagePlan
from tests.job._jobs import job

LEFT_OUT = frozenset({"call_span", "transfer_bucket"})
MEMORY = "8MiB"
STEPS = 7
START = {
    "policy_generation": {"devices": [0, 1, 2, 3], "dp": 4},
    "reference_inference": {"devices": [3]},
    "policy_training": {"devices": [0, 1], "tp": 2},
}


def _plan(**stages: tuple[int, int, list[list[int]]]) -> Plan:
    return Plan(
        tuple(
            (name, StagePlan(tp, pp, len(devs), tuple(tuple(d) for d in devs)))
            for name, (tp, pp, devs) in stages.items()
        )
    )


# after the length drift: generation TP 2 x 2 replicas, the reference PP 2, training moves to device
# 2
WIDER = _plan(
    policy_generation=(2, 1, [[0, 1], [2, 3]]),
    reference_inference=(1, 2, [[0, 1]]),
    policy_training=(1, 1, [[2]]),
)
# proposed at step 3 and rejected (payback too long)
REJECTED = _plan(
    policy_generation=(1, 1, [[0], [1], [2], [3]]),
    reference_inference=(1, 2, [[0, 1]]),
    policy_training=(1, 1, [[2]]),
)
# device 3 drained: generation back to TP 1 on devices 0 and 1, training stays on device 2
DRAINED = _plan(
    policy_generation=(1, 1, [[0], [1]]),
    reference_inference=(1, 1, [[0]]),
    policy_training=(1, 1, [[2]]),
)

GAMMA, HORIZON_STEPS = 0.5, 20.0


def _decision(
    step: int,
    rl: RLJob,
    records: list[dict[str, Any]],
    target: Plan,
    triggers: list[dict[str, Any]],
    *,
    speedup: float,
    payback_steps: float | None = None,
    transition_seconds: float | None = None,
    urgent: str = "",
) -> bool:
    """Emit a ``decision`` for ``target`` priced from the last two steps (the target's
    step time is ``1 / speedup`` of it; the change costs ``payback_steps`` steps of
    saving, or ``transition_seconds``); returns whether it was admitted."""
    now = sum(r["step_seconds"] for r in records[-2:]) / len(records[-2:])
    then = now / speedup
    saving = now - then
    limit = GAMMA * HORIZON_STEPS
    transition = transition_seconds if transition_seconds is not None else payback_steps * saving
    payback = transition / saving if saving > 0 else None
    admitted = bool(urgent) or (payback is not None and payback <= limit)
    reason = (
        f"urgent: {urgent}; payback not tested"
        if urgent
        else f"payback {payback:.1f} steps {'<=' if admitted else '>'} limit {limit:.1f} steps"
    )
    emit(
        "decision",
        step=step,
        triggers=triggers,
        current_plan=rl.stages.plan.to_dict(),
        target_plan=target.to_dict(),
        current_step_seconds=now,
        target_step_seconds=then,
        saving_seconds=saving,
        transition_seconds=transition,
        payback_steps=payback,
        limit_steps=limit,
        admitted=admitted,
        reason=reason,
    )
    return admitted


async def _memory(rl: RLJob) -> None:
    for device, m in sorted((await rl.stages.memory()).items()):
        emit("memory", device=device, used_bytes=m["used_bytes"], budget_bytes=m["budget_bytes"])


async def _story(rl: RLJob, cluster: Cluster) -> None:
    records: list[dict[str, Any]] = []

    async def steps(n: int) -> None:
        for _ in range(n):
            records.append(await rl.run_step())
            await _memory(rl)

    await steps(2)
    length = records[-1]["response_len_mean"]
    drift = [
        {
            "kind": "drift",
            "detail": "length",
            "value": length,
            "reference": length / 1.4,
            "threshold": 0.3,
        }
    ]
    if _decision(1, rl, records, WIDER, drift, speedup=1.35, payback_steps=2.5):
        await rl.apply_plan(WIDER)
    await steps(2)
    drift = [
        {
            "kind": "drift",
            "detail": "length",
            "value": records[-1]["response_len_mean"],
            "reference": length,
            "threshold": 0.3,
        }
    ]
    _decision(3, rl, records, REJECTED, drift, speedup=1.04, payback_steps=26.0)
    await steps(1)
    cluster.drain(3)
    pool = [{"kind": "device-pool", "detail": "drained", "device": 3}]
    if _decision(
        4,
        rl,
        records,
        DRAINED,
        pool,
        speedup=0.9,
        transition_seconds=0.05,
        urgent="device 3 is draining",
    ):
        await rl.apply_plan(DRAINED)
    await steps(STEPS - 5)


async def record(
    out: str | Path, work_dir: str | Path, job_out: str | Path | None = None
) -> list[dict[str, Any]]:
    """Run the story and write its tap to ``out`` (and the job's own recording of it to
    ``job_out``); returns the events written to ``out``."""
    key = b"record-tap-key-0123456789abcdef"
    controller = await Controller(key, heartbeat_timeout_s=30.0).start()
    sub = Subscriber(controller.tap_address, key)
    events: list[dict[str, Any]] = []
    nodes: list[NodeDaemon] = []
    try:
        # PUB/SUB joins asynchronously: probe until the subscriber hears one, so it sees every join
        while True:
            controller.publish({"type": "tap_probe"})
            try:
                if (await sub.next(0.1)).get("type") == "tap_probe":
                    break
            except asyncio.TimeoutError:
                continue

        nodes_left = asyncio.Event()

        async def listen() -> None:
            async for event in sub:
                if event.get("type") not in LEFT_OUT | {"tap_probe"}:
                    events.append(event)
                if sum(e["type"] == "node_leave" for e in events) == 2:
                    nodes_left.set()

        listener = asyncio.get_running_loop().create_task(listen())
        for name in ("a", "b"):
            node = NodeDaemon(
                controller.address,
                key,
                devices=2,
                memory_per_device=MEMORY,
                transport="ipc",
                node_id=name,
                heartbeat_s=0.5,
            )
            nodes.append(node)
            await node.register()
        await asyncio.gather(*(node.start() for node in nodes))
        cfg = job(
            str(Path(work_dir) / "job"),
            STEPS,
            algorithm={"prompts_per_step": 8, "samples_per_prompt": 4, "kl_coef": 0.01},
            sampling={"max_new_tokens": [[0, 4], [2, 6], [5, 8]]},
            plan=START,
            cluster={"mode": "connect", "address": controller.address, "devices": 4},
        )
        async with Cluster.connect(
            controller.address, key=key, min_devices=4, timeout_s=60.0
        ) as cluster:
            rl = RLJob(cfg)
            await rl.start(cluster=cluster)
            try:
                await _story(rl, cluster)
            finally:
                await rl.close()
        for node in nodes:
            await node.stop()
        nodes.clear()
        # the last events (node leaves) are on their way: wait for them, with a deadline
        await asyncio.wait_for(nodes_left.wait(), 10)
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    finally:
        for node in nodes:
            await node.stop()
        sub.close()
        await controller.close()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        for event in events:
            fh.write(to_json(event) + "\n")
    if job_out is not None:
        lines = (Path(cfg.run.out_dir) / "tap.jsonl").read_text(encoding="utf-8").splitlines(True)
        kept = [line for line in lines if json.loads(line)["type"] not in LEFT_OUT]
        Path(job_out).write_text("".join(kept), encoding="utf-8")
    return [json.loads(to_json(e)) for e in events]


def main(argv: list[str]) -> int:
    import tempfile

    if len(argv) not in (1, 2):
        print(
            "usage: python -m tests.monitor.record_tap OUT.jsonl [JOB_OUT.jsonl]", file=sys.stderr
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="nereus-record-") as work:
        events = asyncio.run(record(argv[0], work, argv[1] if len(argv) == 2 else None))
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["type"]] = kinds.get(e["type"], 0) + 1
    print(
        f"{len(events)} events -> {argv[0]}: "
        + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
