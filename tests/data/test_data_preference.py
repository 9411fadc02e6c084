"""Preference-pair rows to samples: the shared prompt, what is scored, truncation, batching and bad rows."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from raylign.config.data import DataConfig
from raylign.data import RowError
from raylign.data.preference import build_pair_datasets, collate_pairs
from raylign.models.tiny import CHAT_TEMPLATE

EOS = "<|im_end|>"


def _config(path, **overrides) -> DataConfig:
    settings = {"train": [str(path)], "max_length": 256}
    settings.update(overrides)
    return DataConfig(**settings)


def _only_pair(cfg, tokenizer, **kwargs):
    data = build_pair_datasets(cfg, tokenizer, **kwargs)
    assert len(data.train) == 1
    return data.train[0]


def _scored(tokenizer, ids, mask) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def _chat(tokenizer, messages, **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


# --- what each side holds ---------------------------------------------------------------


def test_chat_pair_shares_the_prompt_and_scores_each_reply_with_its_end_of_turn(write_dataset, tokenizer):
    path = write_dataset([{"prompt": "pick a letter", "chosen": "a a", "rejected": "b c"}])
    pair = _only_pair(_config(path), tokenizer)
    user = [{"role": "user", "content": "pick a letter"}]
    assert pair.prompt_ids == _chat(tokenizer, user, add_generation_prompt=True)
    sides = (("a a", pair.chosen_ids, pair.chosen_mask), ("b c", pair.rejected_ids, pair.rejected_mask))
    for reply, ids, mask in sides:
        whole = _chat(tokenizer, user + [{"role": "assistant", "content": reply}])
        assert pair.prompt_ids + ids == whole
        assert _scored(tokenizer, ids, mask) == reply + EOS
        assert tokenizer.decode(ids) == reply + EOS + "\n"  # the template's newline is kept, not scored


def test_plain_pair_is_template_then_reply_then_eos_all_scored(write_dataset, tokenizer):
    path = write_dataset([{"prompt": "copy abc", "chosen": "abc", "rejected": "cba"}])
    pair = _only_pair(_config(path, format="plain", prompt_template="Q: {input}\nA: "), tokenizer)
    assert pair.prompt_ids == tokenizer("Q: copy abc\nA: ")["input_ids"]
    assert pair.chosen_ids == tokenizer("abc", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert pair.rejected_ids == tokenizer("cba", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert pair.chosen_mask == [1] * len(pair.chosen_ids)
    assert pair.rejected_mask == [1] * len(pair.rejected_ids)


def test_prompt_may_be_a_conversation_with_a_system_message(write_dataset, tokenizer):
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    pair = _only_pair(
        _config(write_dataset([{"prompt": prompt, "chosen": "yo", "rejected": "hello there"}])), tokenizer
    )
    assert pair.prompt_ids == _chat(tokenizer, prompt, add_generation_prompt=True)
    assert _scored(tokenizer, pair.chosen_ids, pair.chosen_mask) == "yo" + EOS


def test_whole_conversations_split_at_the_final_reply_without_a_prompt_key(write_dataset, tokenizer):
    turns = [
        {"role": "user", "content": "1 + 1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "add 3"},
    ]
    row = {
        "chosen": turns + [{"role": "assistant", "content": "5"}],
        "rejected": turns + [{"role": "assistant", "content": "6"}],
    }
    pair = _only_pair(_config(write_dataset([row])), tokenizer)
    assert pair.prompt_ids == _chat(tokenizer, turns, add_generation_prompt=True)
    # the earlier assistant turn belongs to the prompt and is not scored
    assert _scored(tokenizer, pair.chosen_ids, pair.chosen_mask) == "5" + EOS
    assert _scored(tokenizer, pair.rejected_ids, pair.rejected_mask) == "6" + EOS


def test_a_prompt_beside_whole_conversations_must_be_their_prompt(write_dataset, tokenizer):
    # ultrafeedback_binarized keeps the prompt text beside whole conversations: the same pair as without it.
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 + 1"}]
    row = {
        "chosen": turns + [{"role": "assistant", "content": "2"}],
        "rejected": turns + [{"role": "assistant", "content": "3"}],
    }
    plain = _only_pair(_config(write_dataset([row], name="plain")), tokenizer)
    for prompt in ("1 + 1", turns):
        pair = _only_pair(_config(write_dataset([{**row, "prompt": prompt}], name="with_prompt")), tokenizer)
        assert (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids) == (
            plain.prompt_ids,
            plain.chosen_ids,
            plain.rejected_ids,
        )
    # Another prompt would be dropped without a word: the conversations' own is trained on.
    for prompt in ("What is 2+2?", turns[1:]):
        path = write_dataset([{**row, "prompt": prompt}], name="other_prompt")
        with pytest.raises(RowError) as info:
            build_pair_datasets(_config(path), tokenizer)
        assert str(info.value) == (
            f"{path}, row 1, key 'prompt': differs from the prompt of the whole conversations in 'chosen'/'rejected', "
            "which is what would be trained on: remove it, or give the replies only"
        )
        assert info.value.reason == "different_prompts"


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": [{"role": "user", "content": "hi"}], "system": "be brief", "chosen": "yo", "rejected": "no"},
        {
            "system": "be brief",
            "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}],
        },
    ],
)
def test_a_system_prompt_beside_a_conversation_is_refused_not_dropped(write_dataset, tokenizer, row):
    path = write_dataset([row])
    with pytest.raises(
        RowError, match=rf"{path}, row 1, key 'system': a system prompt beside the conversation"
    ) as info:
        build_pair_datasets(_config(path), tokenizer)
    assert info.value.reason == "unread_key"


def test_keys_and_margin_come_from_the_dataset_spec(write_dataset, tokenizer):
    path = write_dataset([{"q": "hi", "good": "yo", "bad": "no", "m": 2}])
    cfg = _config(path)
    cfg.train[0].input_key, cfg.train[0].chosen_key, cfg.train[0].rejected_key = "q", "good", "bad"
    pair = _only_pair(cfg, tokenizer, margin_key="m")
    assert _scored(tokenizer, pair.chosen_ids, pair.chosen_mask) == "yo" + EOS
    assert _scored(tokenizer, pair.rejected_ids, pair.rejected_mask) == "no" + EOS
    assert pair.margin == 2.0


# --- bad rows ---------------------------------------------------------------------------

GOOD = {"prompt": "hi", "chosen": "yo", "rejected": "no"}


@pytest.mark.parametrize(
    "bad_row, key, problem, reason",
    [
        (
            {"prompt": "hi", "chosen": "same", "rejected": "same"},
            "rejected",
            "'chosen' and 'rejected' are identical",
            "identical_pair",
        ),
        ({"chosen": "yo", "rejected": "no"}, "prompt", "missing key", "missing_key"),
        ({"prompt": "hi", "rejected": "no"}, "chosen", "missing key", "missing_key"),
        ({"prompt": "hi", "chosen": "yo"}, "rejected", "missing key", "missing_key"),
        ({"prompt": "hi", "chosen": "  ", "rejected": "no"}, "chosen", "empty text", "empty_text"),
        ({"prompt": "", "chosen": "yo", "rejected": "no"}, "prompt", "empty text", "empty_text"),
        ({"prompt": "hi", "chosen": 3, "rejected": "no"}, "chosen", "expected a string", "wrong_type"),
        (
            {"prompt": "hi", "chosen": [{"role": "assistant", "content": ""}], "rejected": "no"},
            "chosen[0].content",
            "empty text",
            "empty_text",
        ),
        (
            {
                "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
                "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}],
            },
            "rejected",
            "different prompts",
            "different_prompts",
        ),
        (
            {
                "prompt": "a",
                "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
                "rejected": "y",
            },
            "rejected",
            "'chosen' is a whole conversation but 'rejected' is only a reply",
            "different_prompts",
        ),
    ],
)
def test_bad_pair_is_an_error_naming_file_row_and_key(write_dataset, tokenizer, bad_row, key, problem, reason):
    path = write_dataset([GOOD, bad_row])
    with pytest.raises(RowError, match=rf"{path}, row 2, key '{re.escape(key)}': .*{problem}") as info:
        build_pair_datasets(_config(path), tokenizer)
    assert info.value.reason == reason


def test_identical_pair_in_plain_format_is_also_an_error(write_dataset, tokenizer):
    path = write_dataset([{"prompt": "hi", "chosen": "same", "rejected": "same"}])
    with pytest.raises(RowError, match=rf"{path}, row 1, key 'rejected': 'chosen' and 'rejected' are identical"):
        build_pair_datasets(_config(path, format="plain"), tokenizer)


def test_conversation_in_plain_format_points_to_chat_format(write_dataset, tokenizer):
    path = write_dataset([{"prompt": "hi", "chosen": [{"role": "assistant", "content": "yo"}], "rejected": "no"}])
    with pytest.raises(RowError, match=r"row 1, key 'chosen': a conversation .* needs data.format 'chat'"):
        build_pair_datasets(_config(path, format="plain"), tokenizer)


@pytest.mark.parametrize(
    "margin, problem",
    [(None, "null value"), ("big", "expected a finite number"), (float("nan"), "expected a finite number")],
)
def test_margin_must_be_a_number_on_every_row(write_dataset, tokenizer, margin, problem):
    path = write_dataset([{**GOOD, "margin": 1.5}, {**GOOD, "margin": margin}])
    with pytest.raises(RowError, match=rf"row 2, key 'margin': {problem}"):
        build_pair_datasets(_config(path), tokenizer, margin_key="margin")


def test_a_csv_file_gives_its_margins_as_text(write_dataset, tokenizer):
    # CSV cells are all text: "1.5" is the number 1.5 there (in JSON it would be a string, refused).
    path = write_dataset([{**GOOD, "margin": 1.5}, {**GOOD, "margin": -2}], fmt="csv")
    data = build_pair_datasets(_config(path), tokenizer, margin_key="margin")
    assert [s.margin for s in data.train] == [1.5, -2.0]
    bad = write_dataset([{**GOOD, "margin": "big"}], fmt="csv", name="big")
    with pytest.raises(RowError, match=r"big\.csv, row 1, key 'margin': expected a finite number"):
        build_pair_datasets(_config(bad), tokenizer, margin_key="margin")


def test_skip_bad_rows_keeps_the_good_pairs_and_counts_each_reason(write_dataset, tokenizer):
    rows = [
        GOOD,
        {"prompt": "hi", "chosen": "x", "rejected": "x"},
        {"prompt": "hi", "chosen": "yo"},
        {**GOOD, "prompt": "hey"},
        {"prompt": "hi", "chosen": "", "rejected": "no"},
    ]
    data = build_pair_datasets(_config(write_dataset(rows), skip_bad_rows=True), tokenizer)
    assert [p.row for p in data.train] == [1, 4]
    assert data.stats.skipped == {"identical_pair": 1, "missing_key": 1, "empty_text": 1}
    assert (data.stats.rows_read, data.stats.rows_kept) == (5, 2)


@pytest.mark.parametrize("generation_markers", [False, True])
def test_skip_bad_rows_skips_a_pair_whose_reply_start_merges_with_the_assistant_header(
    write_dataset, newline_merging_tokenizer, generation_markers
):
    # The chosen reply's first "\n" merges with the "\n" ending the generation prompt (see the fixture).
    tokenizer = copy.deepcopy(newline_merging_tokenizer)
    if generation_markers:
        tokenizer.chat_template = CHAT_TEMPLATE
    rows = [GOOD, {"prompt": "hi", "chosen": "\nyes", "rejected": "no"}, {**GOOD, "prompt": "hey"}]
    data = build_pair_datasets(_config(write_dataset(rows), skip_bad_rows=True), tokenizer)
    assert [p.row for p in data.train] == [1, 3]
    assert data.stats.skipped == {"template_mismatch": 1}


# --- length policy ----------------------------------------------------------------------


def _plain_parts(tokenizer, prompt, reply):
    return tokenizer(prompt + "\n")["input_ids"], tokenizer(reply, add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]


def test_truncate_cuts_one_shared_prompt_and_each_reply_to_fit(write_dataset, tokenizer):
    prompt = " ".join(f"w{i}" for i in range(40))
    long_reply, short_reply = " ".join(f"r{i}" for i in range(40)), "ok"
    prompt_ids, long_ids = _plain_parts(tokenizer, prompt, long_reply)
    _, short_ids = _plain_parts(tokenizer, prompt, short_reply)
    path = write_dataset([{"prompt": prompt, "chosen": short_reply, "rejected": long_reply}])
    cfg = _config(path, format="plain", max_length=30, min_response_tokens=8, truncation="truncate")
    data = build_pair_datasets(cfg, tokenizer)
    pair = data.train[0]
    # the longest reply claims min_response_tokens = 8, so the prompt keeps its last 22 tokens on both sides
    assert pair.prompt_ids == prompt_ids[-22:]
    assert pair.rejected_ids == long_ids[:8]
    assert pair.chosen_ids == short_ids
    assert pair.truncated and data.stats.truncated == 1


def test_drop_skips_and_counts_pairs_with_an_over_long_side(write_dataset, tokenizer):
    rows = [GOOD, {"prompt": "hi", "chosen": "ok", "rejected": "long " * 50}]
    data = build_pair_datasets(_config(write_dataset(rows), max_length=40, truncation="drop"), tokenizer)
    assert [p.row for p in data.train] == [1]
    assert data.stats.skipped == {"too_long": 1}


def test_over_long_pair_under_error_policy_names_the_row_and_the_long_side(write_dataset, tokenizer):
    path = write_dataset([GOOD, {"prompt": "hi", "chosen": "ok", "rejected": "long " * 50}])
    with pytest.raises(RowError, match=rf"{path}, row 2, key 'rejected': \d+ tokens .*over data.max_length=40"):
        build_pair_datasets(_config(path, max_length=40), tokenizer)


def test_pair_that_truncation_makes_identical_is_an_error(write_dataset, tokenizer):
    same_start = " ".join(f"r{i}" for i in range(30))
    path = write_dataset([{"prompt": "hi", "chosen": same_start + " yes", "rejected": same_start + " no"}])
    cfg = _config(path, format="plain", max_length=12, min_response_tokens=8, truncation="truncate")
    with pytest.raises(RowError, match="row 1, key 'rejected': .*identical after truncation"):
        build_pair_datasets(cfg, tokenizer)


def test_eval_fraction_holds_out_pairs_never_trained_on(write_dataset, tokenizer):
    rows = [{"prompt": f"p{i}", "chosen": "yes", "rejected": "no"} for i in range(20)]
    data = build_pair_datasets(_config(write_dataset(rows), eval_fraction=0.25), tokenizer)
    assert len(data.eval) == 5 and len(data.train) == 15
    assert not {p.row for p in data.eval} & {p.row for p in data.train}


# --- batching ---------------------------------------------------------------------------


def _two_pairs(write_dataset, tokenizer):
    rows = [
        {"prompt": "hi", "chosen": "a", "rejected": "b c d", "m": 1.0},
        {"prompt": "hello there", "chosen": "e f", "rejected": "g", "m": 0.5},
    ]
    return build_pair_datasets(_config(write_dataset(rows), format="plain"), tokenizer, margin_key="m").train


def test_padded_batch_holds_every_chosen_side_then_every_rejected_side(write_dataset, tokenizer):
    pairs = _two_pairs(write_dataset, tokenizer)
    batch = collate_pairs(pairs, pad_token_id=tokenizer.pad_token_id, packed=False)
    expected = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    for row, ids in enumerate(expected):
        n = len(ids)
        assert batch["input_ids"][row, :n].tolist() == ids
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
    masks = [[0] * len(p.prompt_ids) + p.chosen_mask for p in pairs] + [
        [0] * len(p.prompt_ids) + p.rejected_mask for p in pairs
    ]
    assert batch["response_lengths"].tolist() == [sum(m) for m in masks]
    assert batch["margin"].tolist() == [1.0, 0.5]


def test_packed_batch_holds_the_same_sequences_at_their_starts(write_dataset, tokenizer):
    pairs = _two_pairs(write_dataset, tokenizer)
    batch = collate_pairs(pairs, pad_token_id=tokenizer.pad_token_id, packed=True)
    expected = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    assert batch["seq_lens"].tolist() == [len(ids) for ids in expected]
    flat_ids, flat_positions = batch["input_ids"].flatten().tolist(), batch["position_ids"].flatten().tolist()
    for ids, start in zip(expected, batch["seq_starts"].tolist(), strict=True):
        assert flat_ids[start : start + len(ids)] == ids
        assert flat_positions[start : start + len(ids)] == list(range(len(ids)))
    assert "attention_mask" not in batch
    assert torch.equal(batch["loss_mask"].sum(), batch["response_lengths"].sum())
