"""A running job's logical state, gathered from its workers whatever the layout: every
training model-stage's full tensors (assembled from each rank's shards by the pieces the
state layer gives them), each replica's logical state, the policy version and the
sample position. Two gatherings compare bitwise across any change of layout."""

from __future__ import annotations

from typing import Any

import torch

from nereus.job.cluster_stages import STAGE_KINDS


async def logical_state(stages: Any, position: int) -> dict[str, Any]:
    out: dict[str, Any] = {"policy_version": stages.policy_version, "position": position}
    for stage, emus in stages.emus.items():
        if STAGE_KINDS[stage] != "training":
            continue
        handle = stages.handles[stage]
        replicas = []
        for desc, emu in zip(emus, handle.emus, strict=True):
            full: dict[str, torch.Tensor] = {}
            shapes = {p.name: p.shape for p in desc.spec.params}
            for device, shards in zip(desc.devices, await emu.shards(), strict=True):
                for key, (shard, _) in desc.shards_on(device).items():
                    local = shards[key]
                    if key not in full:
                        full[key] = torch.full(
                            shapes[key.split(":")[0]], float("nan"), dtype=local.dtype
                        )
                    for piece in shard.pieces:
                        g = tuple(slice(lo, hi) for lo, hi in piece.box)
                        loc = tuple(slice(lo, hi) for lo, hi in piece.local)
                        full[key][g] = local[loc]
            state = await emu.mesh.get_state.call(desc.name)
            replicas.append(
                (
                    full,
                    [
                        {k: s[k] for k in ("update_count", "policy_version", "sample_position")}
                        for s in state
                    ],
                )
            )
        out[stage] = replicas
    return out


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Every replica after equals replica 0 before, bitwise; counters, version and
    position unchanged."""
    assert before["policy_version"] == after["policy_version"]
    assert before["position"] == after["position"]
    stages = [k for k in before if k not in ("policy_version", "position")]
    assert sorted(stages) == sorted(k for k in after if k not in ("policy_version", "position"))
    for stage in stages:
        ref, ref_states = before[stage][0]
        for full, _ in before[stage]:
            _assert_tensors_equal(ref, full, f"{stage} replicas before")
        for full, states in after[stage]:
            _assert_tensors_equal(ref, full, f"{stage} after the change")
            assert {
                (s["update_count"], s["policy_version"], s["sample_position"]) for s in states
            } == {
                (s["update_count"], s["policy_version"], s["sample_position"]) for s in ref_states
            }, stage


def _assert_tensors_equal(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str
) -> None:
    assert a.keys() == b.keys(), what
    for key, t in a.items():
        assert not torch.isnan(t).any(), f"{what}: {key} was not fully gathered"
        assert t.dtype == b[key].dtype and torch.equal(t, b[key]), f"{what}: {key} differs"
