"""raylign select: best-of-n SFT rows and best-vs-worst pairs, checked against hand-picked answers."""

from __future__ import annotations

import pytest

from raylign.cli.main import main
from raylign.config.base import ConfigError, parse_config
from raylign.config.data import DataConfig
from raylign.config.pipeline import SelectConfig
from raylign.data import RowError, build_sft_datasets
from raylign.data.preference import build_pair_datasets
from raylign.models import load_tokenizer
from raylign.pipeline.select import best_index, run_select, worst_index

from .helpers import read_jsonl, write_jsonl

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
SCORED = [
    {"prompt": "p1", "responses": ["a", "b", "c"], "rewards": [0.2, 0.9, 0.9], "id": 1},
    {"prompt": "p2", "responses": ["x", "y"], "rewards": [0.5, 0.5], "id": 2},
    {"prompt": "p3", "responses": ["same", "same", "other"], "rewards": [1.0, 0.0, 0.5], "id": 3},
    {"prompt": "p4", "responses": ["   ", "low", "high"], "rewards": [5.0, 0.1, 0.3], "id": 4},
    {"prompt": CONVERSATION, "responses": ["hello", "hey there"], "rewards": [0.0, 1.0], "id": 5},
]


def select(tmp_path, rows=SCORED, **sections) -> dict:
    cfg = parse_config(SelectConfig, {"input_path": str(write_jsonl(tmp_path / "scored.jsonl", rows)), **sections})
    return run_select(cfg)


def test_argmax_and_argmin_take_the_first_of_equal_rewards():
    assert best_index([0.2, 0.9, 0.9], [0, 1, 2]) == 1
    assert worst_index([0.9, 0.1, 0.1], [0, 1, 2]) == 1
    assert best_index([3.0, 1.0, 3.0], [1, 2]) == 2  # only candidates count


def test_best_of_n_picks_the_highest_reward_response_of_each_prompt(tmp_path):
    out = tmp_path / "sft.jsonl"
    stats = select(tmp_path, best_of_n={"output_path": str(out)}, keep_keys=["id"])
    assert read_jsonl(out) == [
        {"prompt": "p1", "completion": "b", "reward": 0.9, "id": 1},  # tie between b and c: the first
        {"prompt": "p2", "completion": "x", "reward": 0.5, "id": 2},
        {"prompt": "p3", "completion": "same", "reward": 1.0, "id": 3},
        {"prompt": "p4", "completion": "high", "reward": 0.3, "id": 4},  # the blank answer is never picked
        {
            "prompt": CONVERSATION,
            "completion": "hey there",
            "reward": 1.0,
            "id": 5,
            "messages": CONVERSATION + [{"role": "assistant", "content": "hey there"}],
        },
    ]
    assert stats == {"rows_read": 5, "best_of_n/rows_written": 5}


def test_best_of_n_threshold_drops_prompts_whose_best_reward_is_too_low(tmp_path):
    out = tmp_path / "sft.jsonl"
    stats = select(tmp_path, best_of_n={"output_path": str(out), "min_reward": 0.4}, keep_keys=["id"])
    assert [row["id"] for row in read_jsonl(out)] == [1, 2, 3, 5]  # p4's best is 0.3
    assert stats["best_of_n/skipped/below_min_reward"] == 1


def test_pairs_take_best_and_worst_and_skip_ties_and_identical_texts(tmp_path):
    out = tmp_path / "pairs.jsonl"
    stats = select(tmp_path, pairs={"output_path": str(out)}, keep_keys=["id"])
    rows = read_jsonl(out)
    for row in rows:
        row["margin"] = round(row["margin"], 12)
    assert rows == [
        {
            "prompt": "p1",
            "chosen": "b",
            "rejected": "a",
            "chosen_reward": 0.9,
            "rejected_reward": 0.2,
            "margin": 0.7,
            "id": 1,
        },
        {
            "prompt": "p4",
            "chosen": "high",
            "rejected": "low",
            "chosen_reward": 0.3,
            "rejected_reward": 0.1,
            "margin": 0.2,
            "id": 4,
        },
        {
            "prompt": CONVERSATION,
            "chosen": "hey there",
            "rejected": "hello",
            "chosen_reward": 1.0,
            "rejected_reward": 0.0,
            "margin": 1.0,
            "id": 5,
        },
    ]
    assert stats["pairs/skipped/all_rewards_equal"] == 1  # p2
    assert stats["pairs/skipped/identical_texts"] == 1  # p3: best and worst are both "same"


