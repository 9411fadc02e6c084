"""Per-token log-probs and entropies: math against plain references, padded and packed batches."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from raylign.models import (
    entropy_from_logits,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
    selected_token_logprobs,
    sequence_logprobs,
    token_logprobs,
)
from raylign.models.packed_attention import PER_SAMPLE_SDPA

LENGTHS = [5, 9, 3]
PAD_ID = 3  # any id works: padded positions are masked


# ---------------------------------------------------------------- pure functions


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 3, 1024])
def test_logprobs_from_logits_matches_log_softmax_gather(temperature, chunk_rows):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 50, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, 50, (2, 7), generator=gen)
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    got = logprobs_from_logits(logits, labels, temperature=temperature, chunk_rows=chunk_rows)
    assert got.dtype == torch.float64 and got.shape == (2, 7)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_logprobs_from_logits_accepts_bf16_and_flat_shapes():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=gen).bfloat16()
    labels = torch.randint(0, 40, (6,), generator=gen)
    expected = torch.log_softmax(logits.float(), dim=-1)[torch.arange(6), labels]
    torch.testing.assert_close(logprobs_from_logits(logits, labels, chunk_rows=4), expected, atol=1e-5, rtol=0)


def test_logprobs_from_logits_of_uniform_logits_is_minus_log_vocab():
    logits = torch.zeros(1, 4, 16)
    labels = torch.tensor([[0, 5, 9, 15]])
    torch.testing.assert_close(logprobs_from_logits(logits, labels), torch.full((1, 4), -math.log(16)))


def test_logprobs_from_logits_rejects_mismatched_labels():
    with pytest.raises(ValueError, match=r"logits \(2, 3, 5\) and labels \(2, 4\)"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_logprobs_from_logits_rejects_non_positive_temperature():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs_from_logits(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_entropy_from_logits_matches_minus_sum_p_log_p(temperature):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 30, generator=gen, dtype=torch.float64) * 4
    probs = torch.softmax(logits / temperature, dim=-1)
    expected = -(probs * torch.log(probs)).sum(-1)
    got = entropy_from_logits(logits, temperature=temperature, chunk_rows=2)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_entropy_matches_a_python_sum_and_of_three_equal_logits_is_log_3():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]]], dtype=torch.float64)
    expected = []
    for row in logits[0].tolist():
        z = sum(math.exp(x) for x in row)
        expected.append(-sum(math.exp(x) / z * math.log(math.exp(x) / z) for x in row))
    assert entropy_from_logits(logits)[0].tolist() == pytest.approx(expected, abs=1e-12)
    assert expected[1] == pytest.approx(math.log(3))


def test_entropy_of_large_equal_logits_is_log_vocab_to_float32_precision():
    # Unshifted, logsumexp(z) - sum p z cancels 512.69 - 512 in float32 to an error of about 1e-4.
    got = entropy_from_logits(torch.full((1, 1, 2), 512.0))
    assert abs(got.item() - math.log(2)) < 1e-6


def test_entropy_of_logits_with_masked_entries_is_that_of_the_others():
    # Two of four logits masked to -inf (top-k, or a vocabulary cut): the other two are equal, so the
    # entropy is log 2, and its gradient is finite.
    logits = torch.tensor([[[1.0, float("-inf"), 1.0, float("-inf")]]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    assert entropy.item() == pytest.approx(math.log(2), abs=1e-6)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_keeps_float32_for_half_precision_logits():
    assert entropy_from_logits(torch.zeros(1, 2, 4, dtype=torch.bfloat16)).dtype == torch.float32


def test_entropy_of_uniform_is_log_vocab_and_of_one_hot_is_zero():
    uniform = torch.zeros(1, 2, 8)
    one_hot = torch.tensor([[[0.0, 1e4, 0.0, 0.0]]])
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((1, 2), math.log(8)))
    torch.testing.assert_close(entropy_from_logits(one_hot), torch.zeros(1, 1))


def test_logprobs_from_logits_gradient_matches_reference():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 4, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 4), generator=gen)
    ours = base.clone().requires_grad_(True)
    ref = base.clone().requires_grad_(True)
    logprobs_from_logits(ours, labels, chunk_rows=3).sum().backward()
    torch.log_softmax(ref, -1).gather(-1, labels[..., None]).sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad, atol=1e-6, rtol=0)


def test_bf16_logprobs_and_their_gradient_match_log_softmax_of_the_float_logits():
    """bf16 logits in several chunks, at a temperature: the log-probs equal ``log_softmax(logits / T)``
    read at the labels (float64 reference) to float32 rounding, and the gradient, bf16 like the logits,
    equals the reference's to one bf16 rounding (half a step: 2^-9 of the value, within 2^-8 of it)."""
    gen = torch.Generator().manual_seed(5)
    base = (torch.randn(3, 6, 200, generator=gen) * 4).bfloat16()
    labels = torch.randint(0, 200, (3, 6), generator=gen)
    weights = torch.randn(3, 6, generator=gen)
    ours = base.clone().requires_grad_(True)
    ref = base.double().requires_grad_(True)
    got = logprobs_from_logits(ours, labels, temperature=0.7, chunk_rows=4)
    (got * weights).sum().backward()
    expected = torch.log_softmax(ref / 0.7, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    (expected * weights.double()).sum().backward()
    torch.testing.assert_close(got.double(), expected.detach(), atol=2e-5, rtol=0)
    assert ours.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours.grad.double(), ref.grad, atol=1e-7, rtol=2**-8)


