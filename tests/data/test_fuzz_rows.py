"""Fuzzed dataset rows and files for every dataset kind: a row is accepted as a well-formed sample, or refused
with the data layer's error naming the file, the row and (where it is about one) the key.

Nothing else may escape: no TypeError or OverflowError from a tokenizer or from ``float()``, no
sample without targets. Rows are written to a real ``.jsonl`` file and read through the same
loaders the trainers use. Below the fuzz tests, plain examples pin the exact message for the
inputs that need particular care (lone surrogates, huge or deeply nested JSON, bytes that are
not UTF-8, numbers beyond the float range, single-token documents, replies opening with a tool turn).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raylign.config.data import DataConfig
from raylign.config.prm import PRMSection
from raylign.data import ALLOWED_ROLES, DataError, RowError
from raylign.data.kto import load_kto_samples
from raylign.data.preference import load_pair_samples
from raylign.data.prm import add_step_separator, load_prm_samples
from raylign.data.rows import DataStats
from raylign.data.sft import load_sft_samples
from raylign.models.tiny import build_tiny_tokenizer
from tests.fuzz_cases import FUZZ, JSON_VALUES, TEXT, count_case

SEP = "<|step|>"
MAX_LENGTH = 48


@pytest.fixture(scope="module")
def prm_tokenizer():
    """A tokenizer of its own: adding the step separator must not leak into other tests' tokenizer."""
    tokenizer = build_tiny_tokenizer()
    add_step_separator(tokenizer, SEP)
    return tokenizer


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """One file path, rewritten by every generated case."""
    return tmp_path_factory.mktemp("fuzz_rows") / "rows.jsonl"


# ---------------------------------------------------------------- strategies

WORDS = st.text(st.sampled_from("abcdefgh xyz 0123456789+=."), min_size=1, max_size=24).filter(str.strip)
LONG_WORDS = st.text(st.sampled_from("abcdefgh xyz 0123456789"), min_size=40, max_size=150).filter(str.strip)
ROLES = st.sampled_from(ALLOWED_ROLES) | st.sampled_from(["bot", "User", "", "assistant ", "human"]) | JSON_VALUES
MESSAGE = st.fixed_dictionaries({}, optional={"role": ROLES, "content": WORDS | TEXT | JSON_VALUES}) | JSON_VALUES
LABEL = st.booleans() | st.sampled_from(["+", "-", "\u2212", 0, 1, 0.5, 2, -0.0, 10**400]) | JSON_VALUES
JUNK = st.one_of(
    TEXT,
    JSON_VALUES,
    st.lists(MESSAGE, max_size=4),
    st.lists(WORDS | TEXT, max_size=4),
    st.lists(LABEL, max_size=4),
    LABEL,
)


def turns(roles: tuple[str, ...], min_size: int = 1) -> st.SearchStrategy[list[dict[str, str]]]:
    message = st.fixed_dictionaries({"role": st.sampled_from(roles), "content": WORDS | LONG_WORDS})
    return st.lists(message, min_size=min_size, max_size=3)


CONVERSATION = st.builds(lambda head, reply: head + reply, turns(ALLOWED_ROLES, 0), turns(("assistant",)))
PROMPT_TURNS = st.builds(lambda head, last: head + last, turns(ALLOWED_ROLES, 0), turns(("user",)))
ASSISTANT_REPLY = st.builds(lambda first, rest: first + rest, turns(("assistant",)), turns(("assistant", "tool"), 0))
REPLY = WORDS | LONG_WORDS | ASSISTANT_REPLY


@st.composite
def good_pair(draw: st.DrawFn) -> dict[str, Any]:
    """A prompt with two replies, or two whole conversations with the same prompt turns."""
    if draw(st.booleans()):
        chosen = draw(REPLY)
        rejected = draw(REPLY.filter(lambda reply: reply != chosen))
        row = {"prompt": draw(WORDS | PROMPT_TURNS), "chosen": chosen, "rejected": rejected}
    else:
        head, chosen = draw(PROMPT_TURNS), draw(turns(("assistant",)))
        rejected = draw(turns(("assistant",)).filter(lambda reply: reply != chosen))
        row = {"chosen": head + chosen, "rejected": head + rejected}
    return row | draw(st.fixed_dictionaries({}, optional={"system": WORDS}))


