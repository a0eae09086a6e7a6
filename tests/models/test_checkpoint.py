"""Loading reads only each rank's slices, through safetensors' slice API."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import nereus.models.checkpoint as checkpoint
from nereus.errors import ConfigError
from nereus.models import (
    ModelConfig,
    ParallelContext,
    build_stage,
    hf_state_dict,
    load_stage_weights,
    model_spec,
    save_tiny_model,
    shard_tensor,
    tiny_config,
)
from tests.models.test_decoder import ShapeOnlyComm


class RecordingOpen:
    """Wraps safetensors.safe_open: records every slice read, refuses whole-tensor reads."""

    def __init__(self, real) -> None:
        self.real = real
        self.reads: list[tuple[str, str, tuple[int, ...]]] = []  # (file, tensor, shape read)
        self.opened: list[str] = []

    def __call__(self, path, framework="pt", device="cpu"):
        self.opened.append(path.rsplit("/", 1)[-1])
        return _Handle(
            self.real(path, framework=framework, device=device), self, path.rsplit("/", 1)[-1]
        )


class _Handle:
    def __init__(self, inner, rec: RecordingOpen, file: str) -> None:
        self.inner, self.rec, self.file = inner, rec, file

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, name):
        raise AssertionError(f"the loader read the whole tensor {name!r}")

    def get_slice(self, name):
        return _Slice(self.inner.get_slice(name), self, name)


class _Slice:
    def __init__(self, inner, handle: _Handle, name: str) -> None:
        self.inner, self.handle, self.name = inner, handle, name

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        t = self.inner[index]
        self.handle.rec.reads.append((self.handle.file, self.name, tuple(t.shape)))
        return t


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory):
    config = tiny_config("qwen2", tie_word_embeddings=False, num_hidden_layers=4)
    path = save_tiny_model(
        tmp_path_factory.mktemp("sharded"), config, seed=2, max_shard_bytes=48 * 1024
    )
    full = build_stage(config)
    load_stage_weights(full, path)
    return config, path, {n: p.detach() for n, p in full.named_parameters()}


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 2), (2, 2)])
def test_each_rank_reads_only_its_slices(monkeypatch, sharded_model, tp, pp):
    config, path, full = sharded_model
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 4
    spec = model_spec(config)
    total_read = 0
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rec = RecordingOpen(checkpoint.safe_open)
            monkeypatch.setattr(checkpoint, "safe_open", rec)
            comm = ShapeOnlyComm(tp_rank, tp) if tp > 1 else None
            stage = build_stage(
                config,
                ParallelContext(
                    tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, tp_comm=comm
                ),
            )
            report = load_stage_weights(stage, path)
            monkeypatch.undo()
            params = dict(stage.named_parameters())
            # Bytes read are exactly the bytes this rank holds (float32 on both sides).
            assert report.bytes_read == sum(p.numel() * 4 for p in params.values())
            assert (
                sum(t[0] * (t[1] if len(t) > 1 else 1) for _, _, t in rec.reads) * 4
                == report.bytes_read
            )
            # Only files holding this stage's tensors were opened.
            wanted = {index[n] for name in params for n in checkpoint.hf_tensor_names(name)}
            assert set(rec.opened) == wanted
            for name, p in params.items():
                torch.testing.assert_close(
                    p.detach(), shard_tensor(spec[name], full[name], tp_rank, tp), rtol=0, atol=0
                )
            total_read += report.bytes_read
    if tp <= config.num_key_value_heads:
        # No overlap between ranks: split tensors are read once in all, replicated ones tp times.
        replicated = sum(p.nbytes for p in spec if p.rule == "replicated")
        assert total_read == spec.nbytes + (tp - 1) * replicated


def test_shard_tensor_matches_built_shapes_for_every_rank():
    config = tiny_config("qwen2", tie_word_embeddings=True)
    spec = model_spec(config)
    for tp in (1, 2, 4):
        for rank in range(tp):
            stage = build_stage(
                config,
                ParallelContext(
                    tp_rank=rank, tp_size=tp, tp_comm=ShapeOnlyComm(rank, tp) if tp > 1 else None
                ),
                device="meta",
            )
            for name, p in stage.named_parameters():
                shard = shard_tensor(spec[name], torch.zeros(spec[name].shape), rank, tp)
                assert shard.shape == p.shape, (name, tp, rank)


def _rewrite(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    config = tiny_config()
    save_tiny_model(tmp_path, config)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match="no tensor 'model.layers.2.mlp.up_proj.weight'"):
        load_stage_weights(build_stage(config), tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"'model.embed_tokens.weight' .* has shape \(256, 64\), but the model config expects "
        r"\(128, 64\)",
    ):
        load_stage_weights(build_stage(config.replace(vocab_size=128)), tmp_path)


def test_bad_directories(tmp_path):
    config = tiny_config()
    with pytest.raises(ConfigError, match="is not a directory"):
        load_stage_weights(build_stage(config), tmp_path / "nope")
    with pytest.raises(ConfigError, match="found \\[\\]"):
        load_stage_weights(build_stage(config), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.layers.2.input_layernorm.weight": "gone.safetensors"}})
    )
    with pytest.raises(ConfigError, match="gone.safetensors"):
        load_stage_weights(build_stage(config, ParallelContext(pp_rank=1, pp_size=2)), tmp_path)


def test_parallel_ctx_must_agree_with_the_stage(tmp_path):
    config = tiny_config()
    save_tiny_model(tmp_path, config)
    with pytest.raises(ConfigError, match="disagrees"):
        load_stage_weights(build_stage(config), tmp_path, ParallelContext(pp_rank=1, pp_size=2))


def test_hf_state_dict_splits_fused_tensors():
    config = tiny_config("qwen2")
    sd = hf_state_dict(build_stage(config))
    assert "model.layers.0.self_attn.qkv_proj.weight" not in sd
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (
        config.kv_size,
        config.hidden_size,
    )
    assert sd["model.layers.0.self_attn.q_proj.bias"].shape == (config.q_size,)
    assert sd["model.layers.3.mlp.gate_proj.weight"].shape == (
        config.intermediate_size,
        config.hidden_size,
    )
    assert ModelConfig.from_hf(config.to_hf()) == config
