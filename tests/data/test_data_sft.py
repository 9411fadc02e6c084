"""SFT rows to samples: what is trained on, truncation, and the errors for bad rows."""

from __future__ import annotations

import json

import pytest

from raylign.config.data import DataConfig
from raylign.data import DataError, RowError, build_sft_datasets
from raylign.models.tiny import CHAT_TEMPLATE

EOS = "<|im_end|>"


def _config(path, **overrides) -> DataConfig:
    settings = {"train": [str(path)], "max_length": 256}
    settings.update(overrides)
    return DataConfig(**settings)


def _targets(tokenizer, sample) -> str:
    return tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def _target_spans(tokenizer, sample) -> list[str]:
    spans, current = [], []
    for token, flag in zip(sample.input_ids, sample.loss_mask):
        if flag:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def _only_sample(cfg, tokenizer):
    data = build_sft_datasets(cfg, tokenizer)
    assert len(data.train) == 1
    return data.train[0]


# --- what is trained on -----------------------------------------------------------------


def test_chat_prompt_tokens_are_masked_and_targets_are_the_reply_and_eos(write_dataset, tokenizer):
    path = write_dataset([{"prompt": "add 2 and 3", "completion": "the sum is 5"}])
    sample = _only_sample(_config(path), tokenizer)
    rendered = "<|im_start|>user\nadd 2 and 3<|im_end|>\n<|im_start|>assistant\nthe sum is 5<|im_end|>\n"
    assert tokenizer.decode(sample.input_ids) == rendered
    assert _targets(tokenizer, sample) == "the sum is 5" + EOS


def test_chat_row_system_key_becomes_a_system_message(write_dataset, tokenizer):
    path = write_dataset([{"system": "be brief", "prompt": "hi", "completion": "yo"}])
    sample = _only_sample(_config(path), tokenizer)
    assert tokenizer.decode(sample.input_ids).startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi")
    assert _targets(tokenizer, sample) == "yo" + EOS


def test_a_blank_system_cell_of_a_csv_is_no_system_prompt_and_a_blank_json_one_is_an_error(tmp_path, tokenizer):
    # CSV has no other way to leave an optional cell out; JSON has null and absent keys.
    path = tmp_path / "rows.csv"
    path.write_text("prompt,completion,system\nhi,yo,\nhi,yo,be brief\n")
    without, with_system = build_sft_datasets(_config(path), tokenizer).train
    assert tokenizer.decode(without.input_ids).startswith("<|im_start|>user\nhi")
    assert tokenizer.decode(with_system.input_ids).startswith("<|im_start|>system\nbe brief<|im_end|>")
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "hi", "completion": "yo", "system": ""}\n')
    with pytest.raises(RowError, match=r"rows\.jsonl, row 1, key 'system': empty text"):
        build_sft_datasets(_config(path), tokenizer)


MULTI_TURN = [
    {"role": "system", "content": "you add numbers"},
    {"role": "user", "content": "1 + 1"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "then add 3"},
    {"role": "assistant", "content": "so the total is 5"},
]


def test_multi_turn_trains_exactly_on_every_assistant_turn(write_dataset, tokenizer):
    sample = _only_sample(_config(write_dataset([{"messages": MULTI_TURN}])), tokenizer)
    assert _target_spans(tokenizer, sample) == ["2" + EOS, "so the total is 5" + EOS]


def test_template_without_generation_markers_gives_the_same_assistant_spans(write_dataset, tokenizer):
    plain_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert "{% generation %}" not in plain_template
    tok = _with_template(tokenizer, plain_template)
    sample = _only_sample(_config(write_dataset([{"messages": MULTI_TURN}])), tok)
    assert _target_spans(tok, sample) == ["2" + EOS, "so the total is 5" + EOS]


def _with_template(tokenizer, template):
    tok = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token=EOS, pad_token="<|pad|>")
    tok.chat_template = template
    return tok


def test_template_whose_prefixes_differ_is_reported_with_file_and_row(write_dataset, tokenizer):
    # The message count at the top changes with every turn, so no rendering is a prefix of the next.
    plain_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    counting = "{{ messages|length }}\n" + plain_template
    path = write_dataset([{"messages": MULTI_TURN}])
    with pytest.raises(
        RowError, match=rf"{path}, row 1, key 'messages': the tokenizer's chat template renders this conversation"
    ):
        build_sft_datasets(_config(path), _with_template(tokenizer, counting))


