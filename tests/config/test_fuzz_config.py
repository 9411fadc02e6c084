"""Fuzzed config files and command-line overrides for every command: a config is accepted (and then survives
a YAML round trip with only finite numbers in it), or refused with a ConfigError naming the field path.

Nothing else may escape: no ValueError from the YAML library, no TypeError from a preset lookup.
Files are written to disk and read with :func:`resolve_config`, as the CLI does; a bounded
number of cases go through the CLI's ``main`` itself. Below the fuzz tests, plain examples pin
the exact message for the inputs that need particular care (values YAML cannot build, files
that are not UTF-8, deep nesting, empty field names, NaN and infinity, keys YAML reads as booleans).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from raylign.cli.main import COMMANDS, main
from raylign.config.base import ConfigError, overrides_from_argv, resolve_config, to_yaml
from tests.fuzz_cases import FUZZ, JSON_VALUES, count_case

TRAINING = {"model": {"path": "/models/tiny"}, "data": {"train": ["train.jsonl"]}}
# The smallest valid config of each command (serve-rm's config is covered by its own tests).
MINIMAL: dict[str, dict[str, Any]] = {
    "quickstart": {},
    "tiny-model": {},
    "sft": TRAINING,
    "rm": TRAINING,
    "prm": TRAINING,
    "dpo": TRAINING,
    "kto": TRAINING,
    "kd": {**TRAINING, "teacher": {"path": "/models/teacher"}},
    "generate": {"model": {"path": "/models/tiny"}, "data": {"prompts": ["prompts.jsonl"]}},
    "score": {"reward": {"sources": [{"kind": "exact_match"}]}},
    "select": {"best_of_n": {"output_path": "best.jsonl"}},
    "rl": {**TRAINING, "reward": {"sources": [{"kind": "exact_match"}]}},
    "merge-lora": {"adapter": "final/adapter", "output_dir": "merged"},
    "estimate-memory": {},
}
CONFIG_CLASSES = {name: COMMANDS[name].config_cls() for name in MINIMAL}


def leaf_fields(cls: type[BaseModel], prefix: str = "") -> dict[str, FieldInfo]:
    """Every leaf field by dotted path (fields inside list items left out: a dotted path cannot reach them)."""
    leaves = {}
    for name, field in cls.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            leaves.update(leaf_fields(field.annotation, f"{prefix}{name}."))
        else:
            leaves[f"{prefix}{name}"] = field
    return leaves


LEAVES = {name: leaf_fields(cls) for name, cls in CONFIG_CLASSES.items()}
ERROR_LINE = re.compile(r"  (.+?): (.+)")


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz_config")


# ---------------------------------------------------------------- strategies

COMMAND = st.sampled_from(sorted(MINIMAL))
NAME = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz_"), min_size=1, max_size=12)
# Values a user might plausibly write, next to arbitrary ones.
PLAUSIBLE = st.sampled_from(
    [
        0,
        1,
        -1,
        2,
        8,
        0.5,
        1e-5,
        -0.0,
        math.nan,
        math.inf,
        -math.inf,
        True,
        False,
        None,
        "",
        "auto",
        "chat",
        "plain",
        "fsdp2",
        "bf16",
        "grpo",
        "ppo",
        "exact_match",
        [],
        {},
        ["a.jsonl"],
        {"path": "x.jsonl"},
    ]
)
VALUES = PLAUSIBLE | JSON_VALUES
# YAML text for one override value, as typed on a command line.
VALUE_TEXT = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        [
            "1e-5",
            "true",
            "no",
            "~",
            "null",
            ".nan",
            "-.inf",
            "[1, 2]",
            "{a: 1}",
            "[unclosed",
            "a: b: c",
            "2001-13-01",
            "2001-02-30 25:61:00",
            "!!binary x",
            "!!python/object:os.system",
            "&a [*a]",
            "*undefined",
            "'",
            "- x",
            "0x1F",
            "1_000",
            "0o17",
            "[" * 600 + "]" * 600,
        ]
    ),
    st.builds(str, st.integers() | st.floats(allow_subnormal=False)),
)


def typed_values(annotation: Any) -> st.SearchStrategy[Any] | None:
    """Values of the field's own type (choices of a Literal, small numbers, short names); None for other types."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (Union, types.UnionType):
        known = [strategy for strategy in map(typed_values, args) if strategy is not None]
        return st.one_of(known) if known else None
    if origin in (list, tuple) and args:
        item = typed_values(args[0])
        return None if item is None else st.lists(item, max_size=2)
    simple = {
        type(None): st.none(),
        bool: st.booleans(),
        int: st.integers(-2, 64),
        float: st.floats(-1, 10, allow_subnormal=False),
        str: NAME,
    }
    return simple.get(annotation)


