"""The entropy of the policy in an update: always measured, differentiated only when its bonus counts.

Differentiating the entropy keeps float32 tokens x vocabulary tensors (the softmax, the shifted
logits) alive from the forward pass to the backward pass. With ``entropy_coef: 0`` nothing uses that
gradient, so the update must keep exactly what a loss without any entropy keeps, and still log the
entropy of the policy.
"""

from __future__ import annotations

import pytest
import torch

from raylign.algorithms import LossScale
from raylign.config.rl import AlgorithmConfig
from raylign.models import selected_token_logprobs
from raylign.rl.experience import pack_samples, response_tensor
from raylign.rl.worker import bind_policy_loss, policy_loss_terms

from .rl_helpers import fp32_model, make_sample

# (prompt, response) lengths; 4 + 9 + 2 = 15 response tokens
LENGTHS = [(3, 4), (5, 9), (2, 2)]
ADVANTAGES = [1.0, -0.5, 2.0]


def _batch():
    gen = torch.Generator().manual_seed(4)
    samples = []
    for prompt_len, response_len in LENGTHS:
        ids = torch.randint(3, 500, (prompt_len + response_len,), generator=gen).tolist()
        samples.append(make_sample(ids[:prompt_len], ids[prompt_len:]))
    mask = response_tensor([[1.0] * r for _, r in LENGTHS])
    per_token = {
        "advantages": torch.tensor(ADVANTAGES).unsqueeze(-1) * mask,
        "rollout_logprobs": torch.zeros_like(mask),
    }
    return samples, pack_samples(samples, per_token, behaviour="this_policy")


def _saved_for_backward(fn):
    """``fn()`` and the bytes of the distinct storages autograd keeps for the backward pass while it runs."""
    storages: dict[int, int] = {}
    kept = []  # alive until the end, so that no storage is freed and its address reused meanwhile

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor)
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return result, sum(storages.values())


def _expected_mean_entropy(model, samples) -> float:
    """Mean over response tokens of -sum_v p log p, one unpacked forward per sample."""
    with torch.no_grad():
        total, tokens = 0.0, 0
        for s in samples:
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
            rows = torch.log_softmax(logits[len(s.prompt_ids) - 1 : -1], dim=-1)
            total += float(-(rows.exp() * rows).sum())
            tokens += len(s.response_ids)
    return total / tokens


SCALE = LossScale(global_tokens=15.0, global_sequences=3.0)


def _algorithm(entropy_coef: float) -> AlgorithmConfig:
    return AlgorithmConfig(kl_mode="none", kl_coef=0.0, entropy_coef=entropy_coef, aggregation="token_mean")


def _terms(model, batch, entropy_coef: float):
    a = _algorithm(entropy_coef)
    return policy_loss_terms(model, batch, batch.mask, None, SCALE, a, bind_policy_loss(a), 1.0)


def test_without_an_entropy_bonus_the_update_keeps_nothing_for_the_entropy(rl_model_dir):
    model = fp32_model(rl_model_dir).train()
    samples, batch = _batch()
    vocab = model.get_output_embeddings().weight.shape[0]

    def policy_gradient_alone():
        lp = selected_token_logprobs(
            model, batch.input_ids, batch.resp_index, position_ids=batch.position_ids, mask=batch.mask
        )
        policy_loss = bind_policy_loss(_algorithm(0.0))
        return policy_loss(lp, lp.detach(), batch.advantages, batch.mask, token_weights=None, scale=SCALE)[0]

    _, baseline = _saved_for_backward(policy_gradient_alone)
    (terms, stats, _), without = _saved_for_backward(lambda: _terms(model, batch, 0.0))
    (terms_with, stats_with, _), with_bonus = _saved_for_backward(lambda: _terms(model, batch, 0.01))

    assert without == baseline
    # The bonus keeps at least the softmax and the shifted logits: two float32 [15, vocab] tensors.
    assert with_bonus - baseline >= 2 * 15 * vocab * 4
    assert set(terms) == {"policy_loss"} and set(terms_with) == {"policy_loss", "entropy_loss"}
    # The entropy is still measured, and it is the policy's.
    expected = _expected_mean_entropy(model, samples)
    assert float(stats["entropy"]) == pytest.approx(expected, abs=1e-5)
    assert float(stats_with["entropy"]) == pytest.approx(expected, abs=1e-5)


def test_the_entropy_bonus_gradient_is_minus_coef_times_the_entropy_gradient(rl_model_dir):
    """With a bonus the entropy term is differentiated: its gradient on the output layer equals
    -coef x that of the token-mean entropy written out as -sum p log p."""
    model = fp32_model(rl_model_dir).train()
    samples, batch = _batch()
    coef = 0.5
    terms, _, _ = _terms(model, batch, coef)
    head = model.get_output_embeddings().weight
    (got,) = torch.autograd.grad(terms["entropy_loss"], head)

    total = torch.zeros(())
    for s in samples:
        logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
        rows = torch.log_softmax(logits[len(s.prompt_ids) - 1 : -1], dim=-1)
        total = total - (rows.exp() * rows).sum()
    (expected,) = torch.autograd.grad(-coef * total / 15, head)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)