def test_the_backward_pass_keeps_the_bf16_logits_and_no_float32_copy_of_them():
    """What autograd keeps from the log-probs of bf16 logits ``[N, V]`` until the backward pass: the
    logits and a few numbers per row, where a float32 copy alone would be twice the logits' bytes."""
    logits = torch.randn(64, 1000).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 1000, (64,))
    storages: dict[int, int] = {}
    kept = []  # alive until the end, so that no storage is freed and its address reused meanwhile

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor)
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs_from_logits(logits, labels, chunk_rows=16)
    assert sum(storages.values()) <= logits.numel() * 2 + 64 * 16


def test_logprobs_and_entropy_in_one_pass_equal_the_separate_functions():
    """Log-probs (values and gradient) as :func:`logprobs_from_logits`, entropies ``-sum p log p`` of a
    float64 reference (rows with masked logits included), and no graph for the entropy."""
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(2, 5, 30, generator=gen) * 3
    base[0, 1, :10] = float("-inf")  # masked entries: p = 0
    labels = torch.randint(10, 30, (2, 5), generator=gen)
    one_pass, separate = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    logprobs, entropy = logprobs_and_entropy_from_logits(one_pass, labels, temperature=0.8, chunk_rows=3)
    expected = logprobs_from_logits(separate, labels, temperature=0.8, chunk_rows=3)
    assert torch.equal(logprobs, expected) and not entropy.requires_grad
    logprobs.sum().backward()
    expected.sum().backward()
    assert torch.equal(one_pass.grad, separate.grad)
    log_p = torch.log_softmax(base.double() / 0.8, dim=-1)
    reference = -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)
    torch.testing.assert_close(entropy.double(), reference, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- model batches


@pytest.fixture(scope="module", params=["sdpa", "eager", PER_SAMPLE_SDPA])
def model(request, tiny_qwen2):
    lm = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32, attn_implementation=request.param)
    return lm.eval()


@pytest.fixture(scope="module")
def samples() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, 500, (length,), generator=gen) for length in LENGTHS]


