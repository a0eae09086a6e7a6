"""The monitoring tap's event schema (version 1).

Every event is a msgpack map published by the controller on its PUB socket as the
two frames ``[signature, body]`` (HMAC-SHA256 of ``body`` with the cluster key, like
every other nereus message). Common fields, present on every event:

    type                    str    one of EVENT_TYPES below
    v                       int    schema version (SCHEMA_VERSION)
    seq                     int    per-controller sequence number (gaps = events lost)
    time_monotonic_seconds  float  CLOCK_MONOTONIC of the emitting host at emission
    epoch                   int    layout epoch at the controller when published
    source                  str    "controller", "driver", "worker:<device>", ...
    pid                     int    emitting process (absent for controller-made events)

Fields use SI units with the unit in the name (``_bytes``, ``_seconds``, ``_gbps``).
Types not listed are published as they are (other layers may add their own) but a
layer that owns a type should add it here with its fields. The list is versioned:
a change that removes or renames a field bumps SCHEMA_VERSION.
"""

from __future__ import annotations

from typing import Any

from nereus.actors.events import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "COMMON_FIELDS", "EVENT_TYPES", "describe", "check_event"]


COMMON_FIELDS: dict[str, str] = {
    "type": "event type (see EVENT_TYPES)",
    "v": "schema version",
    "seq": "controller sequence number",
    "time_monotonic_seconds": "monotonic clock of the emitting host, seconds",
    "epoch": "layout epoch at the controller",
    "source": "who emitted it: controller, driver, worker:<device>",
}

