"""TP x PP x DP equivalence of the engines with real worker processes and communicators.

For each layout the test starts one process per rank (``python -m tests.engines._worker``)
and compares what the EMU computed with the in-process TP=1/PP=1 engines on the same
checkpoint: greedy tokens and their logprobs, seeded sampled tokens, the rows of a stepped
request whose done slots are refilled (tokens and logprobs), inference logprobs,
and every parameter shard and AdamW moment after one training step (with micro-batches,
under both pipeline schedules at PP 2).
The grid covers TP in {1, 2, 4} and PP in {1, 2} (TP 4 replicates GQA kv heads; the model
has tied embeddings, so PP 2 exercises the first/last-stage gradient exchange), plus DP 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nereus.engines import GenerationEngine, InferenceEngine, SamplingParams, TrainingEngine
from nereus.engines.memory import MemoryLedger
from nereus.engines.options import EngineOptions
from nereus.models import model_spec, save_tiny_model, shard_tensor, tiny_config
from tests.engines._refill import refilled_run

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "greedy": {"max_tokens": 6, "temperature": 0.0},
    "sampled": {"max_tokens": 6, "temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 11},
    "optim": {"lr": 1e-2, "grad_clip": 0.5},
    "micro_batch_size": 2,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("emu")
    config = tiny_config(tie_word_embeddings=True, num_hidden_layers=2)
    model_dir = save_tiny_model(base / "model", config, seed=3, init_std=0.3)
    gen = torch.Generator().manual_seed(5)
    prompts = torch.full((3, 5), -1, dtype=torch.long)
    for i, n in enumerate((5, 2, 4)):
        prompts[i, :n] = torch.randint(0, config.vocab_size, (n,), generator=gen)
    input_ids = torch.randint(0, config.vocab_size, (4, 9), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    attention_mask[3, 4:] = 0
    inputs = {"prompts": prompts, "input_ids": input_ids, "attention_mask": attention_mask}
    save_file(inputs, str(base / "inputs.safetensors"))

    ledger = MemoryLedger("reference", None)
    plist = [row[row >= 0].tolist() for row in prompts]
    ref_gen = GenerationEngine(
        config, options=EngineOptions(model_dir=model_dir, ledger=ledger, name="ref-gen")
    )
    greedy = ref_gen.generate(plist, SamplingParams(**SETTINGS["greedy"]))
    sampled = ref_gen.generate(plist, SamplingParams(**SETTINGS["sampled"]))
    refilled = refilled_run(ref_gen, plist, seed=11)
    ref_inf = InferenceEngine(
        config, options=EngineOptions(model_dir=model_dir, ledger=ledger, name="ref-inf")
    )
    logprobs = ref_inf.logprobs({"input_ids": input_ids, "attention_mask": attention_mask})
    ref_train = TrainingEngine(
        config,
        options=EngineOptions(model_dir=model_dir, ledger=ledger, name="ref-train"),
        optim=SETTINGS["optim"],
    )
    metrics = ref_train.train_step(
        {"input_ids": input_ids, "attention_mask": attention_mask},
        micro_batch_size=SETTINGS["micro_batch_size"],
    )
    ref = {
        "greedy": greedy,
        "sampled": sampled,
        "refill": refilled,
        "logprobs": logprobs,
        "state": {k: v.clone() for k, v in ref_train.named_state().items()},
        "metrics": metrics,
    }
    return base, config, model_dir, ref


def _run_layout(
    base: Path, model_dir: Path, tp: int, pp: int, dp: int = 1
) -> list[dict[str, torch.Tensor]]:
    import torch.distributed as dist

    out = base / f"tp{tp}pp{pp}dp{dp}"
    out.mkdir(exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    world = tp * pp * dp
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    procs = []
    try:
        for rank in range(world):
            cmd = [
                sys.executable,
                "-m",
                "tests.engines._worker",
                "--model-dir",
                str(model_dir),
                "--inputs",
                str(base / "inputs.safetensors"),
                "--out",
                str(out),
                "--tp",
                str(tp),
                "--pp",
                str(pp),
                "--dp",
                str(dp),
                "--rank",
                str(rank),
                "--port",
                str(store.port),
                "--params",
                json.dumps(SETTINGS),
            ]
            procs.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
            )
        for rank, p in enumerate(procs):
            text, _ = p.communicate(timeout=150)
            assert p.returncode == 0, (
                f"rank {rank} of tp={tp} pp={pp} dp={dp} failed:\n{text.decode()[-4000:]}"
            )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    assert all(p.returncode is not None for p in procs)  # every worker reaped
    return [load_file(str(out / f"rank{r}.safetensors")) for r in range(world)]


def _check_state(config, ref_state, results, tp, pp, dp, prefix="state."):
    spec = {p.name: p for p in model_spec(config)}
    seen = set()
    for rank, res in enumerate(results):
        tp_rank = rank % tp
        for key, got in res.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix) :]
            base = name.split(":", 1)[0]  # "<param>:<slot>" for an optimizer slot
            expect = shard_tensor(spec[base], ref_state[name], tp_rank, tp)
            # Moments hold the gradient itself: tight. A parameter moved by Adam's first
            # step is lr * g / (|g| + eps), which turns float noise in a near-zero gradient
            # into up to lr: allow a fifth of lr there (a wrong gradient moves whole
            # tensors by about lr).
            atol = 1e-6 if name != base else 0.2 * SETTINGS["optim"]["lr"]
            torch.testing.assert_close(
                got, expect, atol=atol, rtol=1e-3, msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}"
            )
            seen.add(name)
    assert seen == set(ref_state), f"missing state: {sorted(set(ref_state) - seen)[:5]}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2), (4, 1)])
def test_layout_matches_tp1_pp1(setup, tp, pp):
    base, config, model_dir, ref = setup
    results = _run_layout(base, model_dir, tp, pp)
    for rank, res in enumerate(results):
        for i, (toks, lps) in enumerate(
            zip(ref["greedy"].token_ids, ref["greedy"].logprobs, strict=True)
        ):
            assert res[f"greedy.tokens.{i}"].tolist() == toks, f"rank {rank} prompt {i}"
            torch.testing.assert_close(
                res[f"greedy.logprobs.{i}"], torch.tensor(lps), atol=1e-4, rtol=1e-4
            )
        for i, toks in enumerate(ref["sampled"].token_ids):
            assert res[f"sampled.tokens.{i}"].tolist() == toks, f"rank {rank} sampled prompt {i}"
        for i, (toks, lps) in enumerate(ref["refill"]):
            assert res[f"refill.tokens.{i}"].tolist() == toks, f"rank {rank} refilled row {i}"
            torch.testing.assert_close(
                res[f"refill.logprobs.{i}"], torch.tensor(lps), atol=1e-4, rtol=1e-4
            )
        mask = torch.ones_like(ref["logprobs"])
        torch.testing.assert_close(
            res["inference.logprobs"] * mask, ref["logprobs"], atol=1e-4, rtol=1e-4
        )
        torch.testing.assert_close(
            float(res["train.grad_norm"]), ref["metrics"]["grad_norm"], atol=1e-4, rtol=1e-4
        )
    last = results[-1]
    torch.testing.assert_close(
        float(last["train.loss"]), ref["metrics"]["loss"], atol=1e-5, rtol=1e-5
    )
    _check_state(config, ref["state"], results, tp, pp, 1)
    if pp > 1:
        _check_state(config, ref["state"], results, tp, pp, 1, prefix="gpipe.")


@pytest.mark.timeout(240)
def test_data_parallel_step_matches_one_replica(setup):
    base, config, model_dir, ref = setup
    results = _run_layout(base, model_dir, tp=1, pp=1, dp=2)
    for res in results:
        torch.testing.assert_close(
            float(res["train.loss"]), ref["metrics"]["loss"], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            float(res["train.grad_norm"]), ref["metrics"]["grad_norm"], atol=1e-4, rtol=1e-4
        )
    _check_state(config, ref["state"], results, tp=1, pp=1, dp=2)