def field_values(command: str, dotted: str, junk: bool = True) -> st.SearchStrategy[Any]:
    """For a real field: its default or a value of its type, mostly (only, without ``junk``); else any value."""
    field = LEAVES[command].get(dotted)
    own = [] if field is None else [strategy for strategy in [typed_values(field.annotation)] if strategy is not None]
    if field is not None and not field.is_required() and field.default_factory is None:
        own.append(st.just(field.default))
    if not junk and own:
        return st.one_of(own)
    return st.one_of(*own * 4, VALUES)


def dotted_paths(command: str) -> st.SearchStrategy[str]:
    """A real leaf path of ``command``, a misspelt one, or a made-up one."""
    real = st.sampled_from(sorted(LEAVES[command]))
    misspelt = st.builds(lambda path, extra: path + extra, real, st.sampled_from(["s", "_", ".x", "."]))
    made_up = st.lists(NAME, min_size=1, max_size=3).map(".".join)
    return st.one_of(*[real] * 6, misspelt, made_up)


def set_path(data: dict[Any, Any], dotted: str, value: Any) -> str:
    """``data[a][b] = value`` for ``'a.b'``, replacing whatever is not a mapping on the way.

    Returns the path of what changed: ``'a'`` when ``data['a']`` was not a mapping and was replaced.
    """
    *parents, last = dotted.split(".")
    node = data
    for depth, key in enumerate(parents):
        if not isinstance(node.get(key), dict):
            node[key] = {}
            set_path(node[key], ".".join([*parents[depth + 1 :], last]), value)
            return ".".join(parents[: depth + 1])
        node = node[key]
    node[last] = value
    return dotted


@st.composite
def mutated_configs(draw: st.DrawFn, command: str) -> tuple[dict[Any, Any], list[str]]:
    """The minimal config of ``command`` with 1 to 3 fields set, and the paths that changed.

    Half the cases set only real fields to values of their type (so many are valid); the others
    also use misspelt or made-up fields, any value and stray top-level keys of any YAML type.
    """
    junk = draw(st.booleans())
    data = copy.deepcopy(MINIMAL[command])
    fields = dotted_paths(command) if junk else st.sampled_from(sorted(LEAVES[command]))
    paths = [
        set_path(data, dotted, draw(field_values(command, dotted, junk)))
        for dotted in draw(st.lists(fields, min_size=1, max_size=3))
    ]
    if junk and draw(st.integers(0, 4)) == 0:
        key = draw(st.integers() | st.booleans() | NAME)
        data[key] = draw(VALUES)
        paths.append(str(key))
    return data, paths


# ---------------------------------------------------------------- checks


def related(error_path: str, dotted: str) -> bool:
    """Whether an error at ``error_path`` is about the field ``dotted`` (the field, a section of it, or inside it)."""
    if error_path == "<root>":
        return True
    # List positions ('data.eval.0.path') are not in a dotted path: a mapping given for a list becomes its item.
    error_parts = [part for part in error_path.split(".") if not part.isdigit()]
    return all(part in (name, repr(name)) for part, name in zip(error_parts, dotted.split(".")))


def created_path(base: dict[str, Any], dotted: str) -> str:
    """The part of ``dotted`` that an override creates in ``base``: down to the first section not there."""
    parts = dotted.split(".")
    node: Any = base
    for depth, part in enumerate(parts[:-1]):
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return ".".join(parts[: depth + 1])
    return dotted


def error_paths(message: str, source: str) -> list[str]:
    """The field path of every line of a validation ConfigError (after checking its layout)."""
    lines = message.split("\n")
    assert lines[0] == f"invalid config ({source}):", message
    paths = []
    for line in lines[1:]:
        match = ERROR_LINE.fullmatch(line)
        assert match is not None, message
        paths.append(match.group(1))
    return paths


def finite_numbers_only(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_numbers_only(v) for v in value.values())
    if isinstance(value, list):
        return all(finite_numbers_only(v) for v in value)
    return True


def assert_accepted_config_round_trips(command: str, cfg: Any, config_dir: Path) -> None:
    cls = CONFIG_CLASSES[command]
    assert isinstance(cfg, cls)
    dumped = cfg.model_dump(mode="json")
    assert finite_numbers_only(dumped), dumped
    again = config_dir / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert resolve_config(cls, again) == cfg


# ---------------------------------------------------------------- config files


@settings(FUZZ, max_examples=120)
@given(data=st.data(), command=COMMAND)
def test_fuzzed_config_file_is_accepted_or_names_the_field(data, command, config_dir):
    count_case("config: YAML files of every command")
    config, paths = data.draw(mutated_configs(command))
    path = config_dir / "run.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    try:
        cfg = resolve_config(CONFIG_CLASSES[command], path)
    except ConfigError as err:
        # The minimal config is valid: every complaint must be about a field the case changed.
        named = error_paths(str(err), str(path))
        assert all(any(related(p, dotted) for dotted in paths) for p in named), str(err)
        return
    count_case("config: YAML files of every command (accepted)")
    assert_accepted_config_round_trips(command, cfg, config_dir)


