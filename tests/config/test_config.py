"""Config: YAML round trip, precedence, and errors that name the field and what is allowed."""

from __future__ import annotations

import re

import pytest
import yaml

from raylign.config.base import ConfigError, overrides_from_argv, parse_config, resolve_config, to_yaml
from raylign.config.commands import SFTConfig

MINIMAL = {"model": {"path": "/models/tiny"}, "data": {"train": [{"path": "train.jsonl"}]}}


def write_yaml(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_yaml_to_object_to_yaml_round_trip(tmp_path):
    data = {**MINIMAL, "optim": {"lr": 2.5e-4, "scheduler": "linear"}, "train": {"max_steps": 7}}
    cfg = resolve_config(SFTConfig, write_yaml(tmp_path, data))
    again = resolve_config(SFTConfig, write_yaml(tmp_path, yaml.safe_load(to_yaml(cfg)), "again.yaml"))
    assert again == cfg
    assert cfg.optim.lr == 2.5e-4 and cfg.optim.scheduler == "linear" and cfg.train.max_steps == 7


def test_precedence_defaults_then_yaml_then_command_line(tmp_path):
    path = write_yaml(tmp_path, {**MINIMAL, "optim": {"lr": 1e-3, "warmup_steps": 5}})
    cfg = resolve_config(SFTConfig, path, overrides_from_argv(SFTConfig, ["--optim.lr", "3e-4"]))
    assert cfg.optim.lr == 3e-4  # command line beats YAML
    assert cfg.optim.warmup_steps == 5  # YAML beats default
    assert cfg.optim.max_grad_norm == 1.0  # default kept


def test_preset_base_is_lowest_precedence(tmp_path):
    path = write_yaml(tmp_path, {**MINIMAL, "optim": {"lr": 1e-3}})
    cfg = resolve_config(SFTConfig, path, {}, base={"optim": {"lr": 9.0, "warmup_steps": 3}})
    assert cfg.optim.lr == 1e-3 and cfg.optim.warmup_steps == 3


def test_command_line_values_are_typed_like_yaml():
    # Keys of no field: read as YAML reads them (validation then names them as unknown).
    argv = ["--a.lr", "1e-5", "--b=true", "--c", "[1, 2]", "--flag", "--d", "text"]
    parsed = overrides_from_argv(SFTConfig, argv)
    assert parsed == {"a.lr": 1e-5, "b": True, "c": [1, 2], "flag": True, "d": "text"}


def test_command_line_values_are_read_like_yaml_by_the_fields_type(tmp_path):
    path = write_yaml(tmp_path, MINIMAL)
    argv = [
        "--optim.lr",
        "1e-5",
        "--data.packing=false",
        "--optim.max_grad_norm",
        "0.5",
        "--data.train",
        "[{path: b.jsonl}]",
    ]
    cfg = resolve_config(SFTConfig, path, overrides_from_argv(SFTConfig, argv))
    assert (cfg.optim.lr, cfg.data.packing, cfg.optim.max_grad_norm) == (1e-5, False, 0.5)
    assert [str(d.path) for d in cfg.data.train] == ["b.jsonl"]


def test_unknown_key_names_its_path():
    with pytest.raises(ConfigError, match=r"optim\.learning_rate: unknown field"):
        parse_config(SFTConfig, {**MINIMAL, "optim": {"learning_rate": 1e-5}})


def test_wrong_type_names_path_and_value():
    with pytest.raises(ConfigError, match=r"train\.max_steps: .*integer.*'many'"):
        parse_config(SFTConfig, {**MINIMAL, "train": {"max_steps": "many"}})


def test_out_of_range_names_path_and_bound():
    with pytest.raises(ConfigError, match=r"optim\.lr: Input should be greater than 0"):
        parse_config(SFTConfig, {**MINIMAL, "optim": {"lr": -1.0}})


def test_choice_error_lists_what_is_allowed():
    with pytest.raises(ConfigError, match=r"engine\.backend: .*'local', 'fsdp2' or 'deepspeed'"):
        parse_config(SFTConfig, {**MINIMAL, "engine": {"backend": "megatron"}})


def test_batch_sizes_that_do_not_divide_fail_naming_both_fields():
    with pytest.raises(ConfigError, match=r"train\.global_batch_size \(10\).*train\.micro_batch_size \(4\)"):
        parse_config(SFTConfig, {**MINIMAL, "train": {"global_batch_size": 10, "micro_batch_size": 4}})


def test_missing_required_section_is_named():
    with pytest.raises(ConfigError, match=r"model: Field required"):
        parse_config(SFTConfig, {"data": MINIMAL["data"]})


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        resolve_config(SFTConfig, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        resolve_config(SFTConfig, bad)


def _trained_commands() -> list[str]:
    from raylign.cli.main import COMMANDS

    return [name for name, c in COMMANDS.items() if {"engine", "optim"} <= set(c.config_cls().model_fields)]


def test_every_command_that_trains_is_checked():
    assert set(_trained_commands()) == {"sft", "rm", "prm", "dpo", "kto", "kd", "rl"}


@pytest.mark.parametrize("name", _trained_commands())
def test_deepspeed_without_master_weights_or_offloading_parameters_below_zero3_is_refused_at_the_config(name):
    """Each was found only once the engine started (in rl, after Ray and every worker had started)."""
    from raylign.cli.main import COMMANDS

    cls = COMMANDS[name].config_cls()
    data: dict = {"model": {"path": "m"}, "data": {"train": ["x.jsonl"]}, "engine": {"backend": "deepspeed"}}
    data |= {"teacher": {"path": "t"}} if name == "kd" else {}
    data |= {"reward": {"sources": [{"kind": "exact_match"}]}} if name == "rl" else {}
    with pytest.raises(ConfigError, match="optim.master_weights: false needs engine.backend 'local' or 'fsdp2'"):
        parse_config(cls, {**data, "optim": {"master_weights": False}})
    with pytest.raises(ConfigError, match=r"engine.offload_params needs engine.zero_stage 3 .* \(got 2\)"):
        parse_config(cls, {**data, "engine": {"backend": "deepspeed", "zero_stage": 2, "offload_params": True}})
    parse_config(cls, {**data, "engine": {"backend": "deepspeed", "zero_stage": 3, "offload_params": True}})
    parse_config(cls, {**data, "engine": {"backend": "fsdp2"}, "optim": {"master_weights": False}})


def test_rl_checks_the_critics_optimizer_too():
    from raylign.config.rl import RLConfig

    data = {"preset": "ppo", "model": {"path": "m"}, "data": {"train": ["x.jsonl"]}, "engine": {"backend": "deepspeed"}}
    data["reward"] = {"sources": [{"kind": "exact_match"}]}
    with pytest.raises(ConfigError, match="critic.optim.master_weights: false needs engine.backend"):
        parse_config(RLConfig, {**data, "critic": {"optim": {"master_weights": False}}})


@pytest.mark.parametrize(
    ("name", "key", "reads"),
    [
        ("sft", "chosen_key", "input_key, output_key, messages_key, system_key"),
        ("kd", "label_key", "input_key, output_key, messages_key, system_key"),
        ("rm", "output_key", "input_key, chosen_key, rejected_key, system_key"),
        ("dpo", "messages_key", "input_key, chosen_key, rejected_key, system_key"),
        ("kto", "rejected_key", "input_key, output_key, label_key, system_key"),
        ("prm", "system_key", "input_key (and prm.steps_key, prm.labels_key)"),
    ],
)
def test_a_dataset_key_the_command_does_not_read_is_refused(name, key, reads):
    # Each was accepted and did nothing: sft reads no chosen_key, dpo no messages_key.
    from raylign.cli.main import COMMANDS

    cls = COMMANDS[name].config_cls()
    data: dict = {"model": {"path": "m"}} | ({"teacher": {"path": "t"}} if name == "kd" else {})
    spec = {"path": "x.jsonl", key: "answer"}
    with pytest.raises(ConfigError, match=rf"data\.train\.0: {name} does not read {key}; it reads {re.escape(reads)}"):
        parse_config(cls, {**data, "data": {"train": [spec]}})
    with pytest.raises(ConfigError, match=rf"data\.eval\.0: {name} does not read {key}"):
        parse_config(cls, {**data, "data": {"train": ["x.jsonl"], "eval": [spec]}})
    taken = parse_config(cls, {**data, "data": {"train": [{"path": "x.jsonl", "input_key": "q"}]}})  # read by all
    assert taken.data.train[0].input_key == "q"


@pytest.mark.parametrize("name", ["sft", "rm", "prm", "dpo", "kto", "kd"])
def test_eval_every_without_anything_to_evaluate_is_refused(name):
    # It evaluated nothing: OfflineTrainer.evaluate returns no metrics without eval samples.
    from raylign.cli.main import COMMANDS

    cls = COMMANDS[name].config_cls()
    data: dict = {"model": {"path": "m"}, "train": {"eval_every": 5}} | (
        {"teacher": {"path": "t"}} if name == "kd" else {}
    )
    with pytest.raises(ConfigError, match="train.eval_every 5: there is nothing to evaluate on; give data.eval"):
        parse_config(cls, {**data, "data": {"train": ["x.jsonl"]}})
    assert parse_config(cls, {**data, "data": {"train": ["x.jsonl"], "eval_fraction": 0.1}}).train.eval_every == 5
    assert parse_config(cls, {**data, "data": {"train": ["x.jsonl"], "eval": ["y.jsonl"]}}).train.eval_every == 5


@pytest.mark.parametrize(
    ("engine", "read_by"),
    [
        ({"backend": "local", "offload_optimizer": True}, "fsdp2 or deepspeed"),
        ({"backend": "local", "offload_params": True}, "fsdp2 or deepspeed"),
        ({"backend": "local", "reduce_dtype": "bfloat16"}, "fsdp2 or deepspeed"),
        ({"backend": "fsdp2", "zero_stage": 3}, "deepspeed"),
        ({"backend": "deepspeed", "load_sharded": False}, "fsdp2"),
        ({"backend": "deepspeed", "reshard_after_forward": False}, "fsdp2"),
        ({"backend": "local", "tensor_parallel_shard_activations": False}, "fsdp2"),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else "",
)
def test_an_engine_setting_the_backend_does_not_read_is_refused(engine, read_by):
    # offload_optimizer under the default local backend kept the optimizer on the device without a word.
    from raylign.config.engine import EngineConfig

    field, value = list(engine.items())[1]
    with pytest.raises(ValueError, match=rf"engine\.{field} {value} is read by engine\.backend {read_by} only; with "):
        EngineConfig(**engine)
    backend = read_by.split(" or ")[0]
    kept = EngineConfig(**{**engine, "backend": backend})
    assert getattr(kept, field) == value
    EngineConfig(**{**engine, field: EngineConfig.model_fields[field].default})  # its default passes