def reference_logprobs_and_entropy(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample alone, plain forward, log_softmax at t-1 read at ids[t]; position 0 is 0."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].double()
    logprobs = torch.zeros(len(ids), dtype=torch.float64)
    entropy = torch.zeros(len(ids), dtype=torch.float64)
    for t in range(1, len(ids)):
        log_p = torch.log_softmax(logits[t - 1], dim=-1)
        logprobs[t] = log_p[ids[t]]
        entropy[t] = -(log_p.exp() * log_p).sum()
    return logprobs.float(), entropy.float()


def pack(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    return ids, positions


def pad(samples: list[torch.Tensor], side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in samples)
    ids = torch.full((len(samples), width), PAD_ID)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        span = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[row, span] = s
        mask[row, span] = 1
    return ids, mask


def test_packed_row_equals_each_sample_alone(model, samples):
    ids, positions = pack(samples)
    with torch.no_grad():
        got = token_logprobs(model, ids, position_ids=positions)
    expected = torch.cat([reference_logprobs_and_entropy(model, s)[0] for s in samples])
    assert got.shape == (1, sum(LENGTHS))
    torch.testing.assert_close(got[0], expected, atol=1e-5, rtol=0)


def test_packed_row_equals_right_padded_batch(model, samples):
    packed_ids, positions = pack(samples)
    padded_ids, mask = pad(samples, "right")
    with torch.no_grad():
        packed = token_logprobs(model, packed_ids, position_ids=positions)[0]
        padded = token_logprobs(model, padded_ids, attention_mask=mask)
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    for row, length in enumerate(LENGTHS):
        torch.testing.assert_close(packed[starts[row] : starts[row + 1]], padded[row, :length], atol=1e-5, rtol=0)
        assert bool((padded[row, length:] == 0).all())


def test_sample_starts_and_padding_are_zero(model, samples):
    packed_ids, positions = pack(samples)
    with torch.no_grad():
        packed = token_logprobs(model, packed_ids, position_ids=positions)[0]
    assert packed[[0, 5, 14]].tolist() == [0.0, 0.0, 0.0]
    assert bool((packed[[1, 6, 15]] < 0).all())


def test_left_padded_batch_equals_each_sample_alone(model, samples):
    ids, mask = pad(samples, "left")
    with torch.no_grad():
        got = token_logprobs(model, ids, attention_mask=mask)
    width = ids.shape[1]
    for row, s in enumerate(samples):
        expected = reference_logprobs_and_entropy(model, s)[0]
        torch.testing.assert_close(got[row, width - len(s) :], expected, atol=1e-5, rtol=0)
        assert bool((got[row, : width - len(s)] == 0).all())


def test_packed_rows_with_right_padding_equal_each_sample_alone(model, samples):
    first_ids, first_pos = pack(samples[:2])  # 14 tokens
    second_ids, second_pos = pack(samples[2:])  # 3 tokens, padded to 14
    width = first_ids.shape[1]
    ids = torch.full((2, width), PAD_ID)
    positions = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros((2, width), dtype=torch.long)
    ids[0], positions[0], mask[0] = first_ids[0], first_pos[0], 1
    ids[1, :3], positions[1, :3], mask[1, :3] = second_ids[0], second_pos[0], 1
    with torch.no_grad():
        got = token_logprobs(model, ids, attention_mask=mask, position_ids=positions)
    expected = [reference_logprobs_and_entropy(model, s)[0] for s in samples]
    torch.testing.assert_close(got[0], torch.cat(expected[:2]), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, :3], expected[2], atol=1e-5, rtol=0)
    assert bool((got[1, 3:] == 0).all())


def test_selected_logprobs_of_a_left_padded_batch_run_the_output_layer_at_the_read_tokens_only(model, samples):
    """Samples of 5, 9 and 3 tokens left-padded to 9; their last 4, 7 and 2 tokens are read through a
    right-padded ``[3, 7]`` index (21 entries). The output layer computes 4 + 7 + 2 = 13 rows, and
    the log-probs and entropies are those of each sample alone; the unread entries are 0."""
    ids, attention = pad(samples, "left")
    width = ids.shape[1]
    reads = [4, 7, 2]
    index = torch.zeros(3, 7, dtype=torch.long)
    read_mask = torch.zeros(3, 7)
    for row, count in enumerate(reads):
        index[row, :count] = row * width + torch.arange(width - count, width)
        read_mask[row, :count] = 1
    rows_computed = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda _m, _a, out: rows_computed.append(out.numel() // out.shape[-1]))
    try:
        with torch.no_grad():
            lp, entropy = selected_token_logprobs(
                model, ids, index, attention_mask=attention, with_entropy=True, mask=read_mask
            )
    finally:
        handle.remove()
    assert rows_computed == [13]
    for row, (s, count) in enumerate(zip(samples, reads)):
        expected_lp, expected_entropy = reference_logprobs_and_entropy(model, s)
        torch.testing.assert_close(lp[row, :count], expected_lp[-count:], atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[row, :count], expected_entropy[-count:], atol=1e-5, rtol=0)
        assert not lp[row, count:].any() and not entropy[row, count:].any()


def test_packed_rows_padded_on_the_left_are_rejected(model, samples):
    ids, positions = pack(samples)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="row 0"):
        token_logprobs(model, ids, attention_mask=mask, position_ids=positions)


def test_entropy_is_aligned_like_logprobs(model, samples):
    ids, positions = pack(samples)
    with torch.no_grad():
        _, entropy = token_logprobs(model, ids, position_ids=positions, with_entropy=True)
    expected = torch.cat([reference_logprobs_and_entropy(model, s)[1] for s in samples])
    torch.testing.assert_close(entropy[0], expected, atol=1e-5, rtol=0)


def test_temperature_divides_the_logits(model, samples):
    ids = samples[1][None]
    with torch.no_grad():
        got = token_logprobs(model, ids, temperature=0.5)[0]
        logits = model(input_ids=ids).logits[0]
    expected = torch.log_softmax(logits[:-1] / 0.5, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got[1:], expected, atol=1e-5, rtol=0)
    assert got[0].item() == 0.0


def test_sequence_logprobs_sum_the_marked_tokens_of_each_sample_packed_or_padded(model, samples):
    # The completion of each sample: every token from position 2 on.
    expected = torch.stack([reference_logprobs_and_entropy(model, s)[0][2:].sum() for s in samples])
    packed_ids, positions = pack(samples)
    packed_mask = torch.cat([(torch.arange(len(s)) >= 2).long() for s in samples])[None]
    padded_ids, attention = pad(samples, "right")
    padded_mask = attention * (torch.arange(padded_ids.shape[1]) >= 2).long()
    with torch.no_grad():
        packed = sequence_logprobs(
            model,
            packed_ids,
            packed_mask,
            position_ids=positions,
            seq_starts=torch.tensor(LENGTHS).cumsum(0) - torch.tensor(LENGTHS),
            seq_lens=torch.tensor(LENGTHS),
        )
        padded = sequence_logprobs(model, padded_ids, padded_mask, attention_mask=attention)
    torch.testing.assert_close(packed, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(padded, expected, atol=1e-4, rtol=0)


def test_sequence_logprobs_of_samples_packed_into_several_padded_rows(model, samples):
    # Lengths 5, 9, 3 in rows of 9: sample 1 fills row 1; samples 0 and 2 share row 0 with one pad token after.
    s0, s1, s2 = samples
    pad = torch.tensor([PAD_ID])
    ids = torch.stack([torch.cat([s0, s2, pad]), s1])
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0], list(range(9))])
    mask = (positions >= 2).long()
    mask[0, 8] = 0  # the pad token is never scored
    expected = torch.stack([reference_logprobs_and_entropy(model, s)[0][2:].sum() for s in samples])
    with torch.no_grad():
        got = sequence_logprobs(
            model, ids, mask, position_ids=positions, seq_starts=torch.tensor([0, 9, 5]), seq_lens=torch.tensor(LENGTHS)
        )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
