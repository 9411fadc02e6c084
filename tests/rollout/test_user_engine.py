"""A rollout engine of the user's own: ``rollout.engine: path/to/file.py:Class`` (or
``package.module:Class``) names a RolloutEngine subclass, which a run loads and starts in its
engine actors as it does the built-in ones."""

from __future__ import annotations

import json
import os
import re
import textwrap

import pytest

from raylign.config.base import ConfigError, parse_config
from raylign.config.rollout import RolloutConfig
from raylign.rollout.hf_engine import HFEngine
from raylign.rollout.pool import engine_class

FORM_ERROR = "must be 'vllm', 'hf', or an engine class of your own"

ENGINES = """
from raylign.rollout.base import RolloutEngine
from raylign.rollout.hf_engine import HFEngine


class MarkedEngine(HFEngine):
    marker = "defined in the user's file"


class NotAnEngine:
    pass


class HalfAnEngine(RolloutEngine):
    async def _group(self, prompt, sampling, index):
        return []
"""


@pytest.mark.parametrize("name", ["vllm", "hf", "my_package.engines:GreedyEngine"])
def test_built_in_names_and_module_paths_are_kept_as_given(name):
    assert RolloutConfig(engine=name).engine == name


def test_a_relative_file_path_is_made_absolute_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = RolloutConfig(engine="my_engines/greedy.py:GreedyEngine")
    assert config.engine == f"{tmp_path}/my_engines/greedy.py:GreedyEngine"
    assert RolloutConfig(engine="/abs/greedy.py:GreedyEngine").engine == "/abs/greedy.py:GreedyEngine"


@pytest.mark.parametrize(
    "name",
    [
        "sglang",  # neither built in nor a class
        "greedy.py",  # no class
        "greedy.py:",
        ":GreedyEngine",
        ".py:GreedyEngine",
        "greedy.py:Greedy:Engine",  # two colons
        "greedy.py:Greedy-Engine",  # not a Python name
        "my-package.engines:GreedyEngine",  # not a module name
    ],
)
def test_other_forms_are_refused_naming_the_field_and_the_forms(name):
    with pytest.raises(ConfigError, match=rf"engine: Value error, {FORM_ERROR}"):
        parse_config(RolloutConfig, {"engine": name})


@pytest.fixture
def engines_file(tmp_path):
    path = tmp_path / "engines.py"
    path.write_text(textwrap.dedent(ENGINES))
    return path


def test_a_file_defined_subclass_is_loaded(engines_file):
    cls = engine_class(f"{engines_file}:MarkedEngine")
    assert issubclass(cls, HFEngine)
    assert cls.marker == "defined in the user's file"


def test_a_module_path_names_an_engine_as_a_file_does():
    assert engine_class("raylign.rollout.hf_engine:HFEngine") is HFEngine


def test_a_class_that_is_not_an_engine_is_refused_naming_the_setting_and_the_class(engines_file):
    expected = (
        "engines.py:NotAnEngine names class NotAnEngine, which is not a subclass of raylign.rollout.base.RolloutEngine"
    )
    with pytest.raises(TypeError, match=rf"rollout.engine: .*{re.escape(expected)}"):
        engine_class(f"{engines_file}:NotAnEngine")


def test_an_engine_with_abstract_methods_left_is_refused_naming_them(engines_file):
    with pytest.raises(TypeError, match=r"HalfAnEngine does not implement .* join_weight_sync_group, .*update_weights"):
        engine_class(f"{engines_file}:HalfAnEngine")


def test_a_missing_file_or_class_is_named(engines_file):
    with pytest.raises(FileNotFoundError, match=r"rollout.engine: .*nowhere.py does not exist"):
        engine_class(f"{engines_file.parent}/nowhere.py:MarkedEngine")
    with pytest.raises(AttributeError, match=r"rollout.engine: .* has no 'Missing'"):
        engine_class(f"{engines_file}:Missing")


RECORDING_ENGINE = """
import json
import os

from raylign.rollout.hf_engine import HFEngine


class RecordingEngine(HFEngine):
    \"\"\"The hf engine, noting for each prompt group the process that generated it and the weight version.\"\"\"

    async def _group(self, prompt, sampling, index):
        completions = await super()._group(prompt, sampling, index)
        with open({record!r}, "a") as f:
            f.write(json.dumps({{"pid": os.getpid(), "version": self.weight_version}}) + "\\n")
        return completions
"""