@st.composite
def good_steps(draw: st.DrawFn) -> dict[str, Any]:
    steps = draw(st.lists(WORDS | LONG_WORDS, min_size=1, max_size=4))
    labels = st.booleans() | st.sampled_from([0, 1, 0.25, "+", "-", "\u2212"])
    return {
        "prompt": draw(WORDS | LONG_WORDS),
        "steps": steps,
        "labels": draw(st.lists(labels, min_size=len(steps), max_size=len(steps))),
    }


PROMPT_COMPLETION = st.fixed_dictionaries(
    {"prompt": WORDS | LONG_WORDS, "completion": WORDS | LONG_WORDS}, optional={"system": WORDS}
)
# A good row of each dataset kind, and every key its rows use.
GOOD_ROWS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "sft": PROMPT_COMPLETION | st.fixed_dictionaries({"messages": CONVERSATION}),
    "kto": st.builds(lambda row, label: row | {"label": label}, PROMPT_COMPLETION, st.booleans()),
    "pairs": st.builds(
        lambda row, margin: row | {"margin": margin}, good_pair(), st.floats(-5, 5, allow_subnormal=False)
    ),
    "prm": good_steps(),
}
ROW_KEYS = {
    "sft": {"prompt", "completion", "system", "messages"},
    "kto": {"prompt", "completion", "system", "label"},
    "pairs": {"prompt", "chosen", "rejected", "system", "margin"},
    "prm": {"prompt", "steps", "labels"},
}


@st.composite
def rows(draw: st.DrawFn, kind: str) -> Any:
    """A good row of ``kind``, or one with a key or more made junk or removed, stray keys added; or not an object."""
    mode = draw(st.sampled_from(["good", "one_spoiled", "one_spoiled", "junk", "not_an_object"]))
    if mode == "not_an_object":
        return draw(JSON_VALUES)
    row = draw(GOOD_ROWS[kind])
    keys = sorted(ROW_KEYS[kind])
    spoiled = {"good": [], "one_spoiled": [draw(st.sampled_from(keys))], "junk": keys}[mode]
    for key in spoiled:
        choice = draw(st.sampled_from(["keep", "junk", "junk", "absent"]))
        if choice == "junk":
            row[key] = draw(JUNK)
        elif choice == "absent":
            row.pop(key, None)
    return row | draw(st.dictionaries(st.text(max_size=6).filter(lambda k: k not in keys), JSON_VALUES, max_size=2))


def data_configs(
    path: Path, formats: tuple[str, ...] = ("chat", "plain"), losses: tuple[str, ...] = ("prompt_masked",)
):
    return st.builds(
        lambda fmt, truncation, loss, add_eos, template: DataConfig(
            train=[str(path)],
            format=fmt,
            truncation=truncation,
            loss=loss,
            # plain-format settings (chat refuses them given a value)
            **({"add_eos": add_eos, "prompt_template": template} if fmt == "plain" else {}),
            max_length=MAX_LENGTH,
            **({"min_response_tokens": 4} if truncation == "truncate" else {}),  # read only when truncating
        ),
        st.sampled_from(formats),
        st.sampled_from(["error", "truncate", "drop"]),
        st.sampled_from(losses),
        st.booleans(),
        st.sampled_from(["{input}\n", "{input}", "Q: {input} A:"]),
    )


# ---------------------------------------------------------------- checks


def write_one_row(path: Path, row: Any) -> None:
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")


def load_or_refuse(load: Callable[[], list[Any]], path: Path, kind: str) -> list[Any] | None:
    """The samples, or None after checking that the refusal names the file, row 1 and a key of ``kind``."""
    try:
        return load()
    except RowError as err:
        assert err.source == str(path) and err.row == 1, str(err)
        assert str(err).startswith(f"{path}, row 1"), str(err)
        if err.key is not None:
            top_key = re.match(r"[^\[.]+", err.key)
            assert top_key is not None and top_key.group(0) in ROW_KEYS[kind], str(err)
            assert f"key '{err.key}'" in str(err)
        return None
    except DataError as err:
        assert str(path) in str(err), str(err)
        return None


