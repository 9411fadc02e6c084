"""The pipeline commands' configs: help text, shorthands and keys the commands reserve."""

from __future__ import annotations

import pytest

from raylign.cli.main import help_option, main
from raylign.config.base import ConfigError, describe_fields, parse_config
from raylign.config.pipeline import GenerateConfig, ScoreConfig, SelectConfig


@pytest.mark.parametrize("name, cls", [("generate", GenerateConfig), ("score", ScoreConfig), ("select", SelectConfig)])
def test_help_describes_every_field(name, cls, capsys):
    assert main([name, "--help"]) == 0
    text = capsys.readouterr().out
    for dotted, type_text, _, description in describe_fields(cls):
        if type_text != "section":
            assert description, f"{dotted} has no description"
            assert f"{help_option(dotted)}  (" in text


def test_generate_defaults_to_vllm_with_four_samples_and_accepts_one_prompt_path():
    cfg = parse_config(GenerateConfig, {"model": {"path": "m"}, "data": {"prompts": "p.jsonl"}})
    assert cfg.rollout.engine == "vllm"
    assert cfg.sampling.n == 4
    assert [spec.path for spec in cfg.data.prompts] == ["p.jsonl"]


def test_generate_rejects_passthrough_keys_it_writes_itself():
    with pytest.raises(ConfigError, match=r"data.passthrough_keys: .*\['responses'\] are written by raylign generate"):
        parse_config(
            GenerateConfig,
            {"model": {"path": "m"}, "data": {"prompts": ["p.jsonl"], "passthrough_keys": ["id", "responses"]}},
        )


def test_generate_rejects_a_template_without_input():
    with pytest.raises(ConfigError, match=r"data.prompt_template: .*must contain the field \{input\}"):
        parse_config(
            GenerateConfig,
            {"model": {"path": "m"}, "data": {"prompts": ["p.jsonl"], "prompt_template": "Q: {question}"}},
        )


@pytest.mark.parametrize(
    ("rollout", "ray", "error"),
    [
        ({"max_staleness": 1, "verify_every": 5}, {}, r"rollout.verify_every, rollout.max_staleness: for raylign rl"),
        ({"max_engine_restarts": 9}, {}, r"rollout.max_engine_restarts: for raylign rl's weight syncs"),
        ({"num_engines": 4}, {"num_cpus": 1}, r"ray.num_cpus \(1\) is below the 4 CPU slots"),
    ],
)
def test_generate_refuses_settings_it_would_ignore_or_wait_on_forever(rollout, ray, error):
    # Accepted before: generate loads its weights once and has no engine restarts; with fewer CPUs than
    # its engines reserve, they waited ray.startup_timeout_s (600 s) before it failed.
    data = {"model": {"path": "m"}, "data": {"prompts": "p.jsonl"}, "rollout": rollout, "ray": ray}
    with pytest.raises(ConfigError, match=error):
        parse_config(GenerateConfig, data)
    del data["rollout"], data["ray"]
    assert parse_config(GenerateConfig, data).rollout.max_staleness == 0


def test_score_needs_reward_sources():
    with pytest.raises(ConfigError, match="reward: Field required"):
        parse_config(ScoreConfig, {"input_path": "g.jsonl"})


def test_select_rejects_keep_keys_it_writes_itself():
    with pytest.raises(ConfigError, match=r"keep_keys: .*\['completion'\] are written by raylign select"):
        parse_config(SelectConfig, {"best_of_n": {"output_path": "s.jsonl"}, "keep_keys": ["completion"]})
