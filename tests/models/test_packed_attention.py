"""raylign_sdpa: causal attention within each packed sample, computed sample by sample (samples of
equal length together, as one batch).

Expected values come from transformers' eager attention (a plain softmax over a masked score
matrix) run on each sample alone, not from the kernel under test.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import raylign.models.packed_attention as packed_attention
from raylign.config.model import ModelConfig
from raylign.models.packed_attention import (
    ONE_ROW,
    PER_SAMPLE_SDPA,
    computes_samples_apart,
    keep_samples_apart,
    packed_row_tokens,
    runs_samples_apart,
    sample_spans,
)

LENGTHS = [6, 11, 3, 8]
REPEATED = [6, 11, 3, 6, 8, 3, 6]  # three samples of 6 tokens, two of 3: batched by length


def _model(folder, kernel: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=kernel)


def _samples(lengths: list[int] = LENGTHS) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, 500, (n,), generator=gen) for n in lengths]


def test_sample_spans_start_wherever_the_position_does_not_grow_by_one():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 0, 1]])
    assert sample_spans(positions) == [[(0, 3), (3, 5), (5, 9)], [(0, 6), (6, 7), (7, 9)]]


@pytest.mark.parametrize("lengths", [LENGTHS, REPEATED], ids=["distinct", "repeated"])
def test_packed_row_logits_and_gradients_equal_each_sample_alone_under_eager_attention(tiny_model_dir, lengths):
    """One row of samples through raylign_sdpa: every sample's logits, and the weights' gradients of a
    loss summed over all samples, equal eager attention's on each sample alone (1e-5, float32); with
    lengths that repeat, the samples batched by length come back in their places in the row."""
    samples = _samples(lengths)
    ours, eager = _model(tiny_model_dir, PER_SAMPLE_SDPA), _model(tiny_model_dir, "eager")
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    packed = ours(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    packed.pow(2).mean(-1).sum().backward()
    alone = [eager(input_ids=s[None], use_cache=False).logits[0] for s in samples]
    sum(a.pow(2).mean(-1).sum() for a in alone).backward()
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=0)
    for (name, p), (_, q) in zip(ours.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    ("lengths", "expected"),
    [
        (LENGTHS, [(1, 6), (1, 11), (1, 3), (1, 8)]),
        (REPEATED, [(3, 6), (1, 11), (2, 3), (1, 8)]),
    ],
    ids=["distinct", "repeated"],
)
def test_attention_runs_each_sample_causally_on_its_own_tokens(tiny_qwen2, monkeypatch, lengths, expected):
    """Per layer, one causal kernel call per distinct sample length, on a batch of the samples of that
    length (in order of first appearance), each of them its own tokens only: no query meets another
    sample's keys, and the work is the sum of the samples' own attention."""
    calls = []
    real = packed_attention.F.scaled_dot_product_attention

    def record(query, key, value, **kwargs):
        assert query.dim() == 4 and query.shape[2] == key.shape[2] and kwargs["is_causal"]
        calls.append((query.shape[0], query.shape[2]))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(packed_attention.F, "scaled_dot_product_attention", record)
    model = _model(tiny_qwen2, PER_SAMPLE_SDPA)
    samples = _samples(lengths)
    with torch.no_grad():
        model(
            input_ids=torch.cat(samples)[None],
            position_ids=torch.cat([torch.arange(len(s)) for s in samples])[None],
            use_cache=False,
        )
    assert calls == expected * model.config.num_hidden_layers
    assert sum(b * n for b, n in expected) == sum(lengths)


def test_generation_with_left_padding_equals_sdpa(tiny_qwen2):
    """Padded prompts, a KV cache and one-token decoding steps go to transformers' sdpa unchanged."""
    ours, sdpa = _model(tiny_qwen2, PER_SAMPLE_SDPA), _model(tiny_qwen2, "sdpa")
    ids = torch.tensor([[0, 0, 7, 8, 9], [4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))


def test_models_switch_to_it_only_where_it_computes_the_same_attention(tiny_qwen2, tiny_llama):
    assert keep_samples_apart(_model(tiny_llama, "sdpa")).config._attn_implementation == PER_SAMPLE_SDPA
    assert keep_samples_apart(_model(tiny_qwen2, "eager")).config._attn_implementation == "eager"
    windowed = AutoConfig.for_model("mistral", sliding_window=16)
    assert not computes_samples_apart(windowed)
    assert computes_samples_apart(AutoConfig.for_model("mistral", sliding_window=None))
    assert not computes_samples_apart(AutoConfig.for_model("gpt2"))
    sdpa, eager = ModelConfig(path=str(tiny_qwen2)), ModelConfig(path=str(tiny_qwen2), attn_implementation="eager")
    assert runs_samples_apart([sdpa])
    assert not runs_samples_apart([eager])


@pytest.mark.parametrize(
    ("setting", "apart", "expected"),
    [(0, True, ONE_ROW), (0, False, 0), (512, True, 512), (512, False, 512)],
)
def test_row_length_zero_means_one_row_where_samples_are_computed_apart(setting, apart, expected):
    assert packed_row_tokens(setting, apart) == expected


def test_a_forward_pass_reads_the_sample_spans_once_for_all_its_layers(tiny_qwen2, monkeypatch):
    """The layers share one plan per forward pass (and its recomputation under activation checkpointing):
    the positions are read back from the device once, not once per layer. A tensor changed in place
    gets a new plan, with the attention it now describes."""
    reads = []
    real = packed_attention.sample_spans

    def counted(position_ids):
        reads.append(position_ids.shape)
        return real(position_ids)

    monkeypatch.setattr(packed_attention, "sample_spans", counted)
    model = _model(tiny_qwen2, PER_SAMPLE_SDPA)
    model.gradient_checkpointing_enable()
    model.train()
    samples = _samples(REPEATED)
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    model(input_ids=ids, position_ids=positions, use_cache=False).logits.sum().backward()
    assert model.config.num_hidden_layers > 1 and len(reads) == 1
    # The same tensor, now one sample: the plan is made again and the attention spans the whole row.
    positions.copy_(torch.arange(ids.shape[1])[None])
    with torch.no_grad():
        whole = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        reference = _model(tiny_qwen2, "eager")(input_ids=ids, use_cache=False).logits
    assert len(reads) == 2
    torch.testing.assert_close(whole, reference, atol=1e-5, rtol=0)


def _exact_attention(query, key, value, lengths: list[int]) -> torch.Tensor:
    """Causal softmax attention of each sample on its own, in float64: ``[1, T, H, D]`` like raylign_sdpa's."""
    groups = query.shape[1] // key.shape[1]
    outputs, start = [], 0
    for length in lengths:
        q, k, v = (t[0, :, start : start + length].double() for t in (query, key, value))
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        outputs.append(torch.softmax(scores, dim=-1) @ v)
        start += length
    return torch.cat(outputs, dim=1).transpose(0, 1)[None]


def test_bf16_attention_on_a_cpu_without_amx_is_the_exact_attention_rounded_once(monkeypatch):
    """On a CPU without AMX raylign_sdpa computes bf16 attention in float32 and rounds once: its output and
    the gradients of its bf16 inputs are float64 attention's of the same bf16 values to one bf16
    rounding (half a step: within 2^-8 of the value), samples of repeated lengths batched included."""
    monkeypatch.setattr(packed_attention, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    gen = torch.Generator().manual_seed(1)
    total = sum(REPEATED)
    query, key, value = (torch.randn(1, h, total, 16, generator=gen).bfloat16() for h in (4, 2, 2))
    grad = torch.randn(1, total, 4, 16, generator=gen).bfloat16()
    positions = torch.cat([torch.arange(n) for n in REPEATED])[None]
    inputs = [t.clone().requires_grad_(True) for t in (query, key, value)]
    exact_inputs = [t.double().requires_grad_(True) for t in (query, key, value)]
    out, _ = packed_attention.per_sample_attention(torch.nn.Module(), *inputs, None, position_ids=positions)
    out.backward(grad)
    exact = _exact_attention(*exact_inputs, REPEATED)
    exact.backward(grad.double())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), exact.detach(), atol=1e-6, rtol=2**-8)
    for ours, reference in zip(inputs, exact_inputs, strict=True):
        assert ours.grad.dtype == torch.bfloat16
        torch.testing.assert_close(ours.grad.double(), reference.grad, atol=1e-6, rtol=2**-8)


@pytest.mark.parametrize(
    ("flags", "dtype", "expected"),
    [
        ({"avx512_bf16"}, torch.bfloat16, True),
        ({"avx512_bf16", "amx_bf16"}, torch.bfloat16, False),  # torch's packed bf16 kernels run there
        ({"avx512_bf16"}, torch.float32, False),
    ],
)
def test_attention_is_computed_in_float32_for_bf16_on_a_cpu_without_amx_only(monkeypatch, flags, dtype, expected):
    monkeypatch.setattr(packed_attention, "cpu_flags", lambda: frozenset(flags))
    assert packed_attention.computes_in_float32(torch.zeros(1, dtype=dtype)) is expected