def assert_token_ids(ids: list[int], vocab_size: int) -> None:
    assert ids and all(type(t) is int and 0 <= t < vocab_size for t in ids), ids


def assert_mask(mask: list[int], length: int) -> None:
    assert len(mask) == length and set(mask) <= {0, 1}, mask


def assert_sequence_sample(sample: Any, vocab_size: int, path: Path) -> None:
    """An SFT or KTO sample: ids, a 0/1 mask of the same length with a target, the first token never one."""
    assert_token_ids(sample.input_ids, vocab_size)
    assert_mask(sample.loss_mask, len(sample.input_ids))
    assert len(sample.input_ids) <= MAX_LENGTH
    assert sample.loss_mask[0] == 0 and any(sample.loss_mask)
    assert (sample.source, sample.row) == (str(path), 1)


# ---------------------------------------------------------------- one row, every dataset kind


@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_fuzzed_sft_row_is_a_well_formed_sample_or_names_file_row_and_key(data, tokenizer, data_file):
    count_case("data rows: sft")
    row = data.draw(rows("sft"))
    cfg = data.draw(data_configs(data_file, losses=("prompt_masked", "full")))
    write_one_row(data_file, row)
    samples = load_or_refuse(lambda: load_sft_samples(cfg.train[0], cfg, tokenizer, DataStats()), data_file, "sft")
    if samples is not None:
        count_case("data rows: sft (accepted)")
        (sample,) = samples
        assert_sequence_sample(sample, len(tokenizer), data_file)


@settings(FUZZ, max_examples=50)
@given(data=st.data())
def test_fuzzed_kto_row_is_a_well_formed_sample_or_names_file_row_and_key(data, tokenizer, data_file):
    count_case("data rows: kto")
    row = data.draw(rows("kto"))
    cfg = data.draw(data_configs(data_file))
    write_one_row(data_file, row)
    samples = load_or_refuse(lambda: load_kto_samples(cfg.train[0], cfg, tokenizer, DataStats()), data_file, "kto")
    if samples is not None:
        count_case("data rows: kto (accepted)")
        (sample,) = samples
        assert_sequence_sample(sample, len(tokenizer), data_file)
        assert sample.desirable is row["label"]


def assert_side(ids: list[int], mask: list[int], vocab_size: int) -> None:
    assert_token_ids(ids, vocab_size)
    assert_mask(mask, len(ids))
    assert any(mask)


@settings(FUZZ, max_examples=80)
@given(data=st.data(), with_margin=st.booleans())
def test_fuzzed_preference_row_is_a_well_formed_pair_or_names_file_row_and_key(data, with_margin, tokenizer, data_file):
    count_case("data rows: preference pairs")
    row = data.draw(rows("pairs"))
    cfg = data.draw(data_configs(data_file))
    margin_key = "margin" if with_margin else None
    write_one_row(data_file, row)
    samples = load_or_refuse(
        lambda: load_pair_samples(cfg.train[0], cfg, tokenizer, DataStats(), margin_key), data_file, "pairs"
    )
    if samples is None:
        return
    count_case("data rows: preference pairs (accepted)")
    (pair,) = samples
    assert_token_ids(pair.prompt_ids, len(tokenizer))
    assert_side(pair.chosen_ids, pair.chosen_mask, len(tokenizer))
    assert_side(pair.rejected_ids, pair.rejected_mask, len(tokenizer))
    assert pair.chosen_ids != pair.rejected_ids
    assert len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids)) <= MAX_LENGTH
    assert pair.margin == (float(row["margin"]) if with_margin else None)


