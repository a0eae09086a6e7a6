"""TP x PP equivalence with real worker processes and real gloo communicators.

For TP in {1, 2, 4} and PP in {1, 2}, every (pp_rank, tp_rank) is its own process
(``python -m tests.models._worker``); its logits, logprobs, entropy, gradients and
KV-cached decode logits must match the TP=1/PP=1 model run in this process. Two models:
a Llama with untied embeddings and a Qwen2 (q/k/v biases) with tied embeddings, both with
2 kv heads, so TP 4 replicates kv heads. The workers talk through
``nereus.transfer.CpuCommunicator`` (gloo collectives, shared-memory p2p).
"""

from __future__ import annotations

import datetime
import glob
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from nereus.models import (
    ModelConfig,
    build_stage,
    load_stage_weights,
    model_spec,
    save_tiny_model,
    shard_tensor,
    tiny_config,
)
from tests.models._worker import loss_of

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = [(1, 2), (2, 1), (2, 2), (4, 1), (4, 2)]
DEADLINE_S = 150.0


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("tp_pp_models")
    llama = save_tiny_model(root / "llama", tiny_config("llama"), seed=3)
    qwen = save_tiny_model(root / "qwen2", tiny_config("qwen2", tie_word_embeddings=True), seed=4)
    return [llama, qwen]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    b, t = 3, 10
    ids = torch.randint(0, 256, (b, t), generator=gen)
    positions = torch.stack(
        [
            torch.arange(t),  # full row
            torch.tensor([-1, -1, *range(t - 2)]),  # left padding
            torch.tensor([*range(t - 2), -1, -1]),  # finished early
        ]
    )
    targets = torch.randint(0, 256, (b, t), generator=gen)
    data = {"ids": ids, "positions": positions, "targets": targets, "prefill": torch.tensor([6])}
    path = tmp_path_factory.mktemp("tp_pp_inputs") / "inputs.safetensors"
    save_file(data, str(path))
    return path, data


def _reference(model_dir: Path, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    stage = build_stage(ModelConfig.from_hf(model_dir))
    load_stage_weights(stage, model_dir)
    logits = stage(data["ids"], data["positions"])
    loss, lp, ent = loss_of(logits, data["targets"], data["positions"], stage.pc)
    loss.backward()
    ref = {
        "logits": logits.detach(),
        "logprobs": lp.detach(),
        "entropy": ent.detach(),
        "loss": loss.detach().reshape(1),
    }
    ref.update({f"grad.{n}": p.grad for n, p in stage.named_parameters()})
    return ref


def _run_workers(tp: int, pp: int, models: list[Path], inputs_path: Path, out: Path) -> None:
    world = tp * pp
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.models._worker",
                "--rank",
                str(r),
                "--tp",
                str(tp),
                "--pp",
                str(pp),
                "--port",
                str(store.port),
                "--inputs",
                str(inputs_path),
                "--out",
                str(out),
                *map(str, models),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    try:
        deadline = time.monotonic() + DEADLINE_S
        for r, p in enumerate(procs):
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker rank {r} (tp={tp} pp={pp}) did not finish in {DEADLINE_S} s")
            if p.returncode != 0:
                text = p.stdout.read().decode(errors="replace")
                pytest.fail(
                    f"worker rank {r} (tp={tp} pp={pp}) exited {p.returncode}:\n{text[-4000:]}"
                )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()
        del store
    assert all(p.returncode is not None for p in procs)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_layout_matches_tp1_pp1(tp, pp, models, inputs, tmp_path):
    inputs_path, data = inputs
    shm_before = set(glob.glob("/dev/shm/nereus-*"))
    _run_workers(tp, pp, models, inputs_path, tmp_path)
    leaked = set(glob.glob("/dev/shm/nereus-*")) - shm_before
    assert not leaked, f"shared-memory segments leaked: {sorted(leaked)}"
    results = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(tp * pp)]
    valid = data["positions"] >= 0
    close = dict(rtol=1e-4, atol=2e-5)
    for model_dir in models:
        tag = model_dir.name
        config = ModelConfig.from_hf(model_dir)
        spec = model_spec(config)
        ref = _reference(model_dir, data)
        last = [results[(pp - 1) * tp + t] for t in range(tp)]
        for res in last:  # every TP rank of the last stage holds the replicated results
            torch.testing.assert_close(res[f"{tag}.logits"][valid], ref["logits"][valid], **close)
            torch.testing.assert_close(
                res[f"{tag}.logprobs"][valid], ref["logprobs"][valid], **close
            )
            torch.testing.assert_close(res[f"{tag}.entropy"][valid], ref["entropy"][valid], **close)
            torch.testing.assert_close(res[f"{tag}.loss"], ref["loss"], **close)
            torch.testing.assert_close(
                res[f"{tag}.cached_logits"][valid], ref["logits"][valid], **close
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
                    # Each stage's copy holds part of the gradient; engines sum the two.
                    other = (pp - 1) * tp + tp_rank if pp_rank == 0 else tp_rank
                    grad = grad + results[other][key]
                torch.testing.assert_close(
                    grad, expected, **close, msg=lambda m, n=name, r=rank: f"{n} rank {r}: {m}"
                )
        assert seen == {p.name for p in spec}, (
            f"{tag}: parameters without a gradient check: {sorted({p.name for p in spec} - seen)}"
        )
