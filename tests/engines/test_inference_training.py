"""Inference and training engines in one process, against transformers and torch."""

from __future__ import annotations

import pytest
import torch

from nereus.engines import InferenceEngine, TrainingEngine
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.errors import ConfigError, OutOfMemory, StateError
from nereus.models import save_tiny_model, tiny_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = tiny_config("qwen2", num_hidden_layers=2, tie_word_embeddings=True)
    path = save_tiny_model(tmp_path_factory.mktemp("it") / "m", config, seed=2, init_std=0.1)
    return config, path


def _batch(rows=5, length=10, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[3, 3:] = 0
    resp = mask.clone()
    resp[:, :3] = 0
    return {"input_ids": ids, "attention_mask": mask, "response_mask": resp}


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _hf_logprobs(hf, batch, temperature=1.0):
    logits = (
        hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        / temperature
    )
    lp = (
        torch.log_softmax(logits[:, :-1], -1)
        .gather(-1, batch["input_ids"][:, 1:, None])
        .squeeze(-1)
    )
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)


def test_logprobs_match_transformers(model):
    config, path = model
    batch = _batch()
    eng = InferenceEngine(
        config,
        options=EngineOptions(model_dir=path, ledger=MemoryLedger("i", None)),
        micro_batch_size=2,
    )
    with torch.no_grad():
        for temperature in (1.0, 0.7):
            ref = _hf_logprobs(_hf(path).eval(), batch, temperature)
            got = eng.logprobs(batch, temperature=temperature)
            mask = batch["attention_mask"].bool()
            torch.testing.assert_close(got[mask], ref[mask], atol=1e-4, rtol=1e-4)


def _hf_nll(hf, batch):
    lp = _hf_logprobs(hf, batch)
    m = batch["response_mask"].float()
    return -(lp * m).sum() / m.sum()