@settings(FUZZ, max_examples=60)
@given(data=st.data(), label_type=st.sampled_from(["hard", "soft"]))
def test_fuzzed_prm_row_is_a_well_formed_sample_or_names_file_row_and_key(data, label_type, prm_tokenizer, data_file):
    count_case("data rows: prm")
    row = data.draw(rows("prm"))
    cfg = data.draw(data_configs(data_file))
    prm = PRMSection(step_separator=SEP, label_type=label_type)
    separator_id = prm_tokenizer.convert_tokens_to_ids(SEP)
    write_one_row(data_file, row)
    samples = load_or_refuse(
        lambda: load_prm_samples(cfg.train[0], cfg, prm, prm_tokenizer, separator_id, DataStats()), data_file, "prm"
    )
    if samples is None:
        return
    count_case("data rows: prm (accepted)")
    (sample,) = samples
    assert_token_ids(sample.input_ids, len(prm_tokenizer))
    assert_mask(sample.loss_mask, len(sample.input_ids))
    assert len(sample.input_ids) <= MAX_LENGTH
    separators = [t for t, flag in zip(sample.input_ids, sample.loss_mask) if flag]
    assert separators == [separator_id] * len(sample.step_labels) and sample.step_labels
    assert sample.input_ids[-1] == separator_id
    allowed = {0.0, 1.0} if label_type == "hard" else None
    assert all(0.0 <= v <= 1.0 and (allowed is None or v in allowed) for v in sample.step_labels)


# ---------------------------------------------------------------- whole files with broken lines

GOOD_ROW = {"prompt": "add 2 and 3", "completion": "the sum is 5"}
GOOD_LINE = json.dumps(GOOD_ROW)


@st.composite
def broken_lines(draw: st.DrawFn) -> tuple[str, bytes]:
    """(kind, line without its newline): a good row, a blank line, or one of the ways a line goes bad."""
    kind = draw(
        st.sampled_from(
            ["good", "good", "blank", "cut_json", "junk", "not_object", "bad_row", "huge_int", "deep", "not_utf8"]
        )
    )
    if kind == "good":
        text = GOOD_LINE
    elif kind == "blank":
        text = draw(st.sampled_from(["", " ", "\t", " \t "]))
    elif kind == "cut_json":
        text = GOOD_LINE[: draw(st.integers(1, len(GOOD_LINE) - 1))]
    elif kind == "junk":
        text = "#" + draw(st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=20))
    elif kind == "not_object":
        text = json.dumps(draw(JSON_VALUES.filter(lambda v: not isinstance(v, dict))))
    elif kind == "bad_row":
        not_text = JSON_VALUES.filter(lambda v: not isinstance(v, str))
        text = json.dumps({"prompt": draw(not_text), "completion": "x"} if draw(st.booleans()) else {"prompt": "x"})
    elif kind == "huge_int":
        text = '{"prompt": "x", "completion": ' + "9" * draw(st.integers(4301, 6000)) + "}"
    elif kind == "deep":
        depth = draw(st.integers(2000, 6000))
        text = '{"prompt": ' + "[" * depth + "]" * depth + ', "completion": "x"}'
    else:
        return kind, b'{"prompt": "caf\xe9", "completion": "x"}'  # Latin-1, not UTF-8
    return kind, text.encode("utf-8")


def first_problem_line(kinds: list[str]) -> tuple[int, str] | None:
    """(1-based line number, kind) of the first line that is neither good nor blank."""
    for number, kind in enumerate(kinds, start=1):
        if kind not in ("good", "blank"):
            return number, kind
    return None


def sft_config(path: Path, skip_bad_rows: bool) -> DataConfig:
    return DataConfig(train=[str(path)], format="plain", max_length=MAX_LENGTH, skip_bad_rows=skip_bad_rows)


@settings(FUZZ, max_examples=60)
@given(lines=st.lists(broken_lines(), min_size=1, max_size=8), skip_bad_rows=st.booleans())
def test_fuzzed_jsonl_file_stops_at_or_skips_exactly_its_bad_lines(lines, skip_bad_rows, tokenizer, data_file):
    count_case("data files: jsonl with broken lines")
    kinds = [kind for kind, _ in lines]
    data_file.write_bytes(b"".join(line + b"\n" for _, line in lines))
    cfg = sft_config(data_file, skip_bad_rows)
    good_lines = [n for n, kind in enumerate(kinds, start=1) if kind == "good"]
    problem = first_problem_line(kinds)
    stats = DataStats()
    if (problem is not None and not skip_bad_rows) or not good_lines:
        with pytest.raises(DataError) as caught:
            load_sft_samples(cfg.train[0], cfg, tokenizer, stats)
        message = str(caught.value)
        if problem is not None and not skip_bad_rows:
            assert isinstance(caught.value, RowError) and caught.value.row == problem[0], message
            assert message.startswith(f"{data_file}, row {problem[0]}"), message
        else:
            assert message.startswith(f"{data_file}: no usable rows"), message
        return
    samples = load_sft_samples(cfg.train[0], cfg, tokenizer, stats)
    assert [s.row for s in samples] == good_lines
    bad_lines = len(kinds) - len(good_lines) - kinds.count("blank")
    assert stats.rows_read == len(good_lines) + bad_lines
    assert sum(stats.skipped.values()) == bad_lines


