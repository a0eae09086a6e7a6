"""Qwen3 and Llama-3 checkpoints written by transformers give transformers' numbers in nereus,
at TP 1/2 and PP 1/2: logits, logprobs of the targets, the loss, KV-cached decode logits,
and every parameter's gradient of a training loss (sharded per rank, summed where the
engines sum: tied embeddings across the pipeline's ends).

The models: Qwen3 (per-head q/k RMSNorm, attention biases on q/k/v/o, tied embeddings,
head_dim unrelated to hidden_size; and an untied one without biases, at TP 1 / PP 1 only)
and Llama-3 (RoPE scaled by rope_type "llama3", with
frequencies in all three of its bands; untied). Norms and biases are perturbed so a
misplaced or missing one shows. Each (pp_rank, tp_rank) is its own process
(``tests.models._worker``, gloo collectives), as in ``test_tp_pp``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nereus.models import (
    ModelConfig,
    ParallelContext,
    build_stage,
    load_stage_weights,
    model_spec,
    shard_tensor,
)
from nereus.models.checkpoint import hf_tensor_names
from tests.models._worker import loss_of
from tests.models.test_tp_pp import _run_workers, inputs  # noqa: F401  (a fixture)

CLOSE = dict(rtol=1e-4, atol=2e-5)
LAYOUTS = [(1, 2), (2, 1), (2, 2)]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def _hf_model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
    )  # sharper attention: position effects show in the logits
    torch.manual_seed(21 if kind == "qwen3" else 22)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(
            Qwen3Config(head_dim=24, attention_bias=True, tie_word_embeddings=True, **common)
        )
    elif kind == "qwen3_untied":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=False, **common))
    else:
        model = LlamaForCausalLM(
            LlamaConfig(rope_theta=10000.0, rope_scaling=dict(LLAMA3_ROPE), **common)
        )
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0: make them count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model.float()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("qwen3_llama3")
    out = {}
    for kind in ("qwen3", "qwen3_untied", "llama3"):
        model = _hf_model(kind)
        model.save_pretrained(root / kind)
        out[kind] = (root / kind, model)
    return out


def _reference(model, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' numbers, with gradients under nereus's (fused) names."""
    model.zero_grad()
    positions = data["positions"]
    logits = model(
        data["ids"], attention_mask=(positions >= 0).long(), position_ids=positions.clamp(min=0)
    ).logits
    loss, lp, _ = loss_of(logits, data["targets"], positions, ParallelContext())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    ref = {"logits": logits.detach(), "logprobs": lp.detach(), "loss": loss.detach().reshape(1)}
    config = ModelConfig.from_hf(json.loads(json.dumps(model.config.to_dict())))
    for param in model_spec(config):
        ref[f"grad.{param.name}"] = torch.cat(
            [grads[n] for n in hf_tensor_names(param.name)], dim=0
        )
    return ref


def test_configs_are_what_the_test_means(hf_models):
    qwen = ModelConfig.from_hf(hf_models["qwen3"][0])
    assert (
        qwen.has_qk_norm
        and qwen.has_o_bias
        and qwen.tie_word_embeddings
        and qwen.head_dim * 4 != qwen.hidden_size
    )
    llama = ModelConfig.from_hf(hf_models["llama3"][0])
    assert llama.rope_type == "llama3" and not llama.tie_word_embeddings
    # Every band of the llama3 rule is present: kept, interpolated and stretched frequencies.
    inv = 1.0 / (llama.rope_theta ** (torch.arange(0, llama.head_dim, 2).float() / llama.head_dim))
    wavelen = 2 * math.pi / inv
    old = llama.rope_original_max_position_embeddings
    assert (
        (wavelen < old / 4).any()
        and (wavelen > old).any()
        and ((wavelen >= old / 4) & (wavelen <= old)).any()
    )


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_untied", "llama3"])
def test_tp1_pp1_matches_transformers_and_scaling_matters(kind, hf_models, inputs):  # noqa: F811
    path, hf = hf_models[kind]
    _, data = inputs
    stage = build_stage(ModelConfig.from_hf(path))
    load_stage_weights(stage, path)
    ref = _reference(hf, data)
    logits = stage(data["ids"], data["positions"])
    loss, lp, _ = loss_of(logits, data["targets"], data["positions"], stage.pc)
    loss.backward()
    valid = data["positions"] >= 0
    torch.testing.assert_close(logits[valid], ref["logits"][valid], **CLOSE)
    torch.testing.assert_close(lp[valid], ref["logprobs"][valid], **CLOSE)
    torch.testing.assert_close(loss.reshape(1), ref["loss"], **CLOSE)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(
            p.grad, ref[f"grad.{name}"], **CLOSE, msg=lambda m, n=name: f"{n}: {m}"
        )
    # The features under test change the numbers: without them the logits differ.
    config = stage.config
    plain = (
        config.replace(rope_type="default", rope_factor=1.0)
        if kind == "llama3"
        else config.replace(architecture="llama")
    )
    other = build_stage(plain)
    other.load_state_dict(
        {k: v for k, v in stage.state_dict().items() if "q_norm" not in k and "k_norm" not in k}
    )
    with torch.no_grad():
        assert (
            other(data["ids"], data["positions"])[valid] - logits[valid]
        ).abs().max() > 100 * CLOSE["atol"]


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_layout_matches_transformers(tp, pp, hf_models, inputs, tmp_path):  # noqa: F811
    inputs_path, data = inputs
    dirs = [hf_models[k][0] for k in ("qwen3", "llama3")]
    _run_workers(tp, pp, dirs, inputs_path, tmp_path)
    results = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(tp * pp)]
    valid = data["positions"] >= 0
    for kind in ("qwen3", "llama3"):
        path, hf = hf_models[kind]
        tag = path.name
        spec = model_spec(ModelConfig.from_hf(path))
        ref = _reference(hf, data)
        for t in range(tp):  # every TP rank of the last stage holds the gathered results
            res = results[(pp - 1) * tp + t]
            torch.testing.assert_close(res[f"{tag}.logits"][valid], ref["logits"][valid], **CLOSE)
            torch.testing.assert_close(
                res[f"{tag}.logprobs"][valid], ref["logprobs"][valid], **CLOSE
            )
            torch.testing.assert_close(res[f"{tag}.loss"], ref["loss"], **CLOSE)
            torch.testing.assert_close(
                res[f"{tag}.cached_logits"][valid], ref["logits"][valid], **CLOSE
            )
        seen = set()
        for rank, res in enumerate(results):
            pp_rank, tp_rank = divmod(rank, tp)
            for key, grad in res.items():
                if not key.startswith(f"{tag}.grad."):
                    continue
                name = key[len(f"{tag}.grad.") :]
                seen.add(name)
                expected = shard_tensor(spec[name], ref[f"grad.{name}"], tp_rank, tp)
                if spec[name].tied_head and pp > 1:
                    other = (pp - 1) * tp + tp_rank if pp_rank == 0 else tp_rank
                    grad = grad + results[other][key]
                torch.testing.assert_close(
                    grad,
                    expected,
                    **CLOSE,
                    msg=lambda m, n=name, r=rank, k=kind: f"{k} {n} rank {r}: {m}",
                )
        assert seen == {p.name for p in spec}, sorted({p.name for p in spec} - seen)
        assert any("q_norm" in n for n in seen) == (kind == "qwen3")
