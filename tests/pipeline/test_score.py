"""raylign score: rewards of a hand-written generations file equal hand-computed values."""

from __future__ import annotations

import json
import textwrap

import pytest

from raylign.config.base import parse_config
from raylign.config.pipeline import ScoreConfig
from raylign.data import RowError
from raylign.pipeline.score import run_score
from raylign.rollout.rewards import RewardError

from .helpers import read_jsonl, write_jsonl

GENERATIONS = [
    {
        "prompt": "reverse: a b",
        "prompt_text": "<user>reverse: a b</user>",
        "responses": ["b a", " b  a ", "a b"],
        "finish_reasons": ["stop", "stop", "stop"],
        "label": "b a",
        "difficulty": 2,
    },
    {"prompt": "copy: c", "responses": ["c", "C"], "label": "c", "difficulty": 3},
]

# Reward per response: (letters without surrounding blanks) x the row's difficulty; the prompt
# it saw is reported as a metric.
REWARD_FILE = """
def reward_func(prompts, responses, labels, difficulty, **metadata):
    return {"rewards": [len(r.strip()) * d for r, d in zip(responses, difficulty)],
            "prompt_chars": [len(p) for p in prompts]}
"""


def score(tmp_path, rows, sources, **extra):
    cfg = parse_config(
        ScoreConfig,
        {
            "input_path": str(write_jsonl(tmp_path / "generations.jsonl", rows)),
            "output_path": str(tmp_path / "scored.jsonl"),
            "reward": {"sources": sources},
            "progress_bar": False,
            **extra,
        },
    )
    return run_score(cfg)


def test_exact_match_rewards_follow_whitespace_normalised_equality(tmp_path):
    metrics = score(tmp_path, GENERATIONS, [{"kind": "exact_match"}])
    rows = read_jsonl(tmp_path / "scored.jsonl")
    # "b a" and " b  a " equal the label after whitespace normalisation; "a b" and "C" do not.
    assert [row["rewards"] for row in rows] == [[1.0, 1.0, 0.0], [1.0, 0.0]]
    assert [row["reward_metrics"] for row in rows] == [{"exact_match": [1.0, 1.0, 0.0]}, {"exact_match": [1.0, 0.0]}]
    assert [{k: v for k, v in row.items() if k not in ("rewards", "reward_metrics")} for row in rows] == GENERATIONS
    assert metrics["reward/mean"] == pytest.approx(3 / 5)
    assert metrics["reward/best_of_n_mean"] == pytest.approx(1.0)
    assert json.loads((tmp_path / "scored.metrics.json").read_text()) == metrics


def test_python_file_and_exact_match_combine_by_weight(tmp_path):
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(textwrap.dedent(REWARD_FILE))
    sources = [{"kind": "exact_match"}, {"kind": "function", "name": "length", "path": str(reward_file), "weight": 0.5}]
    metrics = score(tmp_path, GENERATIONS, sources, metrics_path=str(tmp_path / "summary.json"))
    rows = read_jsonl(tmp_path / "scored.jsonl")
    # length: len("b a")*2 = 6, len("b  a")*2 = 8, len("a b")*2 = 6; len("c")*3 = 3, len("C")*3 = 3.
    # combined = exact + 0.5 * length.
    assert [row["rewards"] for row in rows] == [[4.0, 5.0, 3.0], [2.5, 1.5]]
    assert rows[0]["reward_metrics"] == {
        "exact_match": [1.0, 1.0, 0.0],
        "length": [6.0, 8.0, 6.0],
        "length/prompt_chars": [25.0, 25.0, 25.0],
    }  # the rendered prompt_text
    assert rows[1]["reward_metrics"] == {
        "exact_match": [1.0, 0.0],
        "length": [3.0, 3.0],
        "length/prompt_chars": [7.0, 7.0],
    }  # no prompt_text: "copy: c"
    assert metrics["reward/mean"] == pytest.approx(16 / 5)
    assert metrics["length/mean"] == pytest.approx(26 / 5)
    assert metrics["exact_match/mean"] == pytest.approx(3 / 5)
    assert metrics["reward/best_of_n_mean"] == pytest.approx((5.0 + 2.5) / 2)
    assert json.loads((tmp_path / "summary.json").read_text()) == metrics