def test_a_conversation_opening_with_the_assistant_is_a_row_error_without_generation_markers(write_dataset, tokenizer):
    # The first turn's span would start after the rendering of no messages, which transformers
    # refuses ("Cannot apply chat template to an empty conversation": a bare error naming no row).
    plain = _with_template(tokenizer, CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    greeting = [{"role": "assistant", "content": "Hi!"}, *MULTI_TURN]
    path = write_dataset([{"messages": MULTI_TURN}, {"messages": greeting}])
    with pytest.raises(RowError, match=rf"{path}, row 2, key 'messages': the conversation starts with an assistant"):
        build_sft_datasets(_config(path), plain)
    data = build_sft_datasets(_config(path, skip_bad_rows=True), plain)
    assert [s.row for s in data.train] == [1] and data.stats.skipped == {"assistant_first": 1}
    # With generation markers the greeting is an assistant turn like the others.
    (sample,) = build_sft_datasets(_config(write_dataset([{"messages": greeting}])), tokenizer).train
    assert _target_spans(tokenizer, sample)[0] == "Hi!" + EOS


def test_skip_bad_rows_skips_a_reply_whose_start_merges_with_the_assistant_header(
    write_dataset, newline_merging_tokenizer
):
    # "\n" ending "<|im_start|>assistant\n" and the reply's first "\n" become one token in the whole
    # conversation, so this row's reply cannot be located; the other rows are fine.
    rows = [
        {"prompt": "hi", "completion": "ok"},
        {"prompt": "hi", "completion": "\nstarts with a newline"},
        {"prompt": "yo", "completion": "fine"},
    ]
    data = build_sft_datasets(_config(write_dataset(rows), skip_bad_rows=True), newline_merging_tokenizer)
    assert [s.row for s in data.train] == [1, 3]
    assert [_targets(newline_merging_tokenizer, s) for s in data.train] == ["ok" + EOS, "fine" + EOS]
    assert data.stats.skipped == {"template_mismatch": 1}


def test_tokenizer_without_chat_template_points_to_plain_format(write_dataset, tokenizer):
    path = write_dataset([{"prompt": "hi", "completion": "yo"}])
    with pytest.raises(DataError, match="the tokenizer has no chat template; set data.format to 'plain'"):
        build_sft_datasets(_config(path), _with_template(tokenizer, None))


def test_plain_format_is_template_then_output_then_eos_with_loss_on_output(write_dataset, tokenizer):
    path = write_dataset([{"prompt": "copy abc", "completion": "abc"}])
    sample = _only_sample(_config(path, format="plain", prompt_template="Q: {input}\nA: "), tokenizer)
    prompt_ids = tokenizer("Q: copy abc\nA: ")["input_ids"]
    response_ids = tokenizer("abc", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert sample.input_ids == prompt_ids + response_ids
    assert sample.loss_mask == [0] * len(prompt_ids) + [1] * len(response_ids)


def test_full_loss_trains_on_every_token_but_the_first_and_allows_documents(write_dataset, tokenizer):
    path = write_dataset([{"text": "the first step is to add"}])
    cfg = _config(path, format="plain", loss="full", prompt_template="{input}", add_eos=False)
    cfg.train[0].input_key = "text"
    sample = _only_sample(cfg, tokenizer)
    ids = tokenizer("the first step is to add")["input_ids"]
    assert sample.input_ids == ids
    assert sample.loss_mask == [0] + [1] * (len(ids) - 1)


# --- truncation -------------------------------------------------------------------------


def _plain_ids(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    prompt_ids = tokenizer(prompt + "\n")["input_ids"]
    return prompt_ids, tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_truncate_keeps_the_prompt_end_and_the_response_start(write_dataset, tokenizer):
    prompt = " ".join(f"w{i}" for i in range(40))
    response = " ".join(f"r{i}" for i in range(40))
    prompt_ids, response_ids = _plain_ids(tokenizer, prompt, response)
    assert len(prompt_ids) > 30 and len(response_ids) > 30
    path = write_dataset([{"prompt": prompt, "completion": response}])
    cfg = _config(path, format="plain", max_length=30, min_response_tokens=8, truncation="truncate")
    data = build_sft_datasets(cfg, tokenizer)
    # prompt limited to 30 - 8 = 22 tokens (its last ones); the response fills the other 8
    assert data.train[0].input_ids == prompt_ids[-22:] + response_ids[:8]
    assert data.train[0].loss_mask == [0] * 22 + [1] * 8
    assert data.stats.truncated == 1


def test_truncate_gives_a_short_prompt_whole_and_the_response_the_rest(write_dataset, tokenizer):
    response = " ".join(f"r{i}" for i in range(40))
    prompt_ids, response_ids = _plain_ids(tokenizer, "hi", response)
    path = write_dataset([{"prompt": "hi", "completion": response}])
    cfg = _config(path, format="plain", max_length=30, min_response_tokens=8, truncation="truncate")
    sample = build_sft_datasets(cfg, tokenizer).train[0]
    assert sample.input_ids == prompt_ids + response_ids[: 30 - len(prompt_ids)]


def test_drop_skips_and_counts_over_long_rows(write_dataset, tokenizer):
    rows = [{"prompt": "hi", "completion": "short"}, {"prompt": "hi", "completion": "long " * 50}]
    data = build_sft_datasets(_config(write_dataset(rows), max_length=40, truncation="drop"), tokenizer)
    assert [s.row for s in data.train] == [1]
    assert data.stats.skipped == {"too_long": 1}
    assert (data.stats.rows_read, data.stats.rows_kept) == (2, 1)


def test_over_long_row_under_error_policy_names_file_row_and_key(write_dataset, tokenizer):
    rows = [{"prompt": "hi", "completion": "short"}, {"prompt": "hi", "completion": "long " * 50}]
    path = write_dataset(rows)
    with pytest.raises(RowError) as info:
        build_sft_datasets(_config(path, max_length=40), tokenizer)
    message = str(info.value)
    assert message.startswith(f"{path}, row 2, key 'completion': ")
    assert "over data.max_length=40 (data.truncation='error'; use 'truncate' or 'drop')" in message


# --- bad rows ---------------------------------------------------------------------------

BAD_ROWS = [
    ({"prompt": "hi"}, "completion", "missing key (keys present: 'prompt')", "missing_key"),
    ({"prompt": "hi", "completion": ["a", "b"]}, "completion", "expected a string, got list: ['a', 'b']", "wrong_type"),
    ({"prompt": "   ", "completion": "x"}, "prompt", "empty text", "empty_text"),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]},
        "messages[1].role",
        "unknown role 'robot'; allowed: system, user, assistant, tool",
        "bad_role",
    ),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "no tokens to train on", "no_target"),
    # Dropped without a word before: the system prompt beside a conversation, and a tool call in a message.
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "system": "be terse"},
        "system",
        "a system prompt beside the conversation in 'messages', which would drop it: put it in the conversation "
        "as its first message (role 'system'), or remove the key",
        "unread_key",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo", "tool_calls": [{"name": "f", "arguments": {}}]},
            ]
        },
        "messages[1].tool_calls",
        "messages are trained on as role and content only, and this would be dropped: write it into the content, "
        "or remove the field",
        "unread_key",
    ),
]


