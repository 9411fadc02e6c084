"""Reward-model source: scores equal (raw - mean) / std of an independent Hugging Face forward."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from raylign.rollout.rewards import LocalRewardModel, RewardModelScorer, RewardModelSource
from raylign.rollout.rewards.reward_model import read_normalization

PROMPTS = ["What is 2 + 2?", "Reverse abc", "Say hello"]
RESPONSES = ["4", "cba, which is abc reversed letter by letter", "hello"]


def test_read_normalization_uses_the_raylign_config_keys(tiny_reward_model_dir, rm_mean_std):
    assert read_normalization(tiny_reward_model_dir) == rm_mean_std


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"raylign_reward_mean": NaN, "raylign_reward_std": 1.0}', "must be a finite number"),
        ('{"raylign_reward_mean": true, "raylign_reward_std": 1.0}', "must be a finite number"),
        ('{"raylign_reward_mean": 0.5, "raylign_reward_std": 1' + "0" * 400 + "}", "must be a finite number"),
        ('{"raylign_reward_mean": 0.5, "raylign_reward_std": 0}', "must be a finite number"),
        ('{"raylign_reward_mean": 0.5,', "not valid JSON"),
        ("[0.5, 1.0]", "must hold a JSON object, got list"),
    ],
)
def test_a_damaged_normalization_is_an_error_naming_the_file(text, problem, tmp_path):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 'config.json'))}: .*{problem}"):
        read_normalization(tmp_path)


def test_local_scorer_normalised_scores_match_independent_forward(
    tiny_reward_model_dir, rm_mean_std, reference_rm_scores
):
    mean, std = rm_mean_std
    raw = reference_rm_scores(tiny_reward_model_dir, PROMPTS, RESPONSES)
    assert max(raw) - min(raw) > 0.05  # the samples really score differently
    scorer = RewardModelScorer(str(tiny_reward_model_dir), batch_size=2)  # padded batches of 2 and 1
    expected = [(r - mean) / std for r in raw]
    assert scorer.score_texts(PROMPTS, RESPONSES) == pytest.approx(expected, abs=1e-5)


def test_local_scorer_raw_scores_without_normalisation(tiny_reward_model_dir, reference_rm_scores):
    scorer = RewardModelScorer(str(tiny_reward_model_dir), batch_size=3, normalize=False)
    expected = reference_rm_scores(tiny_reward_model_dir, PROMPTS, RESPONSES)
    assert scorer.score_texts(PROMPTS, RESPONSES) == pytest.approx(expected, abs=1e-5)


def test_prompt_already_rendered_by_the_chat_template_is_not_wrapped_again(tiny_reward_model_dir, reference_rm_scores):
    # RL hands reward sources the prompt as the engines saw it: rendered, ending in the generation prompt.
    rendered = [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n" for p in PROMPTS]
    scorer = RewardModelScorer(str(tiny_reward_model_dir), normalize=False)
    expected = reference_rm_scores(tiny_reward_model_dir, PROMPTS, RESPONSES)
    assert scorer.score_texts(rendered, RESPONSES) == pytest.approx(expected, abs=1e-5)


def test_prompt_messages_in_metadata_are_rendered_with_the_response(tiny_reward_model_dir, reference_rm_text_scores):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    source = LocalRewardModel(str(tiny_reward_model_dir), normalize=False)
    result = source.score(
        ["ignored when messages are given", "Say hello"],
        ["hello", "hello"],
        [None, None],
        [{"prompt_messages": messages}, {}],
    )
    expected = reference_rm_text_scores(
        tiny_reward_model_dir,
        [
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hello<|im_end|>\n"
            "<|im_start|>assistant\nhello<|im_end|>\n",
            "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n",
        ],
    )
    assert result.rewards == pytest.approx(expected, abs=1e-5)
    assert abs(expected[0] - expected[1]) > 1e-3  # the system turn really changed the scored text


def test_normalize_without_stored_statistics_is_a_clear_error(tiny_reward_model_dir, tmp_path):
    copy = shutil.copytree(tiny_reward_model_dir, tmp_path / "rm_no_stats")
    config = json.loads((copy / "config.json").read_text())
    del config["raylign_reward_mean"], config["raylign_reward_std"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json has no raylign_reward_mean / raylign_reward_std.*normalize"):
        RewardModelScorer(str(copy))


def test_plain_language_model_folder_is_refused(tiny_reward_model_dir):
    lm_dir = tiny_reward_model_dir.parent / "lm"  # the causal LM the reward model was made from
    with pytest.raises(ValueError, match=r"lacks trained weights for score.weight; is it a plain language model"):
        RewardModelScorer(str(lm_dir), normalize=False)


def test_encoder_classifier_scores_match_its_own_unpadded_forward(tiny_reward_model_dir, tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path / "bert_rm")
    tokenizer.save_pretrained(tmp_path / "bert_rm")
    expected = []
    for prompt, response in zip(PROMPTS, RESPONSES):
        text = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{response}<|im_end|>\n"
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            expected.append(model(input_ids=ids).logits[0, 0].item())
    scorer = RewardModelScorer(str(tmp_path / "bert_rm"), batch_size=3, normalize=False)
    assert scorer.score_texts(PROMPTS, RESPONSES) == pytest.approx(expected, abs=1e-5)
    # Cut to max_length, a sample keeps the first token its classifier reads and the end (it lost the first).
    expected, cut = [], 12
    for prompt, response in zip(PROMPTS, RESPONSES):
        text = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{response}<|im_end|>\n"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) > cut
        with torch.no_grad():
            expected.append(model(input_ids=torch.tensor([ids[:1] + ids[1 - cut :]])).logits[0, 0].item())
    scorer = RewardModelScorer(str(tmp_path / "bert_rm"), batch_size=3, normalize=False, max_length=cut)
    assert scorer.score_texts(PROMPTS, RESPONSES) == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
def test_ray_actor_source_matches_independent_forward(
    ray_session, tiny_reward_model_dir, rm_mean_std, reference_rm_scores
):
    mean, std = rm_mean_std
    expected = [(r - mean) / std for r in reference_rm_scores(tiny_reward_model_dir, PROMPTS, RESPONSES)]
    source = RewardModelSource(str(tiny_reward_model_dir), batch_size=2, num_cpus=1)
    try:
        result = source.score(PROMPTS, RESPONSES, [None] * 3, [{}] * 3)
    finally:
        source.close()
    assert result.rewards == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
def test_ray_actor_that_cannot_load_names_the_folder(ray_session, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"reward model .*not_a_model could not be loaded in its Ray actor: "
        r"FileNotFoundError: model path .*not_a_model. does not exist",
    ):
        RewardModelSource(str(tmp_path / "not_a_model"), num_cpus=0)
