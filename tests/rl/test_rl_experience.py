"""Packing RL samples into micro-batch rows: the layout, and forward results equal to unpacked ones."""

from __future__ import annotations

import pytest
import torch

from raylign.models import selected_token_logprobs, token_logprobs
from raylign.rl.experience import gather_responses, pack_samples

from .rl_helpers import fp32_model, make_sample, response_logprobs


def test_pack_samples_layout_by_hand():
    samples = [make_sample([1, 2], [3, 4, 5]), make_sample([6], [7]), make_sample([8, 9], [10])]
    batch = pack_samples(samples)  # lengths 5, 2, 3: rows [0] and [1, 2], length 5
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]
    # Flattened positions of the response tokens: row 0 at 2..4, row 1 (offset 5) at 6 and 9.
    assert batch.resp_index.tolist() == [[2, 3, 4], [6, 0, 0], [9, 0, 0]]
    assert batch.mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 0, 0]]

    padded = pack_samples([make_sample([1, 2], [3, 4, 5]), make_sample([6], [7])], row_tokens=0)
    # Lengths 5 and 2 in rows of 5: the first row is full, so the second holds the short sample,
    # right-padded with token 0 at positions restarting from 0.
    assert padded.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert padded.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]


@pytest.mark.parametrize("row_tokens", [0, 12, 10_000])
def test_packed_forward_equals_unpacked_forward(rl_model_dir, row_tokens):
    """Every layout (short rows, medium rows, one row) gives each response the log-probs of its own
    unpacked forward pass: attention never crosses samples, rows or padding."""
    model = fp32_model(rl_model_dir)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for prompt_len, response_len in [(5, 3), (2, 6), (7, 1), (3, 3), (4, 2)]:
        ids = torch.randint(3, 500, (prompt_len + response_len,), generator=gen).tolist()
        samples.append(make_sample(ids[:prompt_len], ids[prompt_len:]))
    batch = pack_samples(samples, row_tokens=row_tokens)
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, position_ids=batch.position_ids)
        got = gather_responses(lp, batch.resp_index, batch.mask)
        for i, s in enumerate(samples):
            expected = response_logprobs(model, s.prompt_ids, s.response_ids)
            torch.testing.assert_close(got[i, : len(s.response_ids)], expected, atol=1e-5, rtol=0)
            assert got[i, len(s.response_ids) :].abs().sum() == 0


def test_logits_at_response_positions_only_give_the_same_logprobs_and_entropies(rl_model_dir):
    """The worker's path (output layer applied at response positions only) against one unpacked
    forward per sample: log-probs, and entropies -sum p log p of the full predictive distribution."""
    model = fp32_model(rl_model_dir)
    gen = torch.Generator().manual_seed(1)
    samples = []
    for prompt_len, response_len in [(4, 5), (1, 2), (6, 3)]:
        ids = torch.randint(3, 500, (prompt_len + response_len,), generator=gen).tolist()
        samples.append(make_sample(ids[:prompt_len], ids[prompt_len:]))
    batch = pack_samples(samples)
    with torch.no_grad():
        lp, entropy = selected_token_logprobs(
            model,
            batch.input_ids,
            batch.resp_index,
            position_ids=batch.position_ids,
            temperature=0.7,
            with_entropy=True,
        )
        for i, s in enumerate(samples):
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float() / 0.7
            rows = torch.log_softmax(logits[len(s.prompt_ids) - 1 : -1], dim=-1)
            expected_lp = rows.gather(-1, torch.tensor(s.response_ids).unsqueeze(-1)).squeeze(-1)
            expected_entropy = -(rows.exp() * rows).sum(-1)
            n = len(s.response_ids)
            torch.testing.assert_close(lp[i, :n], expected_lp, atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[i, :n], expected_entropy, atol=1e-5, rtol=0)
    # The hook is gone afterwards: a plain forward returns logits for every position again.
    assert model(batch.input_ids, use_cache=False).logits.shape[:2] == batch.input_ids.shape


def test_response_only_logits_run_the_output_layer_once_per_trained_response_token(rl_model_dir):
    """A long-tailed batch: responses of 1, 2, 3 and 29 tokens, and an episode of 6 response tokens of
    which 3 are the policy's (the others the environment's, not trained). Its ``[5, 29]`` response index
    has 145 entries; the output layer runs on the 1 + 2 + 3 + 29 + 3 = 38 trained tokens only (counted
    by a hook on the model's real output layer), and their log-probs and entropies equal those of one
    full, unpacked forward per sample; the other entries are 0."""
    model = fp32_model(rl_model_dir)
    gen = torch.Generator().manual_seed(2)
    samples = []
    for prompt_len, response_len in [(4, 1), (2, 2), (5, 3), (3, 29), (4, 6)]:
        ids = torch.randint(3, 500, (prompt_len + response_len,), generator=gen).tolist()
        samples.append(make_sample(ids[:prompt_len], ids[prompt_len:]))
    samples[4].loss_mask = [1, 1, 0, 0, 0, 1]
    trained = [list(range(1)), list(range(2)), list(range(3)), list(range(29)), [0, 1, 5]]
    batch = pack_samples(samples)
    assert batch.mask.numel() == 5 * 29
    rows_computed = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda _m, _a, out: rows_computed.append(out.numel() // out.shape[-1]))
    try:
        with torch.no_grad():
            lp, entropy = selected_token_logprobs(
                model,
                batch.input_ids,
                batch.resp_index,
                position_ids=batch.position_ids,
                temperature=0.7,
                with_entropy=True,
                mask=batch.mask,
            )
    finally:
        handle.remove()
    assert rows_computed == [38]
    with torch.no_grad():
        for i, (s, positions) in enumerate(zip(samples, trained)):
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float() / 0.7
            rows = torch.log_softmax(logits[len(s.prompt_ids) - 1 : -1], dim=-1)
            expected_lp = torch.zeros(29)
            expected_entropy = torch.zeros(29)
            for t in positions:
                expected_lp[t] = rows[t, s.response_ids[t]]
                expected_entropy[t] = -(rows[t].exp() * rows[t]).sum()
            torch.testing.assert_close(lp[i], expected_lp, atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[i], expected_entropy, atol=1e-5, rtol=0)


def test_response_only_logits_of_a_batch_with_nothing_to_train_still_reach_the_output_layer(rl_model_dir):
    """Every data-parallel rank backpropagates through the output layer, even one whose micro-batch
    has no trained token (an episode of environment tokens only): one row is computed, the values are
    0, and their gradient reaches the weights (as zeros)."""
    model = fp32_model(rl_model_dir)
    sample = make_sample([5, 6, 7], [8, 9])
    sample.loss_mask = [0, 0]
    batch = pack_samples([sample])
    lp = selected_token_logprobs(
        model, batch.input_ids, batch.resp_index, position_ids=batch.position_ids, mask=batch.mask
    )
    assert lp.tolist() == [[0.0, 0.0]]
    lp.sum().backward()
    head = model.get_output_embeddings()
    assert head.weight.grad is not None and float(head.weight.grad.abs().sum()) == 0.0