@pytest.mark.slow
def test_a_run_generates_with_the_users_engine_in_its_engine_actor(ray_session, tied_model_dir, tmp_path, monkeypatch):
    from raylign.rl.trainer import RLTrainer
    from raylign.tasks.strings import make_string_rows
    from raylign.trainers.metrics import read_metrics
    from tests.rl.rl_helpers import resolve, rl_config_data

    record = tmp_path / "groups.jsonl"
    (tmp_path / "my_engines").mkdir()
    (tmp_path / "my_engines" / "recording.py").write_text(RECORDING_ENGINE.format(record=str(record)))
    prompts = tmp_path / "prompts.jsonl"
    rows = make_string_rows("copy", 8, seed=0)
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"], "label": r["completion"]}) + "\n" for r in rows))
    data = rl_config_data(tied_model_dir, prompts, tmp_path / "run")
    data["rollout"]["engine"] = "my_engines/recording.py:RecordingEngine"  # relative to the working directory
    data["algorithm"] = {"kl_mode": "none", "kl_coef": 0.0}  # no reference workers to start
    monkeypatch.chdir(tmp_path)
    RLTrainer(resolve(tmp_path, data)).run()

    assert [r["step"] for r in read_metrics(tmp_path / "run") if "reward/mean" in r] == [1, 2]
    groups = [json.loads(line) for line in record.read_text().splitlines()]
    pids = {g["pid"] for g in groups}
    assert len(pids) == 1 and os.getpid() not in pids  # one engine actor, not this process
    # Step 1's four groups were generated with the weights the engine loaded, step 2's with the first sync's.
    assert [g["version"] for g in groups[:8]] == [0] * 4 + [1] * 4


ORDERED_ENGINE = """
import json

from raylign.rollout.hf_engine import HFEngine


class OrderedEngine(HFEngine):
    \"\"\"The hf engine, noting each call that moves its memory or uses it, in order.\"\"\"

    def _note(self, event):
        with open({record!r}, "a") as f:
            f.write(json.dumps(event) + "\\n")

    async def sleep(self, level=1):
        self._note("sleep")
        await super().sleep(level)

    async def wake_up(self, tags=None):
        self._note("wake " + "+".join(tags or ["all"]))
        await super().wake_up(tags)

    async def update_weights(self, named_tensors, keep_running=False, version=None):
        self._note("sync")
        return await super().update_weights(named_tensors, keep_running, version)

    async def score(self, token_ids, base=False):
        self._note("probe")
        return await super().score(token_ids, base)

    async def _group(self, prompt, sampling, index):
        self._note("generate")
        return await super()._group(prompt, sampling, index)
"""


@pytest.mark.slow
def test_a_colocated_run_wakes_and_sleeps_its_users_engine_in_order(ray_session, tied_model_dir, tmp_path):
    """placement.colocate with an engine of the user's own, in the policy worker's process: each sync
    wakes the engine's weights before the weights arrive and its KV cache only after, once the
    policy has scored the sync's probe and moved out; the engine sleeps before training."""
    from raylign.rl.trainer import RLTrainer
    from raylign.tasks.strings import make_string_rows
    from tests.rl.rl_helpers import resolve, rl_config_data

    record = tmp_path / "events.jsonl"
    engine_file = tmp_path / "ordered.py"
    engine_file.write_text(ORDERED_ENGINE.format(record=str(record)))
    prompts = tmp_path / "prompts.jsonl"
    rows = make_string_rows("copy", 8, seed=0)
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"], "label": r["completion"]}) + "\n" for r in rows))
    data = rl_config_data(tied_model_dir, prompts, tmp_path / "run")
    data["rollout"]["engine"] = f"{engine_file}:OrderedEngine"
    data["placement"] = {**data.get("placement", {}), "colocate": True}
    data["algorithm"] = {"kl_mode": "none", "kl_coef": 0.0}  # no reference workers to start
    RLTrainer(resolve(tmp_path, data)).run()

    events = [json.loads(line) for line in record.read_text().splitlines()]
    collapsed = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]  # one "generate" per phase
    one_step = ["generate", "sleep", "wake weights", "sync", "wake kv_cache", "probe"]
    assert collapsed == one_step * 2, events
