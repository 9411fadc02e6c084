"""Sequence parallelism: ring attention and Ulysses attention over 2 gloo ranks equal one process over the
whole packed row.

The references are plain: softmax attention with a block-diagonal causal mask built from the
sample lengths, and the HF model with its own attention on the whole row.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from raylign.models import selected_token_logprobs, token_logprobs
from raylign.models.ring_attention import ring_attention, sample_ids_from_position_ids
from raylign.models.sequence_parallel import RING_ATTENTION, shard_packed_batch
from tests.spawned_ranks import import_worker, spawn_and_join

worker = import_worker(__file__, "sequence_parallel_worker")

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
SPAWN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory, tiny_qwen2, tiny_llama):
    out_dir = tmp_path_factory.mktemp("sp_ranks")
    model_dirs = {"qwen2": str(tiny_qwen2), "llama": str(tiny_llama)}
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        spawn_and_join(worker.run_rank, (str(out_dir), model_dirs), worker.WORLD_SIZE, SPAWN_TIMEOUT_S, "ranks")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(worker.WORLD_SIZE)]


def reference_attention(query, key, value, lengths: list[int]) -> torch.Tensor:
    """softmax(Q K^T / sqrt(D) + mask) V over the whole row; the mask allows a key only at or before
    the query and inside the same sample. Key/value head h serves query heads h*G .. h*G+G-1."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    total = sum(lengths)
    same_sample = torch.block_diag(*[torch.ones(n, n) for n in lengths]).bool()
    allowed = same_sample & torch.ones(total, total).tril().bool()
    scores = query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ value


def _joined(rank_results, case: str, key: str, dim: int) -> torch.Tensor:
    return torch.cat([rank[case][key] for rank in rank_results], dim=dim)


def test_sample_ids_start_where_positions_restart():
    position_ids = torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6]])
    assert sample_ids_from_position_ids(position_ids).tolist() == [[0, 0, 0, 1, 2, 2, 3, 3]]


def test_a_packed_row_is_cut_into_equal_chunks_with_targets_from_the_whole_row():
    batch = {
        "input_ids": torch.tensor([[10, 11, 12, 20, 21]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
        "loss_mask": torch.tensor([[0, 1, 1, 0, 1]]),
    }
    first, second = (shard_packed_batch(batch, rank, 2, pad_token_id=99) for rank in (0, 1))
    assert first["input_ids"].tolist() == [[10, 11, 12]] and second["input_ids"].tolist() == [[20, 21, 99]]
    assert first["position_ids"].tolist() == [[0, 1, 2]] and second["position_ids"].tolist() == [[0, 1, 0]]
    assert first["token_index"].tolist() == [[0, 1, 2]] and second["token_index"].tolist() == [[3, 4, 5]]
    assert first["sample_ids"].tolist() == [[0, 0, 0]] and second["sample_ids"].tolist() == [[1, 1, 2]]
    # token t predicts token t + 1: 12 -> 20 crosses into another sample, 21 is the row's last real token
    assert first["target_ids"].tolist() == [[11, 12, 20]] and second["target_ids"].tolist() == [[21, 99, 99]]
    assert first["target_mask"].tolist() == [[1, 1, 0]] and second["target_mask"].tolist() == [[1, 0, 0]]


def test_ring_attention_on_one_process_is_masked_attention():
    torch.manual_seed(0)
    lengths = [4, 1, 5]
    query, key, value = torch.randn(1, 4, 10, 8), torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
    sample_ids = sample_ids_from_position_ids(worker.positions(lengths))
    out = ring_attention(query, key, value, torch.arange(10).unsqueeze(0), sample_ids)
    torch.testing.assert_close(out, reference_attention(query, key, value, lengths), **TOLERANCE)


def test_the_ring_attention_of_a_model_without_a_shard_equals_its_own_attention_on_a_packed_row(tiny_qwen2):
    ring = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32, attn_implementation=RING_ATTENTION)
    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32, attn_implementation="eager")
    inputs = worker.model_inputs(ring.config.vocab_size)
    kwargs = {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"], "use_cache": False}
    torch.testing.assert_close(ring(**kwargs).logits, plain(**kwargs).logits, **TOLERANCE)


def test_the_ring_attention_of_a_model_refuses_a_padding_mask_instead_of_dropping_it(tiny_qwen2):
    ring = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32, attn_implementation=RING_ATTENTION)
    input_ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="does not support padded batches"):
        ring(input_ids=input_ids, attention_mask=torch.tensor([[0, 1, 1, 1]]), use_cache=False)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode", worker.MODES)
@pytest.mark.parametrize("name", list(worker.ATTENTION_CASES))
def test_ring_and_ulysses_attention_on_two_ranks_equal_full_attention(rank_results, name, mode):
    """Outputs and the gradients of sum(out * weights) w.r.t. every rank's queries, keys and values."""
    _, _, lengths = worker.ATTENTION_CASES[name]
    case = f"{name}_{mode}"
    full = worker.attention_inputs(name)
    inputs = [full[n].clone().requires_grad_() for n in ("query", "key", "value")]
    expected = reference_attention(*inputs, lengths)
    expected_grads = torch.autograd.grad((expected * full["weights"]).sum(), inputs)
    torch.testing.assert_close(_joined(rank_results, case, "out", dim=2), expected.detach(), **TOLERANCE)
    for name, want in zip(("query_grad", "key_grad", "value_grad"), expected_grads, strict=True):
        torch.testing.assert_close(_joined(rank_results, case, name, dim=2), want, **TOLERANCE)