def test_empty_tool_fields_of_exported_messages_are_no_loss(write_dataset, tokenizer):
    # OpenAI-style exports write tool_calls: null (or []) on every message: nothing would be dropped.
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    exported = [{**plain[0], "tool_calls": None}, {**plain[1], "tool_calls": [], "reasoning_content": ""}]
    ids = [
        build_sft_datasets(_config(write_dataset([{"messages": m}], name=n)), tokenizer).train[0].input_ids
        for n, m in (("plain", plain), ("exported", exported))
    ]
    assert ids[0] == ids[1]


CONVERSATION = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "and then?"},
    {"role": "assistant", "content": "done"},
]


def test_a_prompt_or_completion_beside_a_conversation_must_be_its_first_or_last_turn(write_dataset, tokenizer):
    # UltraChat keeps the first user turn as 'prompt' beside 'messages': no loss, the same sample as without it.
    ids = [
        build_sft_datasets(_config(write_dataset([row], name=name)), tokenizer).train[0].input_ids
        for name, row in (
            ("plain", {"messages": CONVERSATION}),
            ("ultrachat", {"prompt": " hi ", "messages": CONVERSATION}),
            ("both", {"prompt": "hi", "completion": "done", "messages": CONVERSATION}),
            # raylign select's best-of-n rows: the prompt conversation, the reply, and both as messages.
            ("selected", {"prompt": CONVERSATION[:3], "completion": "done", "messages": CONVERSATION}),
        )
    ]
    assert ids[0] == ids[1] == ids[2] == ids[3]
    # Anything else was dropped without a word: only the conversation was trained on.
    prompt_is = "the conversation before its last assistant message, nor its first user message"
    for name, row, key, turn in (
        ("later", {"prompt": "and then?", "messages": CONVERSATION}, "prompt", prompt_is),
        ("cut", {"prompt": CONVERSATION[:1], "messages": CONVERSATION}, "prompt", prompt_is),
        ("other", {"completion": "yo", "messages": CONVERSATION}, "completion", "its last assistant message"),
    ):
        path = write_dataset([row], name=name)
        with pytest.raises(RowError) as info:
            build_sft_datasets(_config(path), tokenizer)
        assert str(info.value).startswith(
            f"{path}, row 1, key '{key}': beside the conversation in 'messages', which is what is trained on, "
            f"and not {turn}"
        )
        assert info.value.reason == "different_prompts"