# type -> {field: meaning}; fields beyond these are allowed.
EVENT_TYPES: dict[str, dict[str, str]] = {
    "epoch": {"epoch": "the new layout epoch (Cluster.set_epoch); later events carry it"},
    "controller_start": {"address": "controller ROUTER address", "tap_address": "this PUB socket"},
    "node_join": {"node_id": "node id", "host": "host name", "devices": "global device indices"},
    "node_leave": {"node_id": "node id", "reason": "why (e.g. 'shutdown')"},
    "node_lost": {"node_id": "node id", "silence_seconds": "time since its last heartbeat"},
    "worker_join": {
        "device": "global device index",
        "node_id": "node id",
        "pid": "process id",
        "address": "worker ROUTER address",
        "kind": "cpu or cuda",
        "memory_bytes": "device memory or CPU budget",
    },
    "worker_leave": {"device": "global device index", "node_id": "node id", "pid": "process id"},
    "device_drain": {"device": "global device index marked to be emptied by the next change"},
    "worker_retire": {
        "device": "global device index of a drained device whose worker stopped",
        "node_id": "node id",
        "pid": "process id",
    },
    "worker_death": {
        "device": "global device index",
        "node_id": "node id",
        "pid": "process id",
        "reason": "SIGKILL, exit code N, node lost",
        "returncode": "exit status",
    },
    "actor_spawn": {
        "actor": "actor name",
        "device": "device index",
        "incarnation": "int",
        "class": "module:QualName",
    },
    "failure": {
        "device": "device index",
        "actor": "actor name",
        "incarnation": "int",
        "reason": "why",
        "mesh": "mesh name",
        "rank": "rank in the mesh",
    },
    "call_span": {
        "actor": "actor name",
        "method": "endpoint",
        "device": "device index",
        "latency_seconds": "caller-side round trip",
        "ok": "bool",
    },
    "error": {
        "actor": "actor name",
        "method": "endpoint",
        "device": "device index",
        "remote_type": "exception type",
        "message": "text",
        "traceback": "text",
    },
    "counters": {
        "device": "device index (absent on the controller)",
        "counters": "map reason -> count (rejected_*, late_replies, ...)",
    },
    "transfer_bucket": {
        "bytes": "bucket size",
        "seconds": "wall time",
        "gbps": "GB/s",
        "src": "source device",
        "dst": "destination device",
        "src_rank": "source rank in the group",
        "dst_rank": "destination rank",
        "group": "group id",
        "round": (
            "bucket round of the exchange (-1: a direct write into the "
            "receiver's memory, one per peer)"
        ),
    },
    "step": {
        "step": "RL step",
        "stage_seconds": "map stage -> seconds",
        "tokens": "count",
        "model_stage_seconds": "map model-stage -> seconds it worked",
        "reward": "mean reward",
        "response_length_tokens": "mean length",
        "max_new_tokens": "the length cap the step used",
        "device_peak_bytes": "map device -> its ledger's high-water mark during the step",
        "policy_version": "version of the policy that generated the step's rollouts",
        "staleness_histogram": (
            "async mode: map staleness (versions behind the update) -> trained tokens"
        ),
        "importance_weight_mean": "async mode: mean pi_prox / pi_behav over response tokens",
        "importance_clipped_frac": (
            "async mode: share of tokens whose importance weight was truncated"
        ),
        "behaviour_kl": (
            "async mode: KL(pi_behav || pi_prox) per response token (k3 estimate): how far "
            "the weights moved since the trained tokens were generated"
        ),
        "regenerated_groups": "async mode: groups issued again after their generation worker died",
    },
    "weight_sync": {
        "bytes": "bytes of the synced model",
        "bytes_between_devices": "bytes that crossed devices (the rest stayed resident)",
        "seconds": "wall time",
        "gbps": "bytes / seconds / 1e9",
        "policy_version": "the policy version generation now holds",
    },
    "plan": {
        "plan": "per model-stage tp/pp/dp/devices (the plan a job starts in)",
        "predicted_step_seconds": "float, or null when the plan was given, not searched",
        "device_memory_bytes": "map device -> memory budget of every live device of the pool",
    },
    "transition": {
        "from_plan": "per model-stage tp/pp/dp/devices before",
        "to_plan": "the same after",
        "changed": "model-stages that moved",
        "bytes": "bytes the plans move between devices",
        "bytes_measured": "bytes the workers' transfer counters saw leave them",
        "predicted_seconds": "the DAG's scheduled makespan",
        "measured_seconds": "wall time of the whole change",
        "nodes": "DAG nodes",
        "resource_edges": "memory-ordering edges the DAG needed",
        "epoch_from": "layout epoch before",
        "ok": "bool: every node finished",
        "overlapped": "bool: it ran beside the next step's work ([adapt] overlap)",
        "moves_seconds": "wall time of the DAG's moves (what predicted_seconds predicts)",
        "parts_seconds": (
            "map part -> seconds: plan, engines_stop, moves, groups, engines, sync_plans"
        ),
    },
    "transition_node": {
        "node": "node id in its DAG",
        "kind": "split, destroy, extend or merge",
        "model_stage": "its model-stage",
        "count": "identical primitives it stands for",
        "devices": "devices it occupied",
        "bytes": "bytes it moves between devices",
        "predicted_seconds": "modelled duration",
        "measured_seconds": "measured duration",
        "start_seconds": "start, from the transition's start",
        "end_seconds": "end, from the transition's start",
        "ok": "bool",
    },
    "decision": {
        "step": "RL step at whose boundary it was made",
        "triggers": "list of {kind: device-pool | memory | drift, detail: lost | drained | "
        "joined | length | ..., and the device, the predicted need and budget}",
        "current_plan": "plan now",
        "target_plan": "plan proposed (or null)",
        "current_step_seconds": "predicted seconds per step now",
        "target_step_seconds": "predicted seconds per step at the target",
        "saving_seconds": "per step",
        "transition_seconds": "the DAG's estimate",
        "payback_steps": "transition / saving",
        "limit_steps": "gamma x horizon",
        "admitted": "bool",
        "action": "transition, keep or restart",
        "reason": "why",
        "transition_bytes": "bytes the target's DAG moves between devices",
        "transition": "the change executed (step, triggers, from, to, predicted and measured "
        "seconds, bytes), when admitted",
    },
    "boundary": {
        "step": "RL step the boundary comes before",
        "work": "the planner's workload (lengths, next cap)",
        "cluster": "the device pool as the planner's ClusterSpec",
        "plan": "the job's plan over the pool's slots",
        "eff": "efficiency factors in force (calibrated)",
        "lost": "devices gone since the last boundary",
        "drained": "devices draining",
        "joined": "devices new in the pool",
        "priced": "list of [target plan, transition seconds] the DAG estimated",
        "triggers": "kinds that fired",
        "action": "transition, keep or restart",
        "admitted": "bool",
        "target": "plan admitted or considered (slots), or null",
        "replanner": "first boundary only: how the Replanner was built (nereus.planner.replay)",
    },
    "fault": {
        "step": "the step it hit",
        "devices": "devices that died",
        "during": "step, boundary or recovery (async mode: update, boundary, recovery, or "
        "generation for a generation EMU's own death)",
        "error": "what the driver saw",
        "committed": "bool: the step's update had been committed",
        "restored_from": "checkpoint loaded (a training state lost its last copy), else empty",
        "redone": "bool: the step runs again",
        "recover_seconds": "from the error to a runnable plan",
        "dropped": "EMUs lost with the devices",
        "missing": "model-stages rebuilt from scratch",
        "regenerated_groups": "async mode: unfinished groups issued again from the same positions",
        "rewound_groups": "async mode: groups trained or finished after a restored checkpoint, "
        "issued again",
    },
    "rewind": {
        "step": "the step the job goes on from (a restored checkpoint's)",
        "checkpoint": "the checkpoint restored",
        "discarded_steps": "list: steps whose records were "
        "dropped (metrics.jsonl, TensorBoard, loggers) to be redone",
    },
    "tap_recorder": {
        "marker": "start or stop: a recorder's own marker, to know its subscription is live"
    },
    "memory": {"device": "device index", "used_bytes": "int", "budget_bytes": "int"},
    "stuck_collective": {
        "group": "group id",
        "op": "collective",
        "missing_ranks": "list",
        "seconds": "stuck for",
        "rank": "reporting rank",
    },
    "peer_died": {
        "group": "group id",
        "op": "operation",
        "dead_ranks": "list",
        "silent_ranks": "list (another host, no sign of life)",
        "seconds": "until it failed",
        "rank": "reporting rank",
    },
}


def check_event(event: Any) -> list[str]:
    """Problems with ``event`` against the schema (empty list: it conforms)."""
    if not isinstance(event, dict):
        return [f"event is a {type(event).__name__}, not a map"]
    problems = [f"missing common field {f!r}" for f in COMMON_FIELDS if f not in event]
    etype = event.get("type")
    if not isinstance(etype, str):
        problems.append(f"type={etype!r} must be a string")
    return problems


def describe() -> str:
    """The schema as readable text (``nereus tap --schema``)."""
    lines = [f"nereus tap event schema v{SCHEMA_VERSION}", "", "common fields:"]
    lines += [f"  {k:<24} {v}" for k, v in COMMON_FIELDS.items()]
    for etype, fields in EVENT_TYPES.items():
        lines += ["", f"{etype}:"]
        lines += [f"  {k:<24} {v}" for k, v in fields.items()]
    return "\n".join(lines)