def test_pairs_min_margin_and_min_chosen_reward(tmp_path):
    out = tmp_path / "pairs.jsonl"
    stats = select(tmp_path, pairs={"output_path": str(out), "min_margin": 0.5, "min_chosen_reward": 0.95})
    assert [row["prompt"] for row in read_jsonl(out)] == [CONVERSATION]
    assert stats["pairs/skipped/below_min_margin"] == 1  # p4: 0.3 - 0.1
    assert stats["pairs/skipped/below_min_chosen_reward"] == 1  # p1: 0.9


# Finish reason "length": the response reached max_new_tokens before it ended.
WITH_CUT_OFF_RESPONSES = [
    {
        "prompt": "q1",
        "responses": ["cut best", "finished worst", "finished best"],
        "finish_reasons": ["length", "stop", "stop"],
        "rewards": [0.9, 0.1, 0.6],
    },
    {"prompt": "q2", "responses": ["cut a", "cut b"], "finish_reasons": ["length", "length"], "rewards": [1.0, 0.5]},
    {
        "prompt": "q3",
        "responses": ["done", "cut high", "cut low"],
        "finish_reasons": ["stop", "length", "length"],
        "rewards": [0.5, 1.0, 0.0],
    },
    {"prompt": "q4", "responses": ["x", "y"], "rewards": [0.1, 0.2]},  # no finish_reasons: both count as finished
]


def test_best_of_n_passes_over_cut_off_responses_and_reports_them(tmp_path):
    out = tmp_path / "sft.jsonl"
    stats = select(tmp_path, WITH_CUT_OFF_RESPONSES, best_of_n={"output_path": str(out)})
    assert read_jsonl(out) == [
        {"prompt": "q1", "completion": "finished best", "reward": 0.6},  # not "cut best" (0.9)
        {"prompt": "q3", "completion": "done", "reward": 0.5},  # not "cut high" (1.0)
        {"prompt": "q4", "completion": "y", "reward": 0.2},
    ]
    assert stats == {
        "rows_read": 4,
        "truncated_responses_left_out": 5,  # 1 + 2 + 2
        "best_of_n/rows_written": 3,
        "best_of_n/skipped/all_responses_truncated": 1,  # q2
    }


def test_pairs_take_neither_side_from_cut_off_responses(tmp_path):
    out = tmp_path / "pairs.jsonl"
    stats = select(tmp_path, WITH_CUT_OFF_RESPONSES, pairs={"output_path": str(out)})
    assert [(row["prompt"], row["chosen"], row["rejected"]) for row in read_jsonl(out)] == [
        ("q1", "finished best", "finished worst"),
        ("q4", "y", "x"),
    ]
    assert stats == {
        "rows_read": 4,
        "truncated_responses_left_out": 5,
        "pairs/rows_written": 2,
        "pairs/skipped/all_responses_truncated": 1,  # q2
        "pairs/skipped/fewer_than_two_finished_responses": 1,  # q3: one finished response
    }


def test_allow_truncated_selects_cut_off_responses_like_any_other(tmp_path):
    sft, pairs = tmp_path / "sft.jsonl", tmp_path / "pairs.jsonl"
    stats = select(
        tmp_path,
        WITH_CUT_OFF_RESPONSES,
        best_of_n={"output_path": str(sft)},
        pairs={"output_path": str(pairs)},
        allow_truncated=True,
    )
    assert [row["completion"] for row in read_jsonl(sft)] == ["cut best", "cut a", "cut high", "y"]
    assert [(row["chosen"], row["rejected"]) for row in read_jsonl(pairs)] == [
        ("cut best", "finished worst"),
        ("cut a", "cut b"),
        ("cut high", "cut low"),
        ("y", "x"),
    ]
    assert stats == {"rows_read": 4, "best_of_n/rows_written": 4, "pairs/rows_written": 4}