@settings(FUZZ, max_examples=40)
@given(items=st.lists(st.just(GOOD_ROW) | JSON_VALUES, min_size=1, max_size=6) | JSON_VALUES)
def test_fuzzed_json_list_file_names_the_file_and_the_bad_item(items, tokenizer, data_file):
    count_case("data files: json list")
    path = data_file.with_name("rows.json")
    path.write_text(json.dumps(items), encoding="utf-8")
    cfg = sft_config(path, skip_bad_rows=False)
    try:
        samples = load_sft_samples(cfg.train[0], cfg, tokenizer, DataStats())
    except RowError as err:
        assert isinstance(items, list)
        first_bad = next(n for n, item in enumerate(items, start=1) if item != GOOD_ROW)
        assert err.row == first_bad and str(err).startswith(f"{path}, row {first_bad}"), str(err)
        return
    except DataError as err:
        assert str(err).startswith(f"{path}"), str(err)
        return
    assert isinstance(items, list) and all(item == GOOD_ROW for item in items)
    assert [s.row for s in samples] == list(range(1, len(items) + 1))


# ---------------------------------------------------------------- examples that need particular care


def test_lone_surrogate_in_a_text_names_the_key_instead_of_failing_in_the_tokenizer(write_dataset, tokenizer):
    path = write_dataset([{"prompt": "caf\ud800", "completion": "ok"}])  # json.dumps writes it as "\ud800"
    cfg = sft_config(path, skip_bad_rows=False)
    with pytest.raises(RowError) as caught:
        load_sft_samples(cfg.train[0], cfg, tokenizer, DataStats())
    assert (
        str(caught.value)
        == f"{path}, row 1, key 'prompt': not valid Unicode text: lone surrogate U+D800 at character 3"
    )
    assert caught.value.reason == "bad_unicode"


def test_lone_surrogate_in_a_message_names_the_message(write_dataset, tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\udfff"}]
    path = write_dataset([{"messages": messages}])
    cfg = DataConfig(train=[str(path)], max_length=MAX_LENGTH)
    with pytest.raises(RowError, match=r"row 1, key 'messages\[1\]\.content': not valid Unicode text"):
        load_sft_samples(cfg.train[0], cfg, tokenizer, DataStats())


def test_jsonl_integer_with_too_many_digits_is_a_bad_line_not_a_bare_value_error(tmp_path, tokenizer):
    path = tmp_path / "digits.jsonl"
    path.write_text(json.dumps(GOOD_ROW) + '\n{"prompt": "x", "completion": ' + "9" * 5000 + "}\n")
    cfg = sft_config(path, skip_bad_rows=False)
    with pytest.raises(RowError) as caught:
        load_sft_samples(cfg.train[0], cfg, tokenizer, DataStats())
    assert str(caught.value).startswith(f"{path}, row 2: line 2 is not usable JSON: Exceeds the limit (4300 digits)")
    assert caught.value.reason == "bad_json"


def test_jsonl_line_nested_too_deeply_is_a_bad_line_and_is_skipped_on_request(tmp_path, tokenizer):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}\n" + json.dumps(GOOD_ROW) + "\n")
    cfg = sft_config(path, skip_bad_rows=False)
    with pytest.raises(RowError, match=r"row 1: line 1 is not usable JSON: nested too deeply$"):
        load_sft_samples(cfg.train[0], cfg, tokenizer, DataStats())
    stats = DataStats()
    samples = load_sft_samples(cfg.train[0], sft_config(path, skip_bad_rows=True), tokenizer, stats)
    assert [s.row for s in samples] == [2] and stats.skipped == {"bad_json": 1}