NASTY_YAML = st.sampled_from(
    [
        "",
        "~",
        "- 1\n- 2",
        "just text",
        "42",
        "model: [unclosed",
        "model: {path: x",
        "a: b: c",
        "\t- x",
        "seed: 2001-13-01",
        "created: 2001-02-30 10:00:00",
        "data: !!binary '!!'",
        "x: !!python/object:os.system {}",
        "a: &a [*a]",
        "a: *missing",
        "model:\n  path: x\n model: y",
        "? [a, b]\n: 1",
        "[" * 600 + "]" * 600,
        "a: " + "[" * 600,
        "%YAML 9.9\n---\na: 1",
        "---\na: 1\n---\nb: 2",
        "a: 1\na: 2",
    ]
)


@settings(FUZZ, max_examples=60)
@given(
    text=NASTY_YAML | st.text(max_size=60), command=COMMAND, encoding=st.sampled_from(["utf-8", "utf-16", "latin-1"])
)
def test_fuzzed_yaml_text_is_accepted_or_refused_with_a_config_error(text, command, encoding, config_dir):
    count_case("config: raw YAML text")
    path = config_dir / "raw.yaml"
    try:
        path.write_bytes(text.encode(encoding))
    except UnicodeEncodeError:
        path.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    try:
        cfg = resolve_config(CONFIG_CLASSES[command], path)
    except ConfigError as err:
        assert str(path) in str(err), str(err)
        return
    assert_accepted_config_round_trips(command, cfg, config_dir)


# ---------------------------------------------------------------- command-line overrides


def as_typed_text(value: Any) -> str:
    """How a user types ``value`` on the command line (JSON is YAML)."""
    return value if isinstance(value, str) else json.dumps(value)


@st.composite
def override_argvs(draw: st.DrawFn, command: str) -> list[str]:
    """Arguments as typed after ``raylign <command>``: --path value, --path=value, --flag, or stray words.

    Half the cases set only real fields to values of their type; the others also use broken
    paths, any text as a value, bare flags and stray words.
    """
    junk = draw(st.booleans())
    argv: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        if junk:
            dotted = draw(dotted_paths(command) | st.sampled_from(["", ".", "a..b", ".lr", "optim.", "model.path.x"]))
            form = draw(st.sampled_from(["equals", "separate", "flag", "stray"]))
            value = draw(VALUE_TEXT | field_values(command, dotted).map(as_typed_text))
        else:
            dotted = draw(st.sampled_from(sorted(LEAVES[command])))
            form = draw(st.sampled_from(["equals", "separate"]))
            value = draw(field_values(command, dotted, junk=False).map(as_typed_text))
        if form == "equals":
            argv.append(f"--{dotted}={value}")
        elif form == "separate":
            argv += [f"--{dotted}", value]
        elif form == "flag":
            argv.append(f"--{dotted}")
        else:
            argv.append(value)
    return argv


@settings(FUZZ, max_examples=120)
@given(data=st.data(), command=COMMAND)
def test_fuzzed_overrides_are_accepted_or_name_the_argument_or_field(data, command, config_dir):
    count_case("config: command-line overrides")
    argv = data.draw(override_argvs(command))
    try:
        overrides = overrides_from_argv(CONFIG_CLASSES[command], argv)
    except ConfigError as err:
        assert any(repr(arg) in str(err) or arg in str(err) for arg in argv), str(err)
        return
    source = "defaults + command-line overrides"
    try:
        cfg = resolve_config(CONFIG_CLASSES[command], None, overrides, base=MINIMAL[command])
    except ConfigError as err:
        message = str(err)
        if message.startswith("invalid config"):
            named = error_paths(message, source)  # the base config is valid: each complaint is about an override
            changed = [created_path(MINIMAL[command], key) for key in overrides]
            assert all(any(related(p, dotted) for dotted in changed) for p in named), message
        else:
            assert any(f"--{key}" in message for key in overrides), message
        return
    count_case("config: command-line overrides (accepted)")
    assert_accepted_config_round_trips(command, cfg, config_dir)


@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_fuzzed_command_line_exits_0_or_2_without_a_traceback(data, config_dir):
    count_case("config: the raylign CLI with --print-config")
    argv = data.draw(override_argvs("sft"))
    path = config_dir / "cli.yaml"
    path.write_text(yaml.safe_dump(MINIMAL["sft"]))
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["sft", "--config", str(path), "--print-config", *argv])
    assert code in (0, 2)
    if code == 2:
        assert stderr.getvalue().startswith("raylign sft: ") and "Traceback" not in stderr.getvalue()