def test_finish_reason_count_differing_from_responses_names_file_row_and_key(tmp_path):
    rows = [WITH_CUT_OFF_RESPONSES[0], {**WITH_CUT_OFF_RESPONSES[1], "finish_reasons": ["stop"]}]
    out = tmp_path / "sft.jsonl"
    with pytest.raises(RowError, match=r"scored\.jsonl, row 2, key 'finish_reasons': 1 finish reasons for 2 responses"):
        select(tmp_path, rows, best_of_n={"output_path": str(out)})
    assert not out.exists()


def test_selected_rows_load_as_sft_and_dpo_data(tmp_path, model_dir):
    sft_path, pairs_path = tmp_path / "sft.jsonl", tmp_path / "pairs.jsonl"
    select(tmp_path, best_of_n={"output_path": str(sft_path)}, pairs={"output_path": str(pairs_path)})
    tokenizer = load_tokenizer(model_dir)

    def data_config(path):
        return DataConfig(train=[str(path)], format="chat", max_length=64)

    def target_text(ids, mask):
        return tokenizer.decode([t for t, m in zip(ids, mask) if m])

    sft = build_sft_datasets(data_config(sft_path), tokenizer)
    # The tiny chat template trains on the reply and its end-of-turn token.
    assert [target_text(s.input_ids, s.loss_mask) for s in sft.train] == [
        "b<|im_end|>",
        "x<|im_end|>",
        "same<|im_end|>",
        "high<|im_end|>",
        "hey there<|im_end|>",
    ]
    assert "be brief" in tokenizer.decode(sft.train[4].input_ids)
    pairs = build_pair_datasets(data_config(pairs_path), tokenizer)
    assert [
        (target_text(p.chosen_ids, p.chosen_mask), target_text(p.rejected_ids, p.rejected_mask)) for p in pairs.train
    ] == [
        ("b<|im_end|>", "a<|im_end|>"),
        ("high<|im_end|>", "low<|im_end|>"),
        ("hey there<|im_end|>", "hello<|im_end|>"),
    ]


def test_reward_count_differing_from_responses_names_file_row_and_key(tmp_path):
    rows = [SCORED[0], {"prompt": "p", "responses": ["a", "b", "c"], "rewards": [1.0, 0.0]}]
    out = tmp_path / "sft.jsonl"
    with pytest.raises(RowError, match=r"scored\.jsonl, row 2, key 'rewards': 2 rewards for 3 responses"):
        select(tmp_path, rows, best_of_n={"output_path": str(out)})
    assert not out.exists() and not (tmp_path / "sft.jsonl.tmp").exists()


def test_non_numeric_reward_and_missing_kept_key_name_the_row(tmp_path):
    out = {"best_of_n": {"output_path": str(tmp_path / "sft.jsonl")}}
    with pytest.raises(RowError, match=r"row 1, key 'rewards\[1\]': expected a finite number, got 'high'"):
        select(tmp_path, [{"prompt": "p", "responses": ["a", "b"], "rewards": [0.0, "high"]}], **out)
    # An integer beyond the float range (JSON allows any): the row's error, not OverflowError from math.isfinite.
    with pytest.raises(RowError, match=r"row 1, key 'rewards\[0\]': expected a finite number, got 1{77}\.\.\.$"):
        select(tmp_path, [{"prompt": "p", "responses": ["a", "b"], "rewards": [int("1" * 400), 0.0]}], **out)
    with pytest.raises(RowError, match=r"row 2, key 'uid': missing key to keep"):
        select(tmp_path, [{**SCORED[0], "uid": 7}, SCORED[1]], keep_keys=["uid"], **out)


def test_select_without_an_output_is_a_config_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="nothing to write"):
        parse_config(SelectConfig, {"input_path": "scored.jsonl"})
    assert main(["select", "--input_path", str(tmp_path / "scored.jsonl")]) == 2
    assert "set best_of_n.output_path and/or pairs.output_path" in capsys.readouterr().err
