"""The GPUs a run reserves, counted before any actor starts: model workers, separate rollout
engines and reward-model actors; a cluster with too few fails naming the fields that ask for them.
The expected counts are worked out by hand in each test."""

from __future__ import annotations

import pytest

from raylign.rl.placement import check_gpu_count, gpus_needed

from .rl_helpers import resolve, rl_config_data


@pytest.fixture
def base(rl_model_dir, prompt_file, tmp_path):
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "run", "grpo")  # a policy and a reference
    data["engine"] = {"backend": "fsdp2"}  # several data-parallel ranks
    return data


def _reward_model(num_gpus: float) -> dict:
    return {"kind": "reward_model", "model_path": "rm", "num_gpus": num_gpus}


def test_reward_model_gpus_are_added_to_the_workers_and_engines(base, tmp_path):
    base["placement"] = {"policy_workers": 2, "reference_workers": 1}
    base["rollout"].update(num_engines=1)
    base["reward"]["sources"].append(_reward_model(1))
    # 2 policy + 1 reference + 1 engine x tensor parallel 1 + 1 reward model
    assert gpus_needed(resolve(tmp_path, base)) == 5


def test_colocated_run_adds_reward_model_gpus_to_one_per_policy_rank(base, tmp_path):
    base["placement"] = {"colocate": True, "policy_workers": 2, "reference_workers": 2}
    base["reward"]["sources"] += [_reward_model(1), _reward_model(2)]
    # 2 shared GPUs (policy rank r, reference rank r and the engine of rank r) + 1 + 2 for the reward models
    assert gpus_needed(resolve(tmp_path, base)) == 5


def test_fractional_reward_model_gpus_are_summed_and_rounded_up(base, tmp_path):
    base["placement"] = {"policy_workers": 1}
    base["reward"]["sources"] += [_reward_model(0.5), _reward_model(0.25), _reward_model(0.5)]
    # 1 policy + 1 reference + 1 engine + ceil(0.5 + 0.25 + 0.5 = 1.25) = 2
    assert gpus_needed(resolve(tmp_path, base)) == 5


def test_a_cluster_without_gpus_needs_only_the_reward_models_gpus(base, tmp_path):
    base["placement"] = {"policy_workers": 2}
    cfg = resolve(tmp_path, base)
    assert gpus_needed(cfg, cluster_has_gpus=False) == 0  # workers and engines run on CPUs
    check_gpu_count(cfg, 0)  # nothing asks for a GPU: no error
    base["reward"]["sources"].append(_reward_model(1))
    assert gpus_needed(resolve(tmp_path, base), cluster_has_gpus=False) == 1


def test_too_few_gpus_names_the_reward_model_field(base, tmp_path):
    base["placement"] = {"policy_workers": 2}
    base["reward"]["sources"].append(_reward_model(1))  # sources[2]: after the format and exact_match sources
    with pytest.raises(ValueError) as err:
        check_gpu_count(resolve(tmp_path, base), 4)  # needs 2 + 1 + 1 + 1 = 5
    message = str(err.value)
    assert "needs 5 GPUs" in message and "the Ray cluster has 4" in message
    assert "reward.sources[2].num_gpus=1" in message


def test_reward_model_on_a_gpu_fails_on_a_cluster_without_gpus(base, tmp_path):
    base["reward"]["sources"].append(_reward_model(1))
    with pytest.raises(ValueError) as err:
        check_gpu_count(resolve(tmp_path, base), 0)
    assert "reward.sources[2].num_gpus=1" in str(err.value) and "has none" in str(err.value)