def test_jsonl_byte_that_is_not_utf8_is_reported_on_its_own_line_after_the_rows_before_it(tmp_path):
    from raylign.data.readers import read_rows

    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a": 3}\n{"a": "caf\xe9"}\n')
    rows_read = []
    with pytest.raises(RowError) as caught:
        rows_read.extend(read_rows(path))
    assert str(caught.value) == f"{path}, row 4: not UTF-8 text: byte 0xe9 at byte offset 10 of line 4"
    assert caught.value.reason == "not_utf8"
    assert rows_read == [(1, {"a": 1}), (2, {"a": 2}), (3, {"a": 3})]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[" + "9" * 5000 + "]", "not usable JSON: Exceeds the limit (4300 digits)"),
        ("[" * 5000 + "]" * 5000, "not usable JSON: nested too deeply"),
    ],
)
def test_json_file_that_python_cannot_load_names_the_file(tmp_path, tokenizer, text, problem):
    path = tmp_path / "data.json"
    path.write_text(text)
    cfg = sft_config(path, skip_bad_rows=False)
    with pytest.raises(DataError) as caught:
        load_sft_samples(cfg.train[0], cfg, tokenizer, DataStats())
    assert str(caught.value).startswith(f"{path}: {problem}")


def test_margin_beyond_the_float_range_names_the_key(write_dataset, tokenizer):
    path = write_dataset([{"prompt": "p", "chosen": "a", "rejected": "b", "margin": 10**400}])
    cfg = DataConfig(train=[str(path)], format="plain", max_length=MAX_LENGTH)
    with pytest.raises(RowError) as caught:
        load_pair_samples(cfg.train[0], cfg, tokenizer, DataStats(), margin_key="margin")
    assert str(caught.value).startswith(f"{path}, row 1, key 'margin': expected a finite number (the pair's margin)")


def test_soft_step_label_beyond_the_float_range_names_the_label(write_dataset, prm_tokenizer):
    path = write_dataset([{"prompt": "p", "steps": ["1+1=2"], "labels": [10**400]}])
    cfg = DataConfig(train=[str(path)], format="plain", max_length=MAX_LENGTH)
    prm = PRMSection(step_separator=SEP, label_type="soft")
    separator_id = prm_tokenizer.convert_tokens_to_ids(SEP)
    with pytest.raises(RowError) as caught:
        load_prm_samples(cfg.train[0], cfg, prm, prm_tokenizer, separator_id, DataStats())
    assert str(caught.value).startswith(f"{path}, row 1, key 'labels[0]': bad soft step label 1000")
    assert caught.value.reason == "bad_label"


def test_single_token_document_is_refused_rather_than_kept_without_targets(write_dataset, tokenizer):
    assert len(tokenizer("a", add_special_tokens=True)["input_ids"]) == 1
    path = write_dataset([{"prompt": "a"}])
    cfg = DataConfig(
        train=[str(path)],
        format="plain",
        loss="full",
        add_eos=False,
        prompt_template="{input}",
        max_length=MAX_LENGTH,
    )
    with pytest.raises(RowError) as caught:
        load_sft_samples(cfg.train[0], cfg, tokenizer, DataStats())
    assert str(caught.value) == (
        f"{path}, row 1, key 'completion': no tokens to train on: the only target is the "
        "first token, which nothing predicts"
    )


def test_reply_that_starts_with_a_tool_message_names_the_key(write_dataset, tokenizer):
    tool_first = [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "it is 42"}]
    path = write_dataset([{"prompt": "p", "chosen": tool_first, "rejected": "no idea"}])
    cfg = DataConfig(train=[str(path)], max_length=MAX_LENGTH)
    with pytest.raises(RowError) as caught:
        load_pair_samples(cfg.train[0], cfg, tokenizer, DataStats())
    assert str(caught.value) == (
        f"{path}, row 1, key 'chosen': the reply starts with a 'tool' message; a reply starts with an assistant message"
    )
