"""Reward config validation, build_reward, and the weighted sum with per-source metrics."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from raylign.config.base import ConfigError, parse_config, to_yaml
from raylign.config.reward import RewardConfig
from raylign.rollout.rewards import (
    CombinedReward,
    ExactMatchReward,
    FormatReward,
    MathReward,
    RewardError,
    WeightedSource,
    build_reward,
)

PROMPTS = ["2 + 2?", "3 * 3?", "10 - 4?"]
RESPONSES = ["<think>add</think> \\boxed{4}", "it is \\boxed{6}", "<think>subtract</think> 6"]
LABELS = ["4", "9", "6"]


def test_weighted_sum_of_builtin_sources_equals_hand_computation():
    combined = CombinedReward(
        [
            WeightedSource("math", 1.0, MathReward()),
            WeightedSource("format", 0.5, FormatReward(r"<think>.*?</think>.*")),
            WeightedSource("exact", -2.0, ExactMatchReward()),
        ]
    )
    result = combined.score(PROMPTS, RESPONSES, LABELS)
    # math: [1, 0, 1]; format: [1, 0, 1]; exact match of the whole response: [0, 0, 0]
    assert result.rewards == [1.5, 0.0, 1.5]
    assert result.metrics["math"] == [1.0, 0.0, 1.0]
    assert result.metrics["format"] == [1.0, 0.0, 1.0]
    assert result.metrics["exact"] == [0.0, 0.0, 0.0]
    assert result.metrics["math/answer_found"] == [1.0, 1.0, 1.0]


def test_build_reward_from_config_with_a_python_file(tmp_path):
    reward_file = tmp_path / "lengths.py"
    reward_file.write_text(
        textwrap.dedent("""
        def reward_func(prompts, responses, labels, **metadata):
            return {"rewards": [len(r) for r in responses], "doubled": [2 * len(r) for r in responses]}
    """)
    )
    cfg = parse_config(
        RewardConfig,
        {
            "sources": [
                {"kind": "function", "path": str(reward_file), "weight": 0.1},
                {"kind": "math", "weight": 3.0},
                {"kind": "math", "weight": 0.0},  # reported, not counted
            ]
        },
    )
    with build_reward(cfg) as reward:
        result = reward.score(PROMPTS, RESPONSES, LABELS)
    lengths = [len(r) for r in RESPONSES]  # 28, 15, 25
    expected = [0.1 * n + 3.0 * m for n, m in zip(lengths, [1.0, 0.0, 1.0])]
    assert result.rewards == pytest.approx(expected)
    assert result.metrics["function"] == [float(n) for n in lengths]
    assert result.metrics["function/doubled"] == [2.0 * n for n in lengths]
    assert result.metrics["math"] == result.metrics["math_2"] == [1.0, 0.0, 1.0]


def test_failing_source_is_named_in_the_error():
    combined = CombinedReward([WeightedSource("answer", 1.0, MathReward())])
    with pytest.raises(RewardError, match=r"reward source 'answer': math reward: sample 1 \(prompt '3 \* 3\?'\)"):
        combined.score(PROMPTS, RESPONSES, ["4", None, "6"])


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"kind": "function"}, r"kind 'function' needs path"),
        ({"kind": "http", "url": "ftp://x"}, r"url: Value error, must start with http:// or https://"),
        ({"kind": "math", "url": "http://x"}, r"url not used by kind 'math'"),
        ({"kind": "format", "format_regex": "(unclosed"}, r"format_regex: Value error, not a valid regular expression"),
        ({"kind": "function", "path": "r.py", "num_workers": 0}, r"num_workers: Input should be greater than or equal"),
        ({"kind": "http", "url": "http://x", "timeout_s": 0}, r"timeout_s: Input should be greater than 0"),
        ({"kind": "votes"}, r"kind: Input should be 'function', 'reward_model', 'http', 'math'"),
    ],
)
def test_bad_source_config_names_the_field(source, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(RewardConfig, {"sources": [source]})


def test_config_round_trips_through_yaml():
    cfg = parse_config(
        RewardConfig,
        {
            "sources": [
                {"kind": "http", "url": "http://127.0.0.1:8000/score", "max_retries": 5, "weight": 0.5},
                {"kind": "format", "format_regex": "<answer>.*</answer>"},
            ]
        },
    )
    again = parse_config(RewardConfig, yaml.safe_load(to_yaml(cfg)))
    assert again == cfg


def test_empty_or_duplicate_names_are_rejected():
    with pytest.raises(ConfigError, match=r"sources: List should have at least 1 item"):
        parse_config(RewardConfig, {"sources": []})
    with pytest.raises(ConfigError, match=r"source names must be unique; repeated: a"):
        parse_config(RewardConfig, {"sources": [{"kind": "math", "name": "a"}, {"kind": "format", "name": "a"}]})
    # A name with '/' could log over another source's metric: 'math/answer_found' beside a math source.
    with pytest.raises(ConfigError, match=r"sources\.1\.name: String should match pattern"):
        parse_config(RewardConfig, {"sources": [{"kind": "math"}, {"kind": "format", "name": "math/answer_found"}]})


def test_default_names_number_repeated_kinds_around_explicit_names():
    cfg = parse_config(
        RewardConfig,
        {
            "sources": [
                {"kind": "math"},
                {"kind": "math", "name": "math_2"},
                {"kind": "math"},
                {"kind": "format"},
            ]
        },
    )
    assert cfg.source_names() == ["math", "math_2", "math_3", "format"]


def test_api_key_from_environment(monkeypatch):
    cfg = parse_config(
        RewardConfig, {"sources": [{"kind": "http", "url": "http://127.0.0.1:1/score", "api_key_env": "MY_RM_KEY"}]}
    )
    monkeypatch.setenv("MY_RM_KEY", "from-env")
    assert cfg.sources[0].resolved_api_key() == "from-env"
    monkeypatch.delenv("MY_RM_KEY")
    with pytest.raises(ValueError, match="MY_RM_KEY, but that environment variable is not set"):
        cfg.sources[0].resolved_api_key()


def test_every_reward_and_serve_rm_field_is_described():
    from raylign.cli.serve_rm import ServeRMConfig
    from raylign.config.base import describe_fields

    undocumented = [row[0] for cls in (RewardConfig, ServeRMConfig) for row in describe_fields(cls) if not row[3]]
    assert undocumented == []


def _nan_file(tmp_path):
    path = tmp_path / "sometimes_nan.py"
    path.write_text(
        textwrap.dedent("""
        import math

        def reward_func(prompts, responses, labels, **metadata):
            return [math.nan if r.endswith("6") else 1.0 for r in responses]
    """)
    )
    return path


def test_a_nan_reward_is_an_error_naming_the_sample_by_default(tmp_path):
    cfg = parse_config(RewardConfig, {"sources": [{"kind": "function", "path": str(_nan_file(tmp_path))}]})
    assert cfg.non_finite == "error"
    with build_reward(cfg) as reward, pytest.raises(RewardError, match=r"sample 2 .*'10 - 4\?'.* not a finite number"):
        reward.score(PROMPTS, RESPONSES, LABELS)


def test_with_non_finite_drop_every_source_passes_nan_through(tmp_path):
    import math

    cfg = parse_config(
        RewardConfig,
        {
            "non_finite": "drop",
            "sources": [{"kind": "function", "path": str(_nan_file(tmp_path))}, {"kind": "math", "weight": 2.0}],
        },
    )
    with build_reward(cfg) as reward:
        assert reward.keep_non_finite and all(item.source.keep_non_finite for item in reward.sources)
        result = reward.score(PROMPTS, RESPONSES, LABELS)
    # function: [1, 1, nan] (only the third response ends in "6"); math: [1, 0, 1]
    assert result.rewards[:2] == [3.0, 1.0] and math.isnan(result.rewards[2])
    assert math.isnan(result.metrics["function"][2]) and result.metrics["math"] == [1.0, 0.0, 1.0]