@pytest.mark.parametrize(("bad_row", "key", "problem", "reason"), BAD_ROWS, ids=[b[3] for b in BAD_ROWS])
def test_bad_row_error_names_file_row_and_key(write_dataset, tokenizer, bad_row, key, problem, reason):
    path = write_dataset([{"prompt": "ok", "completion": "fine"}, bad_row])
    with pytest.raises(RowError) as info:
        build_sft_datasets(_config(path), tokenizer)
    assert str(info.value).startswith(f"{path}, row 2, key '{key}': {problem}")
    assert info.value.reason == reason


def test_skip_bad_rows_counts_each_reason_and_keeps_the_good_rows(tmp_path, tokenizer):
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"prompt": "ok", "completion": "fine"})]
    lines += [json.dumps(row) for row, *_ in BAD_ROWS]
    lines += ['{"prompt": broken', json.dumps({"prompt": "again", "completion": "good"})]
    path.write_text("\n".join(lines) + "\n")
    data = build_sft_datasets(_config(path, skip_bad_rows=True), tokenizer)
    assert [s.row for s in data.train] == [1, 10]
    assert data.stats.skipped == {
        "missing_key": 1,
        "wrong_type": 1,
        "empty_text": 1,
        "bad_role": 1,
        "no_target": 1,
        "unread_key": 2,
        "bad_json": 1,
    }
    assert (data.stats.rows_read, data.stats.rows_kept) == (10, 2)
    assert data.stats.skip_examples[0].startswith(f"{path}, row 2, key 'completion': missing key")


def test_skip_bad_rows_skips_a_csv_row_with_too_many_cells(tmp_path, tokenizer):
    path = tmp_path / "rows.csv"
    path.write_text("prompt,completion\nhi,there\nbad,row,extra\nbye,now\n")
    data = build_sft_datasets(_config(path, skip_bad_rows=True), tokenizer)
    assert [s.row for s in data.train] == [1, 3]  # rows keep their numbers in the file
    assert data.stats.skipped == {"bad_csv_row": 1}


def test_a_line_that_is_not_utf8_stops_the_run_naming_file_line_and_byte(tmp_path, tokenizer):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "hi", "completion": "there"}\n{"prompt": "caf\xe9", "completion": "x"}\n')
    with pytest.raises(RowError) as info:
        build_sft_datasets(_config(path), tokenizer)
    assert str(info.value) == f"{path}, row 2: not UTF-8 text: byte 0xe9 at byte offset 15 of line 2"


