"""What the dashboard shows, reduced from tap events: a pure fold, no I/O.

``DashboardView.add(event)`` takes one tap event (a dict as ``Subscriber`` yields it, or
as ``nereus tap --jsonl`` wrote it) and returns the *updates* it makes to the page:
small JSON-able dicts with a ``kind``. The page starts empty and applies updates in
order, so ``updates`` (every update so far) replayed on a fresh page draws the same
view as one that watched live. Kinds:

Times are seconds since the first event the view saw (``t``), on the emitting host's
monotonic clock: events from one host line up; a multi-host run's controller and
driver clocks may be offset. The view never raises on an event: one whose fields have
the wrong shape is counted in ``rejected`` and described in ``problems`` (type, field,
value, rule), and the rest of the stream goes on. Event types it does not show
(``call_span``, ``transfer_bucket``, ``counters``, ...) are counted and ignored. Before
any ``plan`` event the placement is taken from the first ``transition``'s (or
``decision``'s) current plan, marked ``inferred``.

More (how it works): docs/monitoring.md.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Any

from nereus.planner.plan_text import stage_change_text

__all__ = ["DashboardView", "layout_label"]

_DEVICE_STATES = {
    "worker_join": "joined",
    "device_drain": "draining",
    "worker_retire": "retired",
    "worker_leave": "left",
    "worker_death": "died",
}


class _Bad(Exception):
    """One field of one event has the wrong shape (caught in ``add``)."""


def layout_label(tp: int, pp: int) -> str:
    """The name a layout has on the page: ``tp2·pp1``."""
    return f"tp{tp}·pp{pp}"


def _num(event: dict[str, Any], field: str, *, optional: bool = False) -> float | None:
    value = event.get(field)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Bad(f"{field}={value!r} must be a finite number")
    return float(value)


def _int(event: dict[str, Any], field: str, *, optional: bool = False) -> int | None:
    value = event.get(field)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"{field}={value!r} must be an integer")
    return value


def _map_of_numbers(event: dict[str, Any], field: str) -> dict[str, float]:
    value = event.get(field) or {}
    if not isinstance(value, dict):
        raise _Bad(f"{field}={value!r} must be a map of name -> number")
    out = {}
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _Bad(f"{field}[{k!r}]={v!r} must be a finite number")
        out[str(k)] = float(v)
    return out


def _plan(value: Any, field: str) -> dict[str, dict[str, Any]]:
    """A plan map (``Plan.to_dict``) checked to the shape the page draws."""
    if not isinstance(value, dict) or not value:
        raise _Bad(
            f"{field}={value!r} must be a non-empty map of model-stage -> {{tp, pp, dp, devices}}"
        )
    out = {}
    for stage, sp in value.items():
        if not isinstance(sp, dict):
            raise _Bad(f"{field}.{stage}={sp!r} must be a map with tp, pp, devices")
        tp, pp, emus = sp.get("tp"), sp.get("pp"), sp.get("devices")
        for name, n in (("tp", tp), ("pp", pp)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise _Bad(f"{field}.{stage}.{name}={n!r} must be an integer >= 1")
        if not isinstance(emus, list) or not all(
            isinstance(e, list)
            and e
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in e)
            for e in emus
        ):
            raise _Bad(
                f"{field}.{stage}.devices={emus!r} must be a list of EMUs, each a list of "
                "device indices"
            )
        recompute, waves = sp.get("recompute", False), sp.get("waves", 1)
        if not isinstance(recompute, bool):
            raise _Bad(f"{field}.{stage}.recompute={recompute!r} must be true or false")
        if isinstance(waves, bool) or not isinstance(waves, int) or waves < 1:
            raise _Bad(f"{field}.{stage}.waves={waves!r} must be an integer >= 1")
        out[str(stage)] = {
            "tp": tp,
            "pp": pp,
            "dp": len(emus),
            "devices": [list(e) for e in emus],
            "recompute": recompute,
            "waves": waves,
            "layout": layout_label(tp, pp),
        }
    return out


def _changes(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]] | None, stages: list[str]
) -> list[list[str]]:
    """``[model-stage, "tp1·pp1·dp2 [0,1] → tp1·pp1·dp2 [2,3]"]`` for each of ``stages``."""
    return [[s, stage_change_text(before.get(s), (after or {}).get(s))] for s in stages]


def _holders(plan: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per device (as a string key, like JSON maps): who holds it, in plan order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for stage, sp in plan.items():
        for emu, devices in enumerate(sp["devices"]):
            for d in devices:
                out.setdefault(str(d), []).append(
                    {"model_stage": stage, "layout": sp["layout"], "emu": emu}
                )
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


class DashboardView:
    """The fold of a tap stream into page updates (see the module docstring)."""

    def __init__(self, *, max_problems: int = 20) -> None:
        self.updates: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()
        self.rejected = 0
        self.problems: deque[str] = deque(maxlen=max_problems)
        self.t0: float | None = None
        self.t_last = 0.0
        self.epoch: int | None = None
        self.plan: dict[str, dict[str, Any]] | None = None
        self.steps = 0
        self._nodes: list[dict[str, Any]] = []  # transition_node events of the change under way
        self._sync_seconds = 0.0  # weight syncs since the last step
        self._budgets: dict[int, int] = {}

    # --- the fold ----------------------------------------------------------------

    def add(self, event: Any) -> list[dict[str, Any]]:
        """Fold one event in; the updates it makes (also appended to ``updates``)."""
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            return self._reject(f"event={str(event)[:80]!r} must be a map with a string 'type'")
        etype = event["type"]
        self.counts[etype] += 1
        try:
            t = self._time(event)
            handler = getattr(self, f"_on_{etype}", None)
            out = handler(event, t) if handler is not None else []
        except _Bad as e:
            return self._reject(f"{etype} event (seq {event.get('seq')}): {e}")
        if isinstance(event.get("epoch"), int) and not isinstance(event.get("epoch"), bool):
            self.epoch = event["epoch"] if self.epoch is None else max(self.epoch, event["epoch"])
        self.updates += out
        return out

    def status(self) -> dict[str, Any]:
        """Counts for the page's header: events by type, rejected, steps, epoch, last time."""
        return {
            "events": sum(self.counts.values()),
            "by_type": dict(self.counts),
            "rejected": self.rejected,
            "problems": list(self.problems),
            "steps": self.steps,
            "epoch": self.epoch,
            "t_last": self.t_last,
        }

    def _reject(self, problem: str) -> list[dict[str, Any]]:
        self.rejected += 1
        self.problems.append(problem)
        return []

    def _time(self, event: dict[str, Any]) -> float:
        value = event.get("time_monotonic_seconds")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            return self.t_last  # an event without a clock happened "now"
        if self.t0 is None:
            self.t0 = float(value)
        t = float(value) - self.t0
        self.t_last = max(self.t_last, t)
        return t

    # --- placement ---------------------------------------------------------------

    def _place(
        self, plan: dict[str, dict[str, Any]], t: float, epoch: Any, why: str
    ) -> dict[str, Any]:
        self.plan = plan
        return {
            "kind": "placement",
            "t": t,
            "epoch": epoch,
            "why": why,
            "plan": plan,
            "holders": _holders(plan),
        }

    def _on_plan(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        plan = _plan(event.get("plan"), "plan")
        predicted = _num(event, "predicted_step_seconds", optional=True)
        budgets = _map_of_numbers(event, "device_memory_bytes")
        for d, b in budgets.items():
            if not d.isdigit():
                raise _Bad(f"device_memory_bytes has key {d!r}; it must be a device index")
            self._budgets[int(d)] = int(b)
        out = self._place(plan, t, event.get("epoch"), "plan")
        out["predicted_step_seconds"] = predicted
        out["budget_bytes"] = {str(d): b for d, b in sorted(self._budgets.items())}
        return [out]

    def _inferred(self, plan_value: Any, field: str) -> list[dict[str, Any]]:
        """The placement before the first change, when no ``plan`` event was seen."""
        if self.plan is not None:
            return []
        return [self._place(_plan(plan_value, field), 0.0, None, "inferred")]

    def _on_transition_node(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        devices = event.get("devices") or []
        if not isinstance(devices, list) or not all(isinstance(d, int) for d in devices):
            raise _Bad(f"devices={devices!r} must be a list of device indices")
        self._nodes.append(
            {
                "node": event.get("node"),
                "kind": str(event.get("kind", "?")),
                "model_stage": str(event.get("model_stage", "?")),
                "count": event.get("count", 1),
                "devices": devices,
                "bytes": _int(event, "bytes", optional=True) or 0,
                "predicted_seconds": _num(event, "predicted_seconds", optional=True),
                "measured_seconds": _num(event, "measured_seconds", optional=True),
                "start_seconds": _num(event, "start_seconds"),
                "end_seconds": _num(event, "end_seconds"),
                "ok": bool(event.get("ok", True)),
            }
        )
        return []

    def _on_transition(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        before = _plan(event.get("from_plan"), "from_plan")
        after = _plan(event.get("to_plan"), "to_plan")
        measured = _num(event, "measured_seconds")
        ok = bool(event.get("ok", False))
        out = self._inferred(event.get("from_plan"), "from_plan")
        nodes, self._nodes = self._nodes, []
        changed = event.get("changed") or sorted(s for s in after if after[s] != before.get(s))
        if not isinstance(changed, list):
            raise _Bad(f"changed={changed!r} must be a list of model-stages")
        epoch_from = _int(event, "epoch_from", optional=True)
        out.append(
            {
                "kind": "transition",
                "t_start": max(0.0, t - measured),
                "t_end": t,
                "epoch_from": epoch_from,
                "epoch_to": event.get("epoch") if ok else epoch_from,
                "changed": [str(s) for s in changed],
                "bytes": _int(event, "bytes", optional=True) or 0,
                "bytes_measured": _int(event, "bytes_measured", optional=True),
                "predicted_seconds": _num(event, "predicted_seconds", optional=True),
                "measured_seconds": measured,
                "nodes": nodes,
                "ok": ok,
                "changes": _changes(before, after, [str(s) for s in changed]),
            }
        )
        if ok:  # a change that stopped part way leaves the job in its old plan
            out.append(self._place(after, t, event.get("epoch"), "transition"))
        return out

    def _on_decision(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        current = _plan(event.get("current_plan"), "current_plan")
        target_value = event.get("target_plan")
        target = _plan(target_value, "target_plan") if target_value is not None else None
        triggers = event.get("triggers") or []
        if not isinstance(triggers, list):
            raise _Bad(f"triggers={triggers!r} must be a list")
        norm = [dict(tr) if isinstance(tr, dict) else {"kind": str(tr)} for tr in triggers]
        out = self._inferred(event.get("current_plan"), "current_plan")
        changed = sorted(s for s in target if target[s] != current.get(s)) if target else []
        out.append(
            {
                "kind": "decision",
                "t": t,
                "step": _int(event, "step", optional=True),
                "triggers": norm,
                "current_step_seconds": _num(event, "current_step_seconds", optional=True),
                "target_step_seconds": _num(event, "target_step_seconds", optional=True),
                "saving_seconds": _num(event, "saving_seconds", optional=True),
                "transition_seconds": _num(event, "transition_seconds", optional=True),
                "payback_steps": _num(event, "payback_steps", optional=True),
                "limit_steps": _num(event, "limit_steps", optional=True),
                "admitted": bool(event.get("admitted", False)),
                "reason": str(event.get("reason", "")),
                "changed": changed,
                "changes": _changes(current, target, changed),
            }
        )
        return out

    # --- steps and memory ----------------------------------------------------------

    def _on_weight_sync(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        self._sync_seconds += _num(event, "seconds", optional=True) or 0.0
        return []

    def _on_step(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        stages = _map_of_numbers(event, "stage_seconds")
        peaks = {k: int(v) for k, v in _map_of_numbers(event, "device_peak_bytes").items()}
        step_seconds = stages.pop("step", None)
        if step_seconds is None:
            step_seconds = _num(event, "step_seconds", optional=True)
        self.steps += 1
        sync, self._sync_seconds = self._sync_seconds, 0.0
        return [
            {
                "kind": "step",
                "t": t,
                "step": _int(event, "step"),
                "epoch": event.get("epoch"),
                "step_seconds": step_seconds,
                "stage_seconds": stages,
                "model_stage_seconds": _map_of_numbers(event, "model_stage_seconds"),
                "weight_sync_seconds": sync if sync else None,
                "reward": _num(event, "reward", optional=True),
                "response_length_tokens": _num(event, "response_length_tokens", optional=True),
                "max_new_tokens": _num(event, "max_new_tokens", optional=True),
                "tokens": _int(event, "tokens", optional=True),
                "device_peak_bytes": peaks,
                "policy_version": event.get("policy_version"),
            }
        ]

    def _on_memory(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        device = _int(event, "device")
        budget = _int(event, "budget_bytes", optional=True)
        if budget is not None:
            self._budgets[device] = budget
        return [
            {
                "kind": "memory",
                "t": t,
                "device": device,
                "used_bytes": _int(event, "used_bytes"),
                "budget_bytes": budget if budget is not None else self._budgets.get(device),
            }
        ]

    # --- the device pool and the log ---------------------------------------------------

    def _device(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        device = _int(event, "device")
        budget = _int(event, "memory_bytes", optional=True)
        if budget is not None:
            self._budgets[device] = budget
        state = _DEVICE_STATES[event["type"]]
        out = [
            {
                "kind": "device",
                "t": t,
                "device": device,
                "state": state,
                "node_id": event.get("node_id"),
                "budget_bytes": self._budgets.get(device),
                "reason": event.get("reason"),
            }
        ]
        if state == "died":
            out.append(self._note(t, "error", f"device {device} died: {event.get('reason', '?')}"))
        return out

    _on_worker_join = _on_device_drain = _on_worker_retire = _on_worker_leave = _on_worker_death = (
        _device
    )

    def _on_node_lost(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        return [
            self._note(
                t,
                "error",
                f"node {event.get('node_id')} lost "
                f"(silent for {event.get('silence_seconds', '?')} s)",
            )
        ]

    def _on_failure(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        return [
            self._note(
                t,
                "error",
                f"actor {event.get('actor')} on device {event.get('device')} failed: "
                f"{event.get('reason', '?')}",
            )
        ]

    def _on_stuck_collective(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        return [
            self._note(
                t,
                "error",
                f"collective {event.get('op')} of group {event.get('group')} stuck for "
                f"{event.get('seconds', '?')} s, waiting for ranks {event.get('missing_ranks')}",
            )
        ]

    def _on_error(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        return [
            self._note(
                t,
                "warn",
                f"{event.get('remote_type', 'error')} in {event.get('actor')}."
                f"{event.get('method')}: {event.get('message', '')}",
            )
        ]

    def _on_node_join(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        return [
            self._note(
                t, "info", f"node {event.get('node_id')} joined with devices {event.get('devices')}"
            )
        ]

    def _on_node_leave(self, event: dict[str, Any], t: float) -> list[dict[str, Any]]:
        return [
            self._note(t, "info", f"node {event.get('node_id')} left ({event.get('reason', '?')})")
        ]

    def _note(self, t: float, level: str, text: str) -> dict[str, Any]:
        return {"kind": "note", "t": t, "level": level, "text": text[:500]}
