"""Command-line values read by the field's type, bare flags, whole sections given on the command line,
and config files that give a key twice."""

from __future__ import annotations

import contextlib
import io

import pytest
import yaml

from raylign.cli.main import main
from raylign.config.base import (
    ConfigError,
    describe_fields,
    load_yaml,
    overrides_from_argv,
    parse_config,
    resolve_config,
    set_dotted,
)
from raylign.config.commands import SFTConfig
from raylign.config.pipeline import GenerateConfig
from raylign.config.rl import RLConfig

MINIMAL = {"model": {"path": "/models/tiny"}, "data": {"train": [{"path": "train.jsonl"}]}}
MINIMAL_RL = {**MINIMAL, "reward": {"sources": [{"kind": "exact_match"}]}}


def write_yaml(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def write_text(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def resolve_argv(argv, base=MINIMAL, cls=SFTConfig):
    return resolve_config(cls, None, overrides_from_argv(cls, argv), base=base)


# ---------------------------------------------------------------- text fields take the text as typed


@pytest.mark.parametrize(
    "text", ["Solve {input} # show your work", "Q: {input}", "{input}", "[draft] {input}", "- {input}"]
)
def test_text_field_takes_the_text_exactly_as_typed(text):
    cfg = resolve_argv(["--data.format", "plain", "--data.prompt_template", text])
    assert cfg.data.prompt_template == text


@pytest.mark.parametrize("text", ["lr sweep #3", "on", "2024", "~", ""])
def test_optional_text_field_takes_the_text_exactly_as_typed(text):
    cfg = resolve_argv([f"--train.logging.run_name={text}"])
    assert cfg.train.logging.run_name == text


@pytest.mark.parametrize("text", ["2024", "on", "null", "1e-5"])
def test_output_dir_that_yaml_reads_as_another_type_stays_text(text):
    cfg = resolve_argv(["--train.output_dir", text])
    assert cfg.train.output_dir == text


def test_null_unsets_an_optional_text_field_the_config_file_set(tmp_path):
    path = write_yaml(tmp_path, {**MINIMAL, "model": {"path": "/models/tiny", "tokenizer_path": "/tokenizers/t"}})
    cfg = resolve_config(SFTConfig, path, overrides_from_argv(SFTConfig, ["--model.tokenizer_path", "null"]))
    assert cfg.model.tokenizer_path is None


def test_choice_field_refuses_a_choice_followed_by_a_comment():
    with pytest.raises(ConfigError, match=r"optim\.scheduler: Input should be .*\(got 'linear # warm up first'\)"):
        resolve_argv(["--optim.scheduler", "linear # warm up first"])


def test_number_field_still_reads_the_value_as_yaml():
    cfg = resolve_argv(["--optim.betas", "[0.8, 0.95]", "--optim.lr", "1e-5"])
    assert cfg.optim.betas == (0.8, 0.95) and cfg.optim.lr == 1e-5


@pytest.mark.parametrize(("text", "expected"), [("auto", "auto"), ("4", 4)])
def test_field_of_a_number_or_a_word_reads_the_value_as_yaml(text, expected):
    cfg = resolve_argv(["--placement.threads_per_worker", text], base=MINIMAL_RL, cls=RLConfig)
    assert cfg.placement.threads_per_worker == expected


def test_field_of_a_number_or_a_word_refuses_a_word_followed_by_a_comment():
    with pytest.raises(ConfigError, match=r"placement\.threads_per_worker\.int: .*\(got 'auto # for now'\)"):
        resolve_argv(["--placement.threads_per_worker", "auto # for now"], base=MINIMAL_RL, cls=RLConfig)


def test_cli_prints_a_prompt_template_with_a_hash_as_typed(tmp_path):
    path = write_yaml(tmp_path, MINIMAL)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(
            ["sft", "--config", str(path), "--print-config", "--data.format", "plain"]
            + ["--data.prompt_template", "Solve {input} # why"]
        )
    assert code == 0
    assert yaml.safe_load(stdout.getvalue())["data"]["prompt_template"] == "Solve {input} # why"


# ---------------------------------------------------------------- a flag given without a value


def test_bare_flag_sets_a_true_false_field(tmp_path):
    path = write_yaml(tmp_path, {**MINIMAL, "data": {**MINIMAL["data"], "packing": False}})
    cfg = resolve_config(SFTConfig, path, overrides_from_argv(SFTConfig, ["--data.packing"]))
    assert cfg.data.packing is True


def test_bare_flag_sets_a_field_of_true_false_or_a_word():
    cfg = resolve_argv(["--train.early_reference"], base=MINIMAL_RL, cls=RLConfig)
    assert cfg.train.early_reference is True


def test_bare_flag_sets_a_key_of_a_free_form_mapping_to_true():
    argv = ["--agent.env_args.verbose", "--agent.env_args.retries", "3"]
    cfg = resolve_argv(argv, base={**MINIMAL_RL, "agent": {"env": "my_envs:Env"}}, cls=RLConfig)
    assert cfg.agent.env_args == {"verbose": True, "retries": 3}


def test_bare_flag_for_a_number_field_is_refused_naming_the_flag():
    with pytest.raises(ConfigError) as caught:
        resolve_argv(["--train.max_steps", "--optim.lr", "0.1"])
    assert str(caught.value) == (
        "--train.max_steps is given without a value: give one (train.max_steps takes int), "
        "as in --train.max_steps VALUE; only a true/false field may be given alone, meaning true"
    )


def test_bare_flag_for_an_unknown_field_is_named_as_unknown():
    with pytest.raises(ConfigError, match=r"\n  optim\.learning_rate: unknown field"):
        resolve_argv(["--optim.learning_rate"])


# ---------------------------------------------------------------- a whole section on the command line


def test_section_given_as_a_mapping_keeps_the_config_files_other_fields(tmp_path):
    path = write_yaml(tmp_path, {**MINIMAL, "optim": {"lr": 1e-3, "warmup_steps": 5}})
    cfg = resolve_config(SFTConfig, path, overrides_from_argv(SFTConfig, ["--optim", "{lr: 0.1}"]))
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.max_grad_norm) == (0.1, 5, 1.0)


def test_nested_section_given_as_a_mapping_is_merged_field_by_field(tmp_path):
    path = write_yaml(tmp_path, {**MINIMAL, "model": {"path": "/models/tiny", "lora": {"rank": 8, "alpha": 32.0}}})
    cfg = resolve_config(SFTConfig, path, overrides_from_argv(SFTConfig, ["--model", "{lora: {rank: 4}}"]))
    assert (cfg.model.path, cfg.model.lora.rank, cfg.model.lora.alpha) == ("/models/tiny", 4, 32.0)


# ---------------------------------------------------------------- a key given twice in a config file


def test_config_file_with_a_section_given_twice_is_refused_naming_key_and_lines(tmp_path):
    text = "model: {path: x}\ntrain:\n  max_steps: 5\ndata: {train: [t.jsonl]}\ntrain:\n  seed: 3\n"
    path = write_text(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        resolve_config(SFTConfig, path)
    assert str(caught.value) == (
        f"config file {path}: the key 'train' is given twice in one mapping, on lines 2 and 5; keep one of them"
    )


def test_config_file_with_a_field_given_twice_in_a_section_is_refused(tmp_path):
    path = write_text(tmp_path, "model: {path: x}\ndata: {train: [t.jsonl]}\noptim:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError) as caught:
        resolve_config(SFTConfig, path)
    assert str(caught.value) == (
        f"config file {path}: the key 'lr' is given twice in one mapping, on lines 4 and 5; keep one of them"
    )


def test_config_file_key_written_beside_a_yaml_merge_overrides_the_merged_value(tmp_path):
    path = write_text(tmp_path, "base: &base {lr: 0.1, warmup_steps: 3}\noptim:\n  <<: *base\n  lr: 0.2\n")
    assert load_yaml(path)["optim"] == {"lr": 0.2, "warmup_steps": 3}


# ---------------------------------------------------------------- a default section's own values


def test_a_section_given_in_part_keeps_what_its_default_sets(tmp_path):
    # RL's policy optimizer defaults to lr 1e-6 (the section's own default is 1e-5), its critic's to
    # 5e-6, its sampling to n 4: setting another field of the section, on the command line or in a
    # file, used to build the section from the class's defaults (lr 1e-5: ten times the policy's).
    argv = ["--optim.weight_decay", "0.1", "--critic.optim.weight_decay", "0.2", "--sampling.temperature", "0.7"]
    cfg = resolve_argv(["--preset", "ppo", *argv], base=MINIMAL_RL, cls=RLConfig)
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (1e-6, 0.1)
    assert (cfg.critic.optim.lr, cfg.critic.optim.weight_decay) == (5e-6, 0.2)
    assert (cfg.sampling.n, cfg.sampling.temperature) == (1, 0.7)  # ppo samples once
    assert resolve_argv(argv[4:], base=MINIMAL_RL, cls=RLConfig).sampling.n == 4
    in_file = write_yaml(tmp_path, {**MINIMAL_RL, "optim": {"warmup_steps": 3}})
    assert resolve_config(RLConfig, in_file).optim.lr == 1e-6
    # What is given still wins, and a preset's value beats the section's default (ppo samples once).
    assert resolve_argv(["--optim.lr", "3e-4"], base=MINIMAL_RL, cls=RLConfig).optim.lr == 3e-4
    ppo = resolve_argv(["--preset", "ppo", "--sampling.temperature", "0.7"], base=MINIMAL_RL, cls=RLConfig)
    assert (ppo.sampling.n, ppo.sampling.temperature) == (1, 0.7)
    generate = {"model": {"path": "/models/tiny"}, "data": {"prompts": ["p.jsonl"]}}
    sampled = resolve_argv(["--sampling.temperature", "0.7"], base=generate, cls=GenerateConfig)
    assert (sampled.sampling.n, sampled.sampling.temperature) == (4, 0.7)


def test_help_lists_the_defaults_a_run_uses():
    rows = {name: default for name, _, default, _ in describe_fields(RLConfig)}
    assert (rows["optim.lr"], rows["critic.optim.lr"], rows["sampling.n"]) == ("1e-06", "5e-06", "4")
    assert rows["optim.weight_decay"] == "0.0"
    assert {name: default for name, _, default, _ in describe_fields(GenerateConfig)}["sampling.n"] == "4"


def test_a_file_reads_numbers_in_exponent_form_as_the_command_line_does(tmp_path):
    # PyYAML (YAML 1.1) read 1e-5 and 1e3, without a dot, as text: a free-form mapping passed the string
    # "1e-5" on to the user's environment, and an integer field refused "1e3", which the command line took.
    path = write_yaml(tmp_path, {})
    path.write_text(
        yaml.safe_dump(MINIMAL_RL) + "agent:\n  env: my_envs:Env\n  env_args: {lr: 1e-5, n: 1e3, name: '1e-5'}\n"
    )
    from_file = resolve_config(RLConfig, path).agent.env_args
    argv = ["--agent.env_args.lr", "1e-5", "--agent.env_args.n", "1e3", "--agent.env_args.name", "'1e-5'"]
    base = {**MINIMAL_RL, "agent": {"env": "my_envs:Env"}}
    from_argv = resolve_argv(argv, base=base, cls=RLConfig).agent.env_args
    assert from_file == from_argv == {"lr": 1e-5, "n": 1000.0, "name": "1e-5"}
    assert load_yaml(write_yaml(tmp_path, {}, "t.yaml")) == {}
    (tmp_path / "steps.yaml").write_text("train:\n  max_steps: 1e3\n")
    assert load_yaml(tmp_path / "steps.yaml") == {"train": {"max_steps": 1000.0}}


@pytest.mark.parametrize("field", ["model.lora.rank", "train.epochs", "engine.zero_stage", "train.max_steps"])
def test_true_or_false_where_a_number_belongs_is_refused(field):
    # pydantic reads them as 1 and 0: --model.lora.rank true trained an adapter of rank 1.
    with pytest.raises(ConfigError, match=rf"{field}: Value error, expected a number, not a boolean"):
        resolve_argv([f"--{field}", "true"])
    with pytest.raises(ConfigError, match=rf"{field}: Value error, expected a number, not a boolean"):
        parse_config(SFTConfig, _nested(field, False, MINIMAL), "a file")


def _nested(dotted, value, base):
    data = yaml.safe_load(yaml.safe_dump(base))
    set_dotted(data, dotted, value)
    return data


def test_numbers_and_booleans_still_go_where_they_belong():
    cfg = resolve_argv(["--optim.warmup_steps", "0", "--model.gradient_checkpointing", "false"])
    assert cfg.optim.warmup_steps == 0 and cfg.model.gradient_checkpointing is False
    rl = resolve_argv(["--train.early_reference", "false"], base=MINIMAL_RL, cls=RLConfig)  # bool | "auto"
    assert rl.train.early_reference is False