def test_skip_bad_rows_skips_and_counts_lines_that_are_not_utf8(tmp_path, tokenizer):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        b"".join(
            [
                b'{"prompt": "hi", "completion": "there"}\n',
                b'{"prompt": "caf\xe9", "completion": "x"}\n',  # Latin-1
                b'{"prompt": "bye", "completion": "now"}\n',
                b'{"prompt": "\xff\xfe", "completion": "x"}\n',
                b'{"prompt": "missing completion"}\n',
                b'{"prompt": "caf\xc3\xa9", "completion": "ok"}\n',  # UTF-8
            ]
        )
    )
    data = build_sft_datasets(_config(path, skip_bad_rows=True), tokenizer)
    assert [s.row for s in data.train] == [1, 3, 6]
    assert data.stats.skipped == {"not_utf8": 2, "missing_key": 1}
    assert (data.stats.rows_read, data.stats.rows_kept) == (6, 3)
    assert data.stats.as_dict()["skipped/not_utf8"] == 2
    assert data.stats.skip_examples[:2] == [
        f"{path}, row 2: not UTF-8 text: byte 0xe9 at byte offset 15 of line 2",
        f"{path}, row 4: not UTF-8 text: byte 0xff at byte offset 12 of line 4",
    ]


def test_a_dataset_without_any_usable_row_is_an_error(write_dataset, tokenizer):
    path = write_dataset([{"prompt": "only"}])
    with pytest.raises(DataError, match=r"data\.jsonl: no usable rows \(1 read; skipped: \{'missing_key': 1\}\)"):
        build_sft_datasets(_config(path, skip_bad_rows=True), tokenizer)


# --- datasets, eval split and statistics -----------------------------------------------


def _numbered_rows(count: int, tag: str) -> list[dict[str, str]]:
    return [{"prompt": f"{tag} question {i}", "completion": f"answer {i}"} for i in range(count)]


def test_eval_fraction_holds_out_disjoint_rows_of_each_dataset(write_dataset, tokenizer):
    first = write_dataset(_numbered_rows(50, "a"), name="a")
    second = write_dataset(_numbered_rows(30, "b"), name="b")
    cfg = DataConfig(train=[str(first), str(second)], eval_fraction=0.1, max_length=64)
    data = build_sft_datasets(cfg, tokenizer)
    eval_ids = {(s.source, s.row) for s in data.eval}
    train_ids = {(s.source, s.row) for s in data.train}
    assert len(data.eval) == 5 + 3
    assert sum(s.source == str(first) for s in data.eval) == 5
    assert len(data.train) == 45 + 27
    assert not eval_ids & train_ids
    assert eval_ids | train_ids == {(str(first), r) for r in range(1, 51)} | {(str(second), r) for r in range(1, 31)}


def test_separate_eval_set_is_used_whole_and_train_untouched(write_dataset, tokenizer):
    train = write_dataset(_numbered_rows(12, "t"), name="train")
    evaluation = write_dataset(_numbered_rows(4, "e"), name="eval", fmt="parquet")
    cfg = DataConfig(train=[str(train)], eval=[str(evaluation)], max_length=64)
    data = build_sft_datasets(cfg, tokenizer)
    assert sorted(s.row for s in data.train) == list(range(1, 13))
    assert [(s.source, s.row) for s in data.eval] == [(str(evaluation), r) for r in range(1, 5)]


def test_max_samples_keeps_the_first_valid_rows(write_dataset, tokenizer):
    rows = [{"prompt": "x"}] + _numbered_rows(10, "m")
    cfg = _config(write_dataset(rows), skip_bad_rows=True)
    cfg.train[0].max_samples = 3
    data = build_sft_datasets(cfg, tokenizer)
    assert sorted(s.row for s in data.train) == [2, 3, 4]


def test_statistics_count_tokens_and_targets(write_dataset, tokenizer):
    rows = [{"prompt": "hi", "completion": "abc"}, {"prompt": "add 1", "completion": "2"}]
    data = build_sft_datasets(_config(write_dataset(rows), format="plain"), tokenizer)
    lengths = [len(tokenizer(r["prompt"] + "\n")["input_ids"]) for r in rows]
    targets = [len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) + 1 for r in rows]
    assert data.stats.tokens == sum(lengths) + sum(targets)
    assert data.stats.target_tokens == sum(targets)
    assert data.stats.as_dict()["rows_kept"] == 2


def test_statistics_read_like_a_flat_mapping_for_loggers(write_dataset, tokenizer):
    rows = [{"prompt": "hi", "completion": "abc"}, {"prompt": "hi"}]
    data = build_sft_datasets(_config(write_dataset(rows), skip_bad_rows=True), tokenizer)
    flat = dict(data.stats.items())
    assert (flat["rows_read"], flat["rows_kept"], flat["rows_skipped"], flat["skipped/missing_key"]) == (2, 1, 1, 1)
