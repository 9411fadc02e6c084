"""Score models: initialisation from a causal LM, pooling, per-token scores, save and reload."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from raylign.config.model import LoraConfig, ModelConfig
from raylign.models import load_score_model, load_tokenizer, sequence_scores, token_scores

PAD = "<|pad|>"


def config(path, **fields) -> ModelConfig:
    return ModelConfig(path=str(path), dtype="float32", **fields)


def right_padded_batch(pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    for row, length in enumerate([10, 6, 3]):
        ids[row, length:] = pad_id
        mask[row, length:] = 0
    return ids, mask


@pytest.fixture(scope="module")
def score_model(tiny_model_dir):
    return load_score_model(config(tiny_model_dir)).eval()


@pytest.fixture(scope="module")
def pad_id(tiny_qwen2) -> int:
    return load_tokenizer(tiny_qwen2).convert_tokens_to_ids(PAD)


def test_backbone_weights_equal_the_causal_lm(tiny_model_dir, score_model):
    lm_backbone = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).model.state_dict()
    score_backbone = score_model.model.state_dict()
    assert score_backbone.keys() == lm_backbone.keys()
    for name, weight in lm_backbone.items():
        assert torch.equal(score_backbone[name], weight), name


def test_fresh_head_has_small_std_and_one_output(score_model):
    weight = score_model.score.weight
    assert weight.shape == (1, 64)
    expected_std = 1 / math.sqrt(64 + 1)
    assert 0.6 * expected_std < weight.std().item() < 1.5 * expected_std


def test_pad_token_id_comes_from_the_tokenizer(score_model, pad_id):
    assert score_model.config.pad_token_id == pad_id


def test_sequence_scores_equal_hf_pooled_logits(score_model, pad_id):
    ids, mask = right_padded_batch(pad_id)
    with torch.no_grad():
        expected = score_model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        got = sequence_scores(score_model, ids, mask)
    assert got.shape == (3,) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_token_score_at_t_equals_pooled_score_of_the_prefix(score_model):
    ids = torch.randint(5, 500, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = token_scores(score_model, ids)
        expected = torch.stack([score_model(input_ids=ids[:, : t + 1]).logits[0, 0] for t in range(ids.shape[1])])
    assert got.shape == (1, 7)
    torch.testing.assert_close(got[0], expected, atol=1e-5, rtol=0)


def test_token_scores_of_packed_samples_equal_each_sample_alone(score_model):
    gen = torch.Generator().manual_seed(2)
    samples = [torch.randint(5, 500, (n,), generator=gen) for n in (4, 6, 2)]
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    with torch.no_grad():
        packed = token_scores(score_model, ids, position_ids=positions)[0]
        alone = [score_model.score(score_model.model(input_ids=s[None]).last_hidden_state)[0, :, 0] for s in samples]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=0)


def test_token_scores_zero_padding(score_model, pad_id):
    ids, mask = right_padded_batch(pad_id)
    with torch.no_grad():
        scores = token_scores(score_model, ids, mask)
    assert bool((scores[1, 6:] == 0).all()) and bool((scores[2, 3:] == 0).all())
    assert bool((scores[0] != 0).all())


def test_prm_head_gives_per_token_label_logits(tiny_qwen2):
    model = load_score_model(config(tiny_qwen2), num_labels=3).eval()
    ids = torch.randint(5, 500, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        per_token = token_scores(model, ids)
        pooled = sequence_scores(model, ids, torch.ones_like(ids))
        expected_last = model(input_ids=ids).logits
    assert per_token.shape == (2, 5, 3) and pooled.shape == (2, 3)
    torch.testing.assert_close(per_token[:, -1], expected_last, atol=1e-5, rtol=0)
    torch.testing.assert_close(pooled, expected_last, atol=1e-5, rtol=0)


def test_saved_score_model_reloads_with_transformers(tiny_qwen2, tmp_path, pad_id):
    model = load_score_model(config(tiny_qwen2)).eval()
    ids, mask = right_padded_batch(pad_id)
    with torch.no_grad():
        before = sequence_scores(model, ids, mask)
    model.save_pretrained(tmp_path)
    load_tokenizer(tiny_qwen2).save_pretrained(tmp_path)
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_score_model(config(tmp_path), init_from_causal_lm=False).eval()
    with torch.no_grad():
        hf_scores = reloaded(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        our_scores = sequence_scores(ours, ids, mask)
    torch.testing.assert_close(hf_scores, before, atol=1e-6, rtol=0)
    torch.testing.assert_close(our_scores, before, atol=1e-6, rtol=0)
    assert torch.equal(ours.score.weight, model.score.weight)


def test_causal_lm_folder_without_head_is_rejected_when_not_initialising(tiny_qwen2):
    with pytest.raises(ValueError, match="holds no 'score' head.*init_from_causal_lm=True"):
        load_score_model(config(tiny_qwen2), init_from_causal_lm=False)


def test_lora_score_model_trains_adapters_and_head(tiny_qwen2):
    lora = LoraConfig(rank=2, target_modules=["q_proj", "v_proj"])
    model = load_score_model(config(tiny_qwen2, lora=lora))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any("score" in name for name in trainable)
    assert all("lora_" in name or "score" in name for name in trainable)
    ids = torch.randint(5, 500, (2, 5), generator=torch.Generator().manual_seed(4))
    token_scores(model, ids).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_row_without_tokens_is_rejected(score_model):
    ids = torch.ones(2, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="row 1 of the batch has no real tokens"):
        sequence_scores(score_model, ids, mask)
