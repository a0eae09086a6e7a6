"""Vocab-parallel helpers at TP=1 against plain torch (TP>1 runs in test_tp_pp)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.models import (
    ParallelContext,
    gather_vocab,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 5),
    vocab=st.integers(2, 50),
    temperature=st.sampled_from([1.0, 0.7, 2.0]),
    scale=st.sampled_from([1.0, 30.0]),
)
def test_logprobs_and_entropy_match_torch(batch, seq, vocab, temperature, scale):
    pc = ParallelContext()
    gen = torch.Generator().manual_seed(batch * 100 + seq * 10 + vocab)
    logits = (scale * torch.randn(batch, seq, vocab, generator=gen)).requires_grad_(True)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    lp = vocab_parallel_logprobs(logits, targets, pc, temperature=temperature)
    ref_all = torch.log_softmax(logits.detach() / temperature, -1)
    torch.testing.assert_close(lp.detach(), ref_all.gather(-1, targets[..., None])[..., 0])
    ent = vocab_parallel_entropy(logits, pc)
    ref_p = torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(
        ent.detach(),
        -(ref_p * torch.log_softmax(logits.detach(), -1)).sum(-1),
        rtol=1e-4,
        atol=1e-5,
    )

    (lp.sum() + 0.5 * ent.sum()).backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_lp = torch.log_softmax(ref_logits / temperature, -1).gather(-1, targets[..., None])[..., 0]
    ref_ent = -(torch.softmax(ref_logits, -1) * torch.log_softmax(ref_logits, -1)).sum(-1)
    (ref_lp.sum() + 0.5 * ref_ent.sum()).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-4, atol=1e-5)


def test_logprobs_of_bf16_logits_are_float32():
    logits = torch.randn(2, 3, 8).to(torch.bfloat16)
    lp = vocab_parallel_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), ParallelContext())
    assert lp.dtype == torch.float32
    assert torch.equal(gather_vocab(logits, ParallelContext()), logits)
