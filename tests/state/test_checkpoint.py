"""The checkpoint fallback: save one layout, load any other, bitwise, with logical state."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from nereus.errors import StateError
from nereus.state import EMU, OPTIMIZER_SLOTS, Layout, LogicalState
from nereus.state.checkpoint import (
    MANIFEST,
    load_checkpoint,
    load_shards,
    save_checkpoint,
    save_shards,
    write_manifest,
)
from tests.state.helpers import global_tensors, shard_store, spec_for

SLOTS = ("param", *OPTIMIZER_SLOTS)
POW2 = st.sampled_from([1, 2, 4])


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    tp_a=POW2,
    pp_a=POW2,
    tp_b=POW2,
    pp_b=POW2,
    kv=POW2,
    tied=st.booleans(),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
def test_save_in_one_layout_load_in_another(
    tmp_path_factory, tp_a, pp_a, tp_b, pp_b, kv, tied, dtype
):
    spec = spec_for(kv_heads=kv, tied=tied, dtype=dtype)
    a = EMU(
        "a",
        "policy-training",
        spec,
        Layout(tp_a, pp_a),
        tuple(range(tp_a * pp_a)),
        SLOTS,
        LogicalState(11, 5, 4096),
    )
    full = global_tensors(a, seed=2)
    directory = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(directory, a, shard_store(a, full))
    b = EMU(
        "b", "policy-training", spec, Layout(tp_b, pp_b), tuple(range(10, 10 + tp_b * pp_b)), SLOTS
    )
    stores, loaded = load_checkpoint(directory, b)
    assert loaded.state == LogicalState(11, 5, 4096)
    want = shard_store(b, full)
    for d in b.devices:
        assert set(stores[d]) == set(want[d])
        for k, t in want[d].items():
            assert stores[d][k].dtype == t.dtype and torch.equal(stores[d][k], t), (d, k)


def test_replicated_tensors_are_written_once(tmp_path):
    spec = spec_for(kv_heads=2, tied=True)
    a = EMU("a", "policy-training", spec, Layout(4, 2), tuple(range(8)))
    save_checkpoint(tmp_path, a, shard_store(a, global_tensors(a)))
    files = json.loads((tmp_path / MANIFEST).read_text())["files"]
    written = [k for f in files for k in f["keys"]]
    assert written.count("model.norm.weight") == 1
    assert written.count("model.layers.0.input_layernorm.weight") == 1
    assert written.count("model.embed_tokens.weight") == 4  # 4 vocab shards, tied head not repeated
    payload = 0
    for f in files:
        with safe_open(str(tmp_path / f["file"]), framework="pt") as fh:
            payload += sum(fh.get_tensor(k).numel() * 4 for k in fh.keys())
    # every element once, except kv heads, which 2 TP ranks of 4 hold (and write) each
    kv_extra = sum(
        (p.shape[0] - p.components[0].size) * (p.numel // p.shape[0]) * 4
        for p in spec.params
        if "qkv" in p.name
    )
    assert payload == spec.nbytes + kv_extra < a.nbytes


def test_incomplete_or_foreign_checkpoints_are_refused(tmp_path):
    spec = spec_for()
    a = EMU("a", "policy-training", spec, Layout(2, 1), (0, 1))
    full = global_tensors(a)
    stores = shard_store(a, full)
    save_shards(tmp_path, a, 0, stores[0])
    with pytest.raises(StateError, match="shard file shard-pp0-tp1.safetensors of a is missing"):
        write_manifest(tmp_path, a)
    with pytest.raises(StateError, match="manifest.json is missing"):
        load_shards(tmp_path, a, 0)
    save_shards(tmp_path, a, 1, stores[1])
    write_manifest(tmp_path, a)
    other = EMU("o", "policy-training", spec_for(layers=4), Layout(1, 1), (0,))
    with pytest.raises(StateError, match="holds another model"):
        load_shards(tmp_path, other, 0)
    with pytest.raises(StateError, match="no \\['exp_avg', 'exp_avg_sq', 'master'\\]"):
        load_shards(tmp_path, a.with_(slots=SLOTS), 0)
    bad = dict(stores[0])
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(
        StateError, match="model.norm.weight is \\(3,\\) torch.float32, expected \\(16,\\) float32"
    ):
        save_shards(tmp_path / "x", a, 0, bad)