def _reference_model(model_dir: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model, worker.model_inputs(model.config.vocab_size)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2_ulysses", "llama_ulysses"])
def test_model_logits_and_gradients_on_two_ranks_equal_one_process(rank_results, arch, tiny_qwen2, tiny_llama):
    model, inputs = _reference_model({"qwen2": tiny_qwen2, "llama": tiny_llama}[arch.removesuffix("_ulysses")])
    total = inputs["input_ids"].shape[1]
    logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False).logits
    (logits * inputs["logit_weights"]).sum().backward()
    torch.testing.assert_close(_joined(rank_results, arch, "logits", dim=1)[:, :total], logits.detach(), **TOLERANCE)
    for name, param in model.named_parameters():
        torch.testing.assert_close(rank_results[0][arch]["logit_grads"][name], param.grad, **TOLERANCE)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2_ulysses", "llama_ulysses"])
def test_sft_loss_and_gradients_on_two_ranks_equal_one_process(rank_results, arch, tiny_qwen2, tiny_llama):
    """The next-token log-probs of the split row (targets crossing the cut included) and the gradient
    of their sum equal the whole row's, masked by the loss mask as SFT does."""
    model, inputs = _reference_model({"qwen2": tiny_qwen2, "llama": tiny_llama}[arch.removesuffix("_ulysses")])
    total = inputs["input_ids"].shape[1]
    logprobs = token_logprobs(model, inputs["input_ids"], position_ids=inputs["position_ids"])
    masked = logprobs * inputs["loss_mask"]
    (-masked.sum()).backward()
    got = _joined(rank_results, arch, "target_logprobs", dim=1)
    torch.testing.assert_close(got[:, : total - 1], masked[:, 1:].detach(), **TOLERANCE)
    assert not got[:, total - 1 :].any(), "the row's last token and the padding predict nothing"
    for name, param in model.named_parameters():
        torch.testing.assert_close(rank_results[0][arch]["loss_grads"][name], param.grad, **TOLERANCE)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_rl_response_logprobs_and_gradients_on_two_ranks_equal_one_process(rank_results, arch, tiny_qwen2, tiny_llama):
    """RL's passes split over a sequence-parallel group: every rank holds the whole ``[b, R]`` of response
    log-probs and entropies of packed rows (responses predicted from both halves of a row included),
    and the ranks' gradients of a loss on them, averaged, are the whole rows' gradient."""
    model, _ = _reference_model({"qwen2": tiny_qwen2, "llama": tiny_llama}[arch])
    inputs = worker.rl_inputs(model.config.vocab_size)
    logprobs, entropy = selected_token_logprobs(
        model,
        inputs["input_ids"],
        inputs["resp_index"],
        position_ids=inputs["position_ids"],
        temperature=0.7,
        with_entropy=True,
        mask=inputs["mask"],
    )
    (logprobs * inputs["logprob_weights"] + entropy * inputs["entropy_weights"]).sum().backward()
    assert bool((logprobs[inputs["mask"].bool()] < 0).all()) and not logprobs[~inputs["mask"].bool()].any()
    for rank in rank_results:
        got = rank[f"{arch}_rl"]
        torch.testing.assert_close(got["logprobs"], logprobs.detach(), **TOLERANCE)
        torch.testing.assert_close(got["entropy"], entropy.detach(), **TOLERANCE)
        torch.testing.assert_close(got["entropy_no_grad"], entropy.detach(), **TOLERANCE)
        for name, param in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], param.grad, **TOLERANCE, msg=name)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_critic_values_and_gradients_on_two_ranks_equal_one_process(rank_results, arch, tiny_qwen2, tiny_llama):
    """A critic split over a sequence-parallel group: every rank holds the value of the state before each
    response token (``V(s_t)`` read one position back), and the averaged gradients are the whole rows'."""
    from raylign.models import token_scores
    from raylign.rl.experience import gather_responses

    model = worker.score_model(str({"qwen2": tiny_qwen2, "llama": tiny_llama}[arch]), "eager")
    inputs = worker.rl_inputs(model.config.vocab_size)
    scores = token_scores(model, inputs["input_ids"], position_ids=inputs["position_ids"])
    values = gather_responses(scores, inputs["resp_index"], inputs["mask"], shift=-1)
    (values * inputs["logprob_weights"]).sum().backward()
    assert bool(values[inputs["mask"].bool()].abs().gt(0).all())
    for rank in rank_results:
        got = rank[f"{arch}_critic"]
        torch.testing.assert_close(got["values"], values.detach(), **TOLERANCE)
        for name, param in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], param.grad, **TOLERANCE, msg=name)