def test_train_step_matches_torch_adamw_with_clipping_and_accumulation(model):
    config, path = model
    batch = _batch()
    optim = {"lr": 1e-3, "weight_decay": 0.01, "grad_clip": 0.3}
    eng = TrainingEngine(
        config, options=EngineOptions(model_dir=path, ledger=MemoryLedger("t", None)), optim=optim
    )
    metrics = eng.train_step(batch, micro_batch_size=2)

    hf = _hf(path).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.01)
    loss = _hf_nll(hf, batch)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 0.3)
    opt.step()
    assert abs(metrics["loss"] - float(loss.detach())) < 1e-5
    assert abs(metrics["grad_norm"] - float(norm)) < 1e-4 * max(1.0, float(norm))
    assert metrics["step"] == 1.0 and eng.step == 1
    ref = dict(hf.named_parameters())
    got = eng.named_weights()
    # fused nereus parameters are the concatenation of Hugging Face's
    for name, tensor in got.items():
        if "qkv_proj" in name:
            parts = [ref[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
        elif "gate_up_proj" in name:
            parts = [ref[name.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj")]
        else:
            parts = [ref[name]]
        expect = torch.cat([p.detach() for p in parts], 0)
        torch.testing.assert_close(
            tensor, expect, atol=2e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_micro_batches_accumulate_to_one_batch(model):
    config, path = model
    batch = _batch(rows=6)
    a = TrainingEngine(
        config,
        options=EngineOptions(model_dir=path, ledger=MemoryLedger("a", None)),
        optim={"lr": 1e-3},
    )
    b = TrainingEngine(
        config,
        options=EngineOptions(model_dir=path, ledger=MemoryLedger("b", None)),
        optim={"lr": 1e-3},
    )
    ma = a.train_step(batch)
    mb = b.train_step(batch, micro_batch_size=4)  # 4 + 2 rows, unequal token counts
    assert abs(ma["loss"] - mb["loss"]) < 1e-6
    assert abs(ma["grad_norm"] - mb["grad_norm"]) < 1e-5
    sa, sb = a.named_state(), b.named_state()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=1e-6, rtol=1e-4)


def test_loss_by_import_path_and_state_roundtrip(model):
    config, path = model
    batch = _batch()
    batch["returns"] = torch.linspace(-1, 1, 10).expand(5, 10).contiguous()
    critic = TrainingEngine(
        config,
        options=EngineOptions(model_dir=path, ledger=MemoryLedger("c", None)),
        critic=True,
        optim={"lr": 1e-2},
    )
    first = critic.train_step(batch, loss="nereus.engines.losses:value_mse_loss")
    for _ in range(4):
        last = critic.train_step(batch, loss="nereus.engines.losses:value_mse_loss")
    assert last["value_mse"] < first["value_mse"]
    state = critic.named_state()
    assert {
        "value_head.weight",
        "value_head.weight:exp_avg",
        "value_head.weight:exp_avg_sq",
    } <= set(state)
    # the state moves into a fresh engine in place, and both continue identically
    twin = TrainingEngine(
        config,
        options=EngineOptions(seed=9, ledger=MemoryLedger("c2", None)),
        critic=True,
        optim={"lr": 1e-2},
    )
    twin.load_named_state({k: v.clone() for k, v in state.items()}, step=critic.step)
    ma = critic.train_step(batch, loss="nereus.engines.losses:value_mse_loss")
    mb = twin.train_step(batch, loss="nereus.engines.losses:value_mse_loss")
    assert ma == mb
    with pytest.raises(StateError, match="shape"):
        twin.load_named_state({"value_head.weight": torch.zeros(3)})
    with pytest.raises(StateError, match="no state"):
        twin.load_named_state({"value_head.weight:momentum": torch.zeros(1, 64)})
    with pytest.raises(ConfigError, match="loss"):
        critic.train_step(batch, loss="nereus.engines.losses:no_such_loss")
    with pytest.raises(ConfigError, match="loss"):
        critic.train_step(batch, loss="not_a_path")


def test_values_rewards_and_rule_rewards(model):
    config, path = model
    batch = _batch()
    eng = InferenceEngine(
        config,
        options=EngineOptions(model_dir=path, ledger=MemoryLedger("v", None)),
        value_head=True,
    )
    with torch.no_grad():
        eng.value_head.weight.normal_()
        eng.value_head.bias.fill_(0.5)
    values = eng.values(batch)
    rewards = eng.rewards(batch)
    assert values.shape == (5, 10) and rewards.shape == (5,)
    last = batch["attention_mask"].sum(1) - 1
    torch.testing.assert_close(rewards, values[torch.arange(5), last])
    scores = eng.rule_rewards(batch, "tests.engines.test_inference_training:count_rule", token=3)
    expect = ((batch["input_ids"] == 3) & batch["response_mask"].bool()).sum(1).float()
    torch.testing.assert_close(scores, expect)
    plain = InferenceEngine(
        config, options=EngineOptions(model_dir=path, ledger=MemoryLedger("p", None))
    )
    with pytest.raises(ConfigError, match="value_head"):
        plain.values(batch)


def count_rule(input_ids, attention_mask, response_mask, token):
    return ((input_ids == token) & response_mask.bool()).sum(1).float()


def test_bad_batches_are_refused(model):
    config, path = model
    eng = InferenceEngine(
        config, options=EngineOptions(model_dir=path, ledger=MemoryLedger("b", None))
    )
    with pytest.raises(ConfigError, match="input_ids"):
        eng.logprobs({"tokens": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(ConfigError, match="right padding"):
        eng.logprobs(
            {
                "input_ids": torch.zeros(1, 3, dtype=torch.long),
                "attention_mask": torch.tensor([[0, 1, 1]]),
            }
        )
    with pytest.raises(ConfigError, match="first dim"):
        eng.logprobs(
            {"input_ids": torch.zeros(2, 3, dtype=torch.long), "advantages": torch.zeros(3, 3)}
        )


def test_training_memory_is_accounted_and_refused_past_the_budget(model):
    config, path = model
    ledger = MemoryLedger(4, None)
    eng = TrainingEngine(config, options=EngineOptions(model_dir=path, ledger=ledger))
    held = eng.memory()
    weights = held["training/weights"]
    assert held["training/grads"] == weights and held["training/optimizer"] == 2 * weights
    with pytest.raises(OutOfMemory) as info:
        TrainingEngine(
            config, options=EngineOptions(model_dir=path, ledger=MemoryLedger(5, 3 * weights))
        )
    assert info.value.device == 5 and "training/optimizer" in str(info.value)
    small = MemoryLedger(6, 4 * weights + 1024)
    tight = TrainingEngine(config, options=EngineOptions(model_dir=path, ledger=small))
    with pytest.raises(OutOfMemory, match="activations"):
        tight.train_step(_batch())
    assert small.used_bytes == 4 * weights  # the failed step gave its reservation back


def test_the_value_head_is_part_of_the_critics_model_spec(model):
    from nereus.models import model_spec

    config, path = model
    critic = TrainingEngine(
        config, options=EngineOptions(model_dir=path, ledger=MemoryLedger("cs", None)), critic=True
    )
    spec = model_spec(config, value_head=True)
    params = critic.named_weights()
    assert {p.name for p in spec} == set(params)
    for p in spec:
        assert tuple(params[p.name].shape) == p.shape
    assert (
        spec["value_head.weight"].rule == "replicated" and spec["value_head.weight"].stage == "head"
    )


def test_bfloat16_training_steps_float32_master_copies_with_the_state_layers_slots(model):
    from nereus.models import model_spec
    from nereus.state import EMU, Layout, training_slots

    config, path = model
    eng = TrainingEngine(
        config,
        options=EngineOptions(model_dir=path, dtype="bfloat16", ledger=MemoryLedger("bf", None)),
        optim={"lr": 1e-2},
    )
    batch = _batch()
    first = eng.train_step(batch)
    for _ in range(3):
        last = eng.train_step(batch)
    assert last["loss"] < first["loss"]
    state = eng.named_state()
    # the keys and dtypes of the state layer's training EMU, exactly
    emu = EMU(
        "bf",
        "policy_training",
        model_spec(config, "bfloat16"),
        Layout(),
        (0,),
        training_slots("bfloat16"),
    )
    want = emu.shards_on(0)
    assert set(state) == set(want)
    for key, (shard, dtype) in want.items():
        assert (
            tuple(state[key].shape) == shard.shape and str(state[key].dtype) == f"torch.{dtype}"
        ), key
    # the parameter is the master copy rounded to bfloat16
    name = "model.norm.weight"
    assert torch.equal(state[name], state[f"{name}:master"].to(torch.bfloat16))
    weights = eng.memory()["training/weights"]
    # fp32 m, v and master per bf16 parameter: 12 bytes against 2
    assert eng.memory()["training/optimizer"] == 6 * weights


def test_recompute_gives_the_same_step_with_fewer_activation_bytes(model):
    config, path = model
    batch = _batch(rows=6, length=12)
    keep_ledger, rec_ledger = MemoryLedger("k", None), MemoryLedger("r", None)
    keep = TrainingEngine(
        config, options=EngineOptions(model_dir=path, ledger=keep_ledger), optim={"lr": 1e-3}
    )
    rec = TrainingEngine(
        config,
        options=EngineOptions(model_dir=path, ledger=rec_ledger),
        optim={"lr": 1e-3},
        recompute=True,
    )
    keep_ledger.reset_peak()
    rec_ledger.reset_peak()
    mk, mr = keep.train_step(batch, micro_batch_size=3), rec.train_step(batch, micro_batch_size=3)
    assert mk["loss"] == mr["loss"] and mk["grad_norm"] == mr["grad_norm"]
    sk, sr = keep.named_state(), rec.named_state()
    for k in sk:
        assert torch.equal(sk[k], sr[k]), k
    # what each reserved for activations shows in its peak (the resident bytes are equal)
    assert rec_ledger.peak_bytes < keep_ledger.peak_bytes
    with pytest.raises(ConfigError, match="TrainingEngine.recompute"):
        TrainingEngine(
            config,
            options=EngineOptions(model_dir=path, ledger=MemoryLedger("x", None)),
            recompute="yes",
        )