def test_non_finite_drop_leaves_the_row_out_and_counts_it(tmp_path):
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(
        "import math\n"
        "def reward_func(prompts, responses, labels, **metadata):\n"
        "    return [math.nan if r == 'C' else 1.0 for r in responses]\n"
    )
    sources = [{"kind": "function", "path": str(reward_file)}]
    metrics = score(tmp_path, GENERATIONS, sources, reward={"sources": sources, "non_finite": "drop"})
    rows = read_jsonl(tmp_path / "scored.jsonl")
    # The second row's "C" scores NaN: that row is left out; the first row's three responses score 1.
    assert [row["prompt"] for row in rows] == ["reverse: a b"]
    assert rows[0]["rewards"] == [1.0, 1.0, 1.0]
    assert (metrics["rows"], metrics["responses"], metrics["non_finite_rows"]) == (1, 3, 1)
    assert metrics["reward/mean"] == 1.0 and metrics["reward/std"] == 0.0


def test_row_without_responses_names_file_row_and_key(tmp_path):
    rows = [GENERATIONS[0], {"prompt": "copy: c", "label": "c"}]
    with pytest.raises(RowError, match=r"generations\.jsonl, row 2, key 'responses': missing key"):
        score(tmp_path, rows, [{"kind": "exact_match"}])
    assert not (tmp_path / "scored.jsonl").exists()


def test_response_that_is_not_text_names_its_position(tmp_path):
    rows = [{"prompt": "p", "responses": ["a", 3], "label": "a"}]
    with pytest.raises(RowError, match=r"row 1, key 'responses\[1\]': expected a string, got int"):
        score(tmp_path, rows, [{"kind": "exact_match"}])


def test_a_failing_reward_source_names_the_file_and_rows(tmp_path):
    rows = [GENERATIONS[0], {"prompt": "copy: c", "responses": ["c"]}]  # no label to compare with
    with pytest.raises(RewardError, match=r"generations\.jsonl, rows 1-2 .*sample 3 .*has no label"):
        score(tmp_path, rows, [{"kind": "exact_match"}])
    assert not (tmp_path / "scored.jsonl").exists()


def test_conversation_prompts_reach_reward_functions_as_messages(tmp_path):
    reward_file = tmp_path / "turns.py"
    reward_file.write_text(
        textwrap.dedent("""
        def reward_func(prompts, responses, labels, prompt_messages, **metadata):
            return {"rewards": [float(len(m)) for m in prompt_messages],
                    "prompt_is_last_turn": [float(p == m[-1]["content"]) for p, m in zip(prompts, prompt_messages)]}
    """)
    )
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    score(
        tmp_path,
        [{"prompt": conversation, "responses": ["hello"]}],
        [{"kind": "function", "name": "turns", "path": str(reward_file)}],
    )
    (row,) = read_jsonl(tmp_path / "scored.jsonl")
    assert row["rewards"] == [2.0]
    assert row["reward_metrics"]["turns/prompt_is_last_turn"] == [1.0]


def test_reward_functions_get_the_data_source_as_in_rl(tmp_path):
    """Every sample has a ``source``, as in ``raylign rl``: the row's own ``source`` field, else its ``data_source``
    (what ``raylign generate`` copies from the prompt row), else the name of the file without its suffix."""
    reward_file = tmp_path / "by_source.py"
    reward_file.write_text(
        "def reward_func(prompts, responses, labels, source):\n"
        "    return [{'gsm8k': 1.0, 'generations': 2.0, 'set_b': 3.0}[s] for s in source]\n"
    )
    rows = [
        {"prompt": "a", "responses": ["x"], "data_source": "gsm8k"},
        {"prompt": "b", "responses": ["y", "z"]},  # no field naming its source: the file's name, generations
        {"prompt": "c", "responses": ["w"], "data_source": "gsm8k", "source": "set_b"},
    ]
    score(tmp_path, rows, [{"kind": "function", "path": str(reward_file)}])
    assert [row["rewards"] for row in read_jsonl(tmp_path / "scored.jsonl")] == [[1.0], [2.0, 2.0], [3.0]]
