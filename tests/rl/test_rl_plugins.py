"""``plugins``: an advantage estimator or policy loss registered by the user's own file is named in the
config like a built-in one, in the controller and in the training workers, without editing raylign."""

from __future__ import annotations

import textwrap

import pytest

from raylign.algorithms import registry
from raylign.config import rl as rl_config
from raylign.config.base import ConfigError
from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import resolve, rl_config_data

# Every advantage is exactly 1 on every response token, so the run's logged advantage mean is 1 whatever
# the rewards; the loss is PPO's with one statistic added, which only the workers compute and log.
PLUGIN = """
import torch

from raylign.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES


@ADVANTAGE_ESTIMATORS.register("unit_advantage")
def unit_advantage(rewards, mask):
    return mask.clone(), mask.clone()


@POLICY_LOSSES.register("ppo_marked")
def ppo_marked(logprobs, old_logprobs, advantages, mask, **options):
    loss, stats = POLICY_LOSSES.get("ppo")(logprobs, old_logprobs, advantages, mask, **options)
    return loss, {**stats, "plugin_marker": torch.tensor(7.0)}
"""


@pytest.fixture(scope="module", autouse=True)
def registries_as_built():
    """The plugin registers its names in this process's registries too (the controller validates the
    config here): take them out again after this file, so that later tests in the process see the
    built-in registries."""
    registries = [r for r in vars(registry).values() if isinstance(r, registry.Registry)]
    saved = [(dict(r._functions), dict(r._metadata)) for r in registries]
    yield
    for r, (functions, metadata) in zip(registries, saved, strict=True):
        r._functions, r._metadata = functions, metadata


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugins") / "my_algorithms.py"
    path.write_text(textwrap.dedent(PLUGIN))
    return path


@pytest.mark.parametrize(
    ("builtin", "functions"),
    [
        (rl_config.ADVANTAGE_ESTIMATORS, registry.ADVANTAGE_ESTIMATORS),
        (rl_config.POLICY_LOSSES, registry.POLICY_LOSSES),
        (rl_config.LOSS_AGGREGATIONS, registry.LOSS_AGGREGATIONS),
        (rl_config.KL_ESTIMATORS, registry.KL_ESTIMATORS),
    ],
)
def test_the_configs_built_in_names_are_the_registries_own(builtin, functions):
    """The config lists the built-in names so that it loads without torch; they must not drift."""
    library = {"raylign.algorithms." + m for m in ("advantages", "policy_loss", "aggregation", "kl")}
    own = [name for name in functions.names() if functions.get(name).__module__ in library]
    assert sorted(builtin) == own


def test_the_configs_estimator_options_are_the_registrations_own():
    """The fields each built-in estimator reads, listed in the config, are those its registration declares."""
    declared = {
        name: registry.ADVANTAGE_ESTIMATORS.metadata(name).get("options", ()) for name in rl_config.ESTIMATOR_OPTIONS
    }
    assert declared == rl_config.ESTIMATOR_OPTIONS


def test_an_option_a_plugin_estimator_does_not_declare_is_refused(rl_model_dir, prompt_file, plugin_file, tmp_path):
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "out")
    data["plugins"] = [str(plugin_file)]
    data["algorithm"] = {"advantage": "unit_advantage", "gamma": 0.9}
    with pytest.raises(
        ConfigError, match=r"algorithm\.gamma 0\.9 is read only with algorithm\.advantage gae, reinforce,"
    ):
        resolve(tmp_path, data)


def test_a_name_no_plugin_registered_is_refused_with_the_registered_names(rl_model_dir, prompt_file, tmp_path):
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "out")
    data["algorithm"] = {"advantage": "group_median"}
    with pytest.raises(ConfigError) as err:
        resolve(tmp_path, data)
    text = str(err.value)
    assert "algorithm.advantage" in text and "unknown advantage estimator 'group_median'" in text
    assert "registered: dr_grpo, gae, grpo" in text and "plugins" in text


def test_a_missing_or_failing_plugin_is_named(rl_model_dir, prompt_file, tmp_path):
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "out")
    data["plugins"] = [str(tmp_path / "nowhere.py")]
    with pytest.raises(ConfigError, match=r"plugins\[0\]: .*nowhere.py does not exist"):
        resolve(tmp_path, data)
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\nraise RuntimeError('no GPU here')\n")
    data["plugins"] = [str(broken)]
    with pytest.raises(ConfigError, match=r"(?s)plugins\[0\]: importing .*broken.py failed.*RuntimeError: no GPU here"):
        resolve(tmp_path, data)
    data["plugins"] = ["no_such_package.algorithms"]
    with pytest.raises(ConfigError, match=r"no module named 'no_such_package.algorithms'"):
        resolve(tmp_path, data)


def test_a_plugin_path_is_made_absolute_and_imported_once_per_process(
    rl_model_dir, prompt_file, plugin_file, tmp_path, monkeypatch
):
    monkeypatch.chdir(plugin_file.parent)
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "out")
    data["plugins"] = ["my_algorithms.py"]
    data["algorithm"] = {"advantage": "unit_advantage", "policy_loss": "ppo_marked"}
    first = resolve(tmp_path, data)
    again = resolve(tmp_path, first.model_dump())  # what a worker does with the config it is sent
    assert first.plugins == again.plugins == [str(plugin_file)]  # validating again did not register twice
    assert not first.uses_critic and (first.algorithm.advantage, first.algorithm.policy_loss) == (
        "unit_advantage",
        "ppo_marked",
    )


def test_a_run_uses_the_plugins_estimator_in_the_controller_and_its_loss_in_the_workers(
    ray_session, rl_model_dir, prompt_file, plugin_file, tmp_path
):
    out = tmp_path / "run"
    data = rl_config_data(rl_model_dir, prompt_file, out)
    data["plugins"] = [str(plugin_file)]
    data["algorithm"] = {"advantage": "unit_advantage", "policy_loss": "ppo_marked", "kl_mode": "none"}
    data["engine"] = {"backend": "fsdp2", "dist_timeout_s": 120}  # the loss runs in a Ray worker process
    data["train"]["max_steps"] = 1
    RLTrainer(resolve(tmp_path, data)).run()
    (record,) = read_metrics(out)
    assert record["advantage/mean"] == 1.0
    markers = {key: value for key, value in record.items() if key.endswith("plugin_marker")}
    assert markers and set(markers.values()) == {7.0}, markers