# ---------------------------------------------------------------- examples that need particular care

SFT = CONFIG_CLASSES["sft"]


def write_config(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_bytes(text.encode(encoding))
    return path


def test_override_value_that_yaml_cannot_build_stays_text_and_the_field_is_named():
    with pytest.raises(ConfigError, match=r"train\.seed: Input should be a valid integer.*\(got '2001-13-01'\)"):
        resolve_config(SFT, None, overrides_from_argv(SFT, ["--train.seed=2001-13-01"]), base=MINIMAL["sft"])


def test_override_value_nested_too_deeply_stays_text():
    # YAML gives up on 600 nested lists; the text is then a path, as any other word would be.
    text = "[" * 600 + "]" * 600
    cfg = resolve_config(SFT, None, overrides_from_argv(SFT, ["--data.train", text]), base=MINIMAL["sft"])
    assert [str(spec.path) for spec in cfg.data.train] == [text]


def test_config_file_with_a_date_yaml_cannot_build_is_not_valid_yaml(tmp_path):
    path = write_config(tmp_path / "run.yaml", "model:\n  path: x\ncreated: 2001-13-01\n")
    with pytest.raises(ConfigError) as caught:
        resolve_config(SFT, path)
    assert str(caught.value) == f"config file {path} is not valid YAML: month must be in 1..12"


def test_config_file_that_is_not_utf8_is_named(tmp_path):
    path = write_config(tmp_path / "run.yaml", "model: {path: x}\n", encoding="utf-16")
    with pytest.raises(ConfigError, match=r"^config file .*run\.yaml is not UTF-8 text: 'utf-8' codec can't decode"):
        resolve_config(SFT, path)


def test_config_file_nested_too_deeply_is_named(tmp_path):
    path = write_config(tmp_path / "run.yaml", "model: " + "[" * 600 + "]" * 600 + "\n")
    with pytest.raises(ConfigError) as caught:
        resolve_config(SFT, path)
    assert str(caught.value) == f"config file {path} is not usable YAML: nested too deeply"


@pytest.mark.parametrize("argument", ["--optim..lr=1", "--=1", "--.lr=1", "--optim.=1"])
def test_override_with_an_empty_field_name_names_the_argument(argument):
    dotted = argument[2:].split("=")[0]
    with pytest.raises(ConfigError) as caught:
        resolve_config(SFT, None, overrides_from_argv(SFT, [argument]), base=MINIMAL["sft"])
    assert str(caught.value) == f"--{dotted}: an override names a field by its dotted path, e.g. --optim.lr"


def test_rl_preset_that_is_not_a_name_is_a_config_error_naming_preset():
    with pytest.raises(ConfigError, match=r"\n  preset: Input should be 'ppo', 'grpo'.*\(got \['grpo'\]\)"):
        resolve_config(CONFIG_CLASSES["rl"], None, {"preset": ["grpo"]}, base=MINIMAL["rl"])


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_nan_and_infinity_are_refused_naming_the_field(value):
    overrides = overrides_from_argv(SFT, [f"--optim.max_grad_norm={value}"])
    with pytest.raises(ConfigError) as caught:
        resolve_config(SFT, None, overrides, base=MINIMAL["sft"])
    assert "\n  optim.max_grad_norm: Input should be a finite number" in str(caught.value)


def test_overrides_do_not_write_into_the_base_config():
    base = {"model": {"path": "/models/tiny"}, "data": {"train": ["train.jsonl"]}}
    cfg = resolve_config(SFT, None, {"model.path": "/models/other"}, base=base)
    assert cfg.model.path == "/models/other"
    assert base == {"model": {"path": "/models/tiny"}, "data": {"train": ["train.jsonl"]}}


def test_yaml_key_read_as_a_boolean_is_named_as_written(tmp_path):
    path = write_config(tmp_path / "run.yaml", "model: {path: x}\ndata: {train: [t.jsonl]}\noptim:\n  yes: 1\n")
    with pytest.raises(ConfigError) as caught:
        resolve_config(SFT, path)
    assert str(caught.value).endswith("\n  optim.True: a field name must be text, not bool True (quote it in YAML)")


def test_field_name_with_spaces_or_invisible_characters_is_quoted(tmp_path):
    path = write_config(tmp_path / "run.yaml", "model: {path: x}\ndata: {train: [t.jsonl]}\noptim:\n  'lr ': 1\n")
    with pytest.raises(ConfigError) as caught:
        resolve_config(SFT, path)
    assert str(caught.value).endswith("\n  optim.'lr ': unknown field (check the spelling; see --help for the fields)")
