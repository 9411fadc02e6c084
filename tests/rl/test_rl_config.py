"""``raylign rl`` configs: presets fill what the user left unset, and impossible combinations fail
at parse time (before any Ray worker starts) with a message that names the fields."""

from __future__ import annotations

import copy

import pytest
import yaml

from raylign.cli.main import main
from raylign.config.base import ConfigError
from raylign.config.rl import AlgorithmConfig, RLConfig
from raylign.rl.trainer import RLTrainer

from .rl_helpers import resolve, rl_config_data, write_yaml

# What each preset stands for, from its paper (see raylign/rl/presets.py for the references):
# estimator, policy loss, KL to the reference (where and which estimator), loss aggregation.
EXPECTED_PRESETS = {
    "ppo": {
        "advantage": "gae",
        "policy_loss": "ppo",
        "kl_mode": "reward",
        "kl_estimator": "k1",
        "kl_coef": 0.01,
        "aggregation": "token_mean",
        "n": 1,
    },
    "grpo": {
        "advantage": "grpo",
        "normalize_std": True,
        "policy_loss": "ppo",
        "kl_mode": "loss",
        "kl_estimator": "k3",
        "kl_coef": 0.001,
        "aggregation": "seq_mean_token_mean",
        "n": 4,
    },
    "dr_grpo": {
        "advantage": "dr_grpo",
        "policy_loss": "ppo",
        "kl_mode": "none",
        "kl_coef": 0.0,
        "aggregation": "constant_normalizer",
        "n": 4,
    },
    "reinforce_pp": {
        "advantage": "reinforce_plus_plus",
        "policy_loss": "ppo",
        "kl_mode": "reward",
        "kl_estimator": "k2",
        "kl_coef": 0.01,
        "aggregation": "token_mean",
        "n": 1,
    },
    "reinforce_pp_baseline": {
        "advantage": "reinforce_plus_plus_baseline",
        "policy_loss": "ppo",
        "kl_mode": "loss",
        "kl_estimator": "k3",
        "kl_coef": 0.001,
        "aggregation": "token_mean",
        "n": 4,
    },
    "rloo": {
        "advantage": "rloo",
        "policy_loss": "ppo",
        "kl_mode": "reward",
        "kl_estimator": "k1",
        "kl_coef": 0.01,
        "aggregation": "token_mean",
        "n": 4,
    },
    "gspo": {
        "advantage": "grpo",
        "policy_loss": "gspo",
        "clip_eps_low": 3e-4,
        "clip_eps_high": 4e-4,
        "kl_mode": "none",
        "kl_coef": 0.0,
        "aggregation": "seq_mean_token_mean",
        "n": 4,
    },
    "dapo": {
        "advantage": "grpo",
        "policy_loss": "ppo",
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "kl_mode": "none",
        "kl_coef": 0.0,
        "aggregation": "token_mean",
        "dynamic_sampling": True,
        "overlong_buffer": 16,
        "n": 4,
    },
}
USES_CRITIC = {"ppo"}
USES_REFERENCE = {"ppo", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"}


@pytest.fixture
def base(rl_model_dir, prompt_file, tmp_path):
    return rl_config_data(rl_model_dir, prompt_file, tmp_path / "run")


def _error(tmp_path, data, overrides=None) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(tmp_path, data, overrides)
    return str(err.value)


# ---- presets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(EXPECTED_PRESETS))
def test_preset_resolves_to_its_algorithm(preset, base, tmp_path):
    base["preset"] = preset
    base["sampling"].pop("max_new_tokens")  # the default (256) leaves room for DAPO's overlong buffer
    cfg = resolve(tmp_path, base)
    expected = dict(EXPECTED_PRESETS[preset])
    assert cfg.sampling.n == expected.pop("n")
    got = {key: getattr(cfg.algorithm, key) for key in expected}
    assert got == expected
    assert cfg.uses_critic == (preset in USES_CRITIC)
    assert cfg.uses_reference == (preset in USES_REFERENCE)


def test_yaml_values_beat_the_preset_and_keep_its_other_fields(base, tmp_path):
    base["algorithm"] = {"kl_coef": 0.05, "kl_estimator": "k2"}
    base["sampling"]["n"] = 8
    cfg = resolve(tmp_path, base)
    assert (cfg.algorithm.kl_coef, cfg.algorithm.kl_estimator, cfg.sampling.n) == (0.05, "k2", 8)
    # fields the user did not write still come from the grpo preset, not the schema defaults
    assert cfg.algorithm.aggregation == "seq_mean_token_mean"
    assert cfg.sampling.max_new_tokens == 16


def test_command_line_beats_yaml_and_picks_the_preset(base, tmp_path):
    base["algorithm"] = {"kl_coef": 0.05}
    cfg = resolve(tmp_path, base, {"preset": "rloo", "algorithm.kl_coef": 0.2, "algorithm.aggregation": "token_mean"})
    assert cfg.preset == "rloo"
    assert (cfg.algorithm.advantage, cfg.algorithm.kl_estimator) == ("rloo", "k1")
    assert (cfg.algorithm.kl_coef, cfg.algorithm.aggregation) == (0.2, "token_mean")


def test_ppo_with_more_samples_per_prompt_keeps_the_critic(base, tmp_path):
    base["preset"] = "ppo"
    base["sampling"]["n"] = 2
    cfg = resolve(tmp_path, base)
    assert (cfg.sampling.n, cfg.algorithm.advantage, cfg.uses_critic) == (2, "gae", True)


# ---- impossible combinations -----------------------------------------------------------------


def test_a_constant_normalizer_with_a_fraction_is_refused_naming_the_field(base, tmp_path):
    # A token count: 1000.5 was cut to 1000 without a word.
    base["algorithm"] = {"aggregation": "constant_normalizer", "constant_normalizer": 1000.5}
    with pytest.raises(ConfigError, match=r"algorithm\.constant_normalizer: Input should be a valid integer"):
        resolve(tmp_path, base)
    base["algorithm"]["constant_normalizer"] = 1000
    assert resolve(tmp_path, base).algorithm.constant_normalizer == 1000


def test_dual_clip_with_a_sequence_level_loss_is_refused_not_ignored(base, tmp_path):
    # GSPO's loss has no dual-clip bound: the setting was accepted and had no effect.
    base["algorithm"] = {"policy_loss": "gspo", "dual_clip_c": 3.0}
    with pytest.raises(ConfigError, match=r"dual_clip_c bounds the token-level surrogate of policy_loss: ppo"):
        resolve(tmp_path, base)
    base["algorithm"]["policy_loss"] = "ppo"
    assert resolve(tmp_path, base).algorithm.dual_clip_c == 3.0


def test_critic_with_grpo_is_refused(base, tmp_path):
    base["critic"] = {"path": str(base["model"]["path"])}
    message = _error(tmp_path, base)
    assert "critic.path" in message and "algorithm.advantage" in message and "grpo" in message


def test_a_critic_optimizer_without_a_critic_is_refused_not_ignored(base, tmp_path):
    # It was accepted and nothing read it. The default (as in a dumped config) passes.
    base["critic"] = {"optim": {"lr": 1e-4}}
    message = _error(tmp_path, base)
    assert "critic.optim" in message and "advantage 'grpo' uses no critic" in message
    base["critic"] = {"optim": {"lr": 5e-6}}
    resolve(tmp_path, base)
    base["critic"] = {"optim": {"lr": 1e-4}}
    base["algorithm"] = {"advantage": "gae"}
    assert resolve(tmp_path, base).critic.optim.lr == 1e-4


@pytest.mark.parametrize("preset", ["grpo", "rloo", "dr_grpo"])
def test_one_sample_per_prompt_with_a_group_estimator_is_refused(preset, base, tmp_path):
    base["preset"] = preset
    base["sampling"]["n"] = 1
    message = _error(tmp_path, base)
    assert "sampling.n" in message and preset in message and "got 1" in message


# ---- settings another setting would ignore, refused --------------------------------------------


@pytest.mark.parametrize("preset", ["dr_grpo", "gspo", "dapo"])
def test_a_kl_coefficient_without_a_kl_term_is_refused(preset, base, tmp_path):
    # These presets turn the KL term off (kl_mode none): a kl_coef given on top of them did nothing.
    base["preset"] = preset
    base["sampling"].pop("max_new_tokens")  # room for DAPO's overlong buffer
    base["algorithm"] = {"kl_coef": 0.05}
    assert "algorithm.kl_coef 0.05 weighs a KL term, but algorithm.kl_mode is none" in _error(tmp_path, base)
    base["algorithm"]["kl_mode"] = "loss"
    assert resolve(tmp_path, base).uses_reference


def test_a_reference_model_no_kl_term_uses_is_refused(base, tmp_path):
    base["reference"] = {"path": str(base["model"]["path"])}
    base["algorithm"] = {"kl_mode": "none"}
    assert "reference is set but no KL term uses it" in _error(tmp_path, base)
    base["algorithm"] = {"kl_mode": "loss", "kl_coef": 0.01}
    assert resolve(tmp_path, base).uses_reference


@pytest.mark.parametrize(
    ("given", "read_by", "chosen", "reading"),
    [
        (
            {"gamma": 0.99},
            "advantage gae, reinforce, reinforce_plus_plus or reinforce_plus_plus_baseline",
            "advantage grpo",
            {"advantage": "reinforce"},
        ),
        ({"lam": 0.9}, "advantage gae", "advantage grpo", {"advantage": "gae"}),
        ({"advantage": "rloo", "normalize_std": False}, "advantage grpo", "advantage rloo", {"advantage": "grpo"}),
        ({"vf_coef": 1.0}, "advantage gae (a critic)", "advantage grpo", {"advantage": "gae"}),
        ({"value_clip": None}, "advantage gae (a critic)", "advantage grpo", {"advantage": "gae"}),
        ({"tis_cap": 3.0}, "off_policy truncated_is", "off_policy none", {"off_policy": "truncated_is"}),
        (
            {"off_policy": "truncated_is", "mask_high": 3.0},
            "off_policy ratio_mask",
            "off_policy truncated_is",
            {"off_policy": "ratio_mask"},
        ),
        (
            {"constant_normalizer": 64},
            "aggregation constant_normalizer",
            "aggregation seq_mean_token_mean",
            {"aggregation": "constant_normalizer"},
        ),
        ({"overlong_penalty": 0.5}, "overlong_buffer above 0", "overlong_buffer 0", {"overlong_buffer": 4}),
        (
            {"length_penalty_coef": 0.01},
            "length_penalty linear or kimi",
            "length_penalty none",
            {"length_penalty": "linear"},
        ),
        (
            {"length_penalty": "kimi", "length_penalty_free_tokens": 8},
            "length_penalty linear",
            "length_penalty kimi",
            {"length_penalty": "linear"},
        ),
        ({"correct_reward": 0.5}, "length_penalty kimi", "length_penalty none", {"length_penalty": "kimi"}),
        ({"max_refill_rounds": 5}, "dynamic_sampling true", "dynamic_sampling false", {"dynamic_sampling": True}),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else "",
)
def test_an_option_the_choice_made_does_not_read_is_refused(given, read_by, chosen, reading, base, tmp_path):
    # Each of these was accepted and did nothing: gamma under grpo, a truncation cap with no correction.
    base["algorithm"] = dict(given)
    (field, value), *_ = [(k, v) for k, v in given.items() if k not in ("advantage", "off_policy", "length_penalty")]
    expected = (
        f"algorithm.{field} {value} is read only with algorithm.{read_by}; with algorithm.{chosen} it would do nothing"
    )
    assert expected in _error(tmp_path, base)
    base["algorithm"].update(reading)  # the same value, with a choice that reads it
    assert getattr(resolve(tmp_path, base).algorithm, field) == value
    # Given at its default (a dumped config lists every field), it changes nothing and passes.
    base["algorithm"] = {**given, field: AlgorithmConfig.model_fields[field].default}
    resolve(tmp_path, base)


@pytest.mark.parametrize(("preset", "dynamic"), [("grpo", False), ("rloo", False), ("ppo", True)])
def test_greedy_sampling_where_samples_are_compared_is_refused(preset, dynamic, base, tmp_path):
    # One greedy answer copied n times: every group's rewards are equal, every advantage 0, nothing trains.
    base["preset"] = preset
    base["sampling"]["temperature"] = 0.0
    base["algorithm"] = {"dynamic_sampling": dynamic}
    if dynamic:
        base["sampling"]["n"] = 2
    assert "sampling.temperature 0 samples one greedy answer" in _error(tmp_path, base)
    base["preset"], base["algorithm"] = "ppo", {}
    base["sampling"]["n"] = 1
    assert resolve(tmp_path, base).sampling.temperature == 0.0  # a critic's baseline needs no group


def test_several_greedy_evaluation_samples_are_refused(base, tmp_path):
    base["data"]["eval"] = base["data"]["train"]
    base["train"].update(eval_n=4)
    assert "pass@4 would equal pass@1" in _error(tmp_path, base)
    base["train"].update(eval_temperature=0.7)
    assert resolve(tmp_path, base).train.eval_n == 4


@pytest.mark.parametrize(
    "train", [{"eval_every": 2}, {"eval_n": 2, "eval_temperature": 0.7}, {"eval_max_new_tokens": 8}], ids=str
)
def test_evaluation_settings_without_eval_prompts_are_refused(train, base, tmp_path):
    # eval_every without data.eval evaluated nothing, logging "step 2 eval: " with no figures.
    base["train"].update(train)
    named = ", ".join(f"train.{k}" for k in train)
    assert f"{named}: there are no eval prompts to evaluate on; give data.eval" in _error(tmp_path, base)
    base["data"]["eval"] = base["data"]["train"]
    assert resolve(tmp_path, base).data.eval


def test_engine_num_processes_is_refused_in_rl(base, tmp_path):
    # raylign rl never starts torchrun: the setting trained on placement.policy_workers (1) regardless.
    base["engine"] = {"backend": "fsdp2", "num_processes": 4}
    assert "placement.policy_workers" in _error(tmp_path, base)


@pytest.mark.parametrize("key", ["messages_key", "output_key", "chosen_key", "rejected_key"])
def test_a_prompt_dataset_key_rl_never_reads_is_refused(key, base, tmp_path):
    base["data"]["train"] = [{**base["data"]["train"][0], key: "conversation"}]
    assert f"train.0: {key} is for training data; a prompt's text or conversation is read from input_key" in (
        _error(tmp_path, base)
    )


def test_one_prompt_file_may_be_given_without_a_list_as_in_sft(base, tmp_path):
    path = base["data"]["train"][0]["path"]
    base["data"] = {**base["data"], "train": path, "eval": path}
    cfg = resolve(tmp_path, base)
    assert [spec.path for spec in cfg.data.train] == [spec.path for spec in cfg.data.eval] == [path]


@pytest.mark.parametrize(
    ("template", "found"),
    [("Q: {question}\nA:", "['question']"), ("Answer the question.", "[]"), ("{input} {0}", "['0', 'input']")],
)
def test_a_plain_prompt_template_without_exactly_input_is_refused(template, found, base, tmp_path):
    # A template without {input} would turn every prompt into the same text; another field fails only at setup.
    base["data"].update(format="plain", prompt_template=template)
    error = _error(tmp_path, base)
    expected = f"data.prompt_template: Value error, must contain the field {{input}} and no other fields; found {found}"
    assert expected in error


@pytest.mark.parametrize(
    ("sampling", "rollout", "algorithm"),
    [
        ({"top_p": 0.9}, {"max_staleness": 1}, {}),
        ({"top_k": 20}, {}, {"off_policy": "truncated_is"}),
    ],
)
def test_filtered_sampling_where_the_engine_log_probs_enter_the_loss_is_refused(
    sampling, rollout, algorithm, base, tmp_path
):
    # The engine's log-probs are of the top-p/top-k distribution, the trainer's of the whole one: as the
    # behaviour policy (staleness) or in the correction's weight, the ratio was off with equal weights.
    base["sampling"].update(sampling)
    base["rollout"].update(rollout)
    base["algorithm"] = algorithm
    assert "the engine's log-probs are those of the filtered distribution" in _error(tmp_path, base)
    base["rollout"].pop("max_staleness", None)
    base["algorithm"] = {}
    assert resolve(tmp_path, base).sampling.top_p == sampling.get("top_p", 1.0)  # synchronous: the trainer's own


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"train": {"eval_temperature": 0.005, "eval_n": 2}}, "0.005 is below 0.01, which vLLM would sample at"),
        ({"train": {"eval_temperature": 50.0, "eval_n": 2}}, "less than or equal to 10"),
        ({"preset": "ppo", "algorithm": {"length_penalty": "kimi"}}, "length_penalty: kimi compares the lengths"),
        ({"placement": {"colocate": True}, "train": {"early_reference": True}}, "early_reference: true computes"),
        (
            {"placement": {"reference_with_policy": True, "reference_workers": 3}, "engine": {"backend": "fsdp2"}},
            "under placement.reference_workers above 1",
        ),
    ],
)
def test_settings_the_run_would_ignore_or_bend_are_refused(changes, error, base, tmp_path):
    # Each was accepted: the eval temperature skipped sampling's range checks (vLLM samples 0.005 at 0.01);
    # kimi's group-relative penalty is 0 for one sample; the early reference and the extra reference
    # ranks were dropped in silence.
    for key, value in changes.items():
        if isinstance(value, dict):
            base.setdefault(key, {}).update(value)
        else:
            base[key] = value
    assert error in _error(tmp_path, base)


def test_rollout_batch_must_divide_into_mini_batches(base, tmp_path):
    base["train"].update(prompts_per_step=3, mini_batches=5)  # 3 x 4 = 12 samples
    message = _error(tmp_path, base)
    for field in ("train.prompts_per_step", "sampling.n", "train.mini_batches", "(12)", "(5)"):
        assert field in message


@pytest.mark.parametrize("preset, field", [("grpo", "optim"), ("ppo", "critic.optim")])
def test_a_warm_up_longer_than_the_run_is_refused_before_anything_starts(base, tmp_path, preset, field):
    base["preset"] = preset
    base["train"].update(max_steps=2, mini_batches=2, ppo_epochs=3)  # 2 x 2 x 3 = 12 optimizer steps
    section = base.setdefault("critic", {}) if field == "critic.optim" else base
    section.setdefault("optim", {})["warmup_steps"] = 12
    resolve(tmp_path, base)  # a warm-up as long as the run is fine
    section["optim"]["warmup_steps"] = 13
    message = _error(tmp_path, base)
    assert f"{field}.warmup_steps (13)" in message and "= 12" in message


def test_mini_batch_must_divide_over_policy_workers(base, tmp_path):
    base["train"].update(prompts_per_step=3, mini_batches=2)  # mini-batches of 6 samples
    base["placement"] = {"policy_workers": 4}
    message = _error(tmp_path, base)
    assert "placement.policy_workers (4)" in message and "6 samples" in message


def test_mini_batch_must_divide_over_critic_workers(base, tmp_path):
    base["preset"] = "ppo"  # n = 1: mini-batches of 3 samples
    base["train"]["prompts_per_step"] = 3
    base["placement"] = {"critic_workers": 2}
    assert "placement.critic_workers (2)" in _error(tmp_path, base)


def test_rollout_batch_must_divide_over_reference_workers(base, tmp_path):
    base["train"]["prompts_per_step"] = 3  # 12 samples
    base["placement"] = {"reference_workers": 5}
    assert "placement.reference_workers (5)" in _error(tmp_path, base)


def test_reference_workers_do_not_matter_without_a_reference(base, tmp_path):
    base["preset"] = "dr_grpo"  # no KL: no reference model is started
    base["train"]["prompts_per_step"] = 3
    base["placement"] = {"reference_workers": 5}
    assert resolve(tmp_path, base).placement.reference_workers == 5


def test_dapo_overlong_buffer_must_fit_in_the_generation_limit(base, tmp_path):
    base["preset"] = "dapo"
    base["sampling"]["max_new_tokens"] = 8  # the preset's buffer is 16 tokens
    message = _error(tmp_path, base)
    assert "algorithm.overlong_buffer (16)" in message and "sampling.max_new_tokens (8)" in message


def test_dynamic_sampling_needs_groups(base, tmp_path):
    base["preset"] = "reinforce_pp"  # n = 1
    base["algorithm"] = {"dynamic_sampling": True}
    message = _error(tmp_path, base)
    assert "algorithm.dynamic_sampling" in message and "sampling.n" in message


def test_micro_batch_budget_must_hold_the_longest_sample(base, tmp_path):
    base["data"]["max_prompt_length"] = 100
    base["train"]["micro_batch_tokens"] = 100  # + 16 new tokens would not fit
    message = _error(tmp_path, base)
    assert "train.micro_batch_tokens (100)" in message and "= 116" in message


def test_ray_cpu_slots_count_every_actor(base, tmp_path):
    base["engine"] = {"backend": "fsdp2"}  # several training ranks
    base["preset"] = "ppo"
    base["placement"] = {"policy_workers": 2, "critic_workers": 2, "reference_workers": 4, "cpus_per_worker": 0.5}
    base["rollout"].update(num_engines=3, num_cpus_per_engine=2.0)
    base["reward"]["sources"].append({"kind": "reward_model", "model_path": "rm", "num_cpus": 1.5})
    # (2 + 2 + 4) workers x 0.5 + 3 engines x 2 + 1.5 for the reward model
    assert resolve(tmp_path, base).ray_cpus_needed == 11.5


def test_ray_cpu_slots_leave_out_roles_that_do_not_run(base, tmp_path):
    base["engine"] = {"backend": "fsdp2"}  # several training ranks
    base["preset"] = "dr_grpo"  # no critic, no reference
    base["placement"] = {"policy_workers": 2, "critic_workers": 4, "reference_workers": 4}
    assert resolve(tmp_path, base).ray_cpus_needed == 2 + 1  # the policy workers and one engine


def test_ray_cpu_slots_when_colocated(base, tmp_path):
    base["engine"] = {"backend": "fsdp2"}  # several training ranks
    base["preset"] = "ppo"  # policy, reference and critic
    base["placement"] = {
        "colocate": True,
        "policy_workers": 2,
        "reference_workers": 1,
        "critic_workers": 2,
        "cpus_per_worker": 0.5,
    }
    base["rollout"].update(num_engines=2, num_cpus_per_engine=4.0)
    # 2 bundles (one per policy rank), each with room for one worker of 3 roles; engines live in the policy
    assert resolve(tmp_path, base).ray_cpus_needed == 2 * 3 * 0.5


@pytest.mark.parametrize(
    ("placement", "rollout", "fields"),
    [
        (
            {"colocate": True, "policy_workers": 2},
            {"num_engines": 3},
            ["rollout.num_engines (3)", "policy_workers (2)"],
        ),
        ({"colocate": True}, {"engine": "vllm", "tensor_parallel_size": 2}, ["rollout.tensor_parallel_size"]),
        ({"colocate": True, "reference_workers": 2}, {}, ["placement.reference_workers", "policy_workers (1)"]),
    ],
)
def test_impossible_colocation_is_refused(base, tmp_path, placement, rollout, fields):
    base["engine"] = {"backend": "fsdp2"}
    base["placement"] = placement
    base["rollout"].update(rollout)
    message = _error(tmp_path, base)
    assert all(field in message for field in fields), message


def test_the_old_async_rollout_key_names_its_replacement(base, tmp_path):
    base["train"]["async_rollout"] = True
    message = _error(tmp_path, base)
    assert "train.async_rollout" in message and "rollout.max_staleness: 1" in message, message


@pytest.mark.parametrize(
    ("rollout", "extra", "fields"),
    [
        ({"max_staleness": 1}, {"placement": {"colocate": True}}, ["rollout.max_staleness", "placement.colocate"]),
        # Beyond one update the engine's log-probs are not trusted as the ratio's policy without a correction.
        ({"max_staleness": 2}, {}, ["rollout.max_staleness 2", "algorithm.off_policy", "truncated_is"]),
        ({"partial_rollouts": True}, {}, ["rollout.partial_rollouts", "rollout.max_staleness >= 1"]),
        # Settings only an asynchronous run reads: accepted and unread by a synchronous one before.
        ({"stale_samples": "regenerate"}, {}, ["rollout.stale_samples: regenerate", "rollout.max_staleness >= 1"]),
        ({"reproducible": True}, {}, ["rollout.reproducible", "rollout.max_staleness >= 1"]),
    ],
)
def test_impossible_asynchronous_settings_are_refused(base, tmp_path, rollout, extra, fields):
    base["rollout"].update(rollout)
    for section, values in extra.items():
        base.setdefault(section, {}).update(values)
    message = _error(tmp_path, base)
    assert all(field in message for field in fields), message


def test_staleness_beyond_one_update_is_accepted_with_a_correction(base, tmp_path):
    from raylign.rl.experience import behaviour_for

    base["rollout"].update(max_staleness=4, partial_rollouts=True, stale_samples="regenerate", reproducible=True)
    base["algorithm"] = {"off_policy": "truncated_is"}
    cfg = resolve(tmp_path, base)
    assert cfg.rollout.max_staleness == 4
    assert behaviour_for(cfg) == "trainer_recomputed"  # the proximal policy of decoupled PPO


def test_local_backend_with_several_training_ranks_is_refused(base, tmp_path):
    base["preset"] = "ppo"
    base["placement"] = {"policy_workers": 2, "critic_workers": 4}
    message = _error(tmp_path, base)
    assert "engine.backend 'local'" in message
    assert "placement.policy_workers=2" in message and "placement.critic_workers=4" in message


def test_local_ray_too_small_for_the_actors_is_refused(base, tmp_path):
    base["engine"] = {"backend": "fsdp2"}  # several training ranks
    base["placement"] = {"policy_workers": 2, "num_cpus": 3}  # grpo: 2 policy + 1 reference + 1 engine
    message = _error(tmp_path, base)
    assert "placement.num_cpus (3)" in message and "4 CPU slots" in message


def test_cpu_slots_are_not_checked_on_an_existing_cluster(base, tmp_path):
    base["engine"] = {"backend": "fsdp2"}  # several training ranks
    base["placement"] = {"policy_workers": 2, "num_cpus": 3, "ray_address": "auto"}
    assert resolve(tmp_path, base).placement.num_cpus == 3


# ---- through the command line ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["--sampling.n", "1"], "sampling.n"),
        (["--critic.path", "some/critic"], "critic.path"),
        (["--train.mini_batches", "3"], "train.mini_batches"),
        (["--placement.policy_workers", "3"], "placement.policy_workers"),
    ],
)
def test_cli_exits_2_naming_the_field_before_anything_runs(overrides, named, base, tmp_path, capsys):
    path = write_yaml(tmp_path / "rl.yaml", base)
    assert main(["rl", "--config", str(path), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raylign rl: invalid config") and named in err
    assert not (tmp_path / "run").exists()  # the controller would create output_dir first


def test_cli_prints_the_resolved_preset(base, tmp_path, capsys):
    path = write_yaml(tmp_path / "rl.yaml", base)
    assert main(["rl", "--config", str(path), "--preset", "dr_grpo", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["algorithm"]["advantage"] == "dr_grpo"
    assert printed["algorithm"]["aggregation"] == "constant_normalizer"


@pytest.mark.parametrize("preset", sorted(EXPECTED_PRESETS))
def test_model_validate_applies_the_preset_as_the_command_line_does(preset, base, tmp_path):
    base["preset"] = preset
    base["sampling"].pop("max_new_tokens")
    base.pop("algorithm", None)
    validated = RLConfig.model_validate(copy.deepcopy(base))
    assert validated == resolve(tmp_path, base)
    assert validated.algorithm.advantage == EXPECTED_PRESETS[preset]["advantage"]
    assert validated.sampling.n == EXPECTED_PRESETS[preset]["n"]


def test_a_field_given_beside_the_preset_wins_over_it(base):
    base.update(preset="ppo", algorithm={"kl_coef": 0.5})
    cfg = RLConfig.model_validate(base)
    assert (cfg.algorithm.advantage, cfg.algorithm.kl_mode, cfg.algorithm.kl_coef) == ("gae", "reward", 0.5)


def test_editing_preset_defaults_leaves_the_presets_as_they_are():
    defaults = RLConfig.preset_defaults({"preset": "grpo"})
    defaults["algorithm"]["off_policy"] = "truncated_is"
    defaults["algorithm"] = {}
    assert "off_policy" not in RLConfig.preset_defaults({"preset": "grpo"})["algorithm"]
    assert RLConfig.preset_defaults({"preset": "grpo"})["algorithm"]["advantage"] == "grpo"


def test_an_agent_run_needs_no_reward_sources_but_a_plain_run_does(base, tmp_path):
    data = copy.deepcopy(base)
    del data["reward"]
    with pytest.raises(ConfigError, match="reward: required .* unless agent.env or agent.client"):
        resolve(tmp_path, data)
    data["agent"] = {"env": "raylign.agents.tools:CalculatorEnv", "max_total_tokens": 256}
    data["train"] = {**data.get("train", {}), "micro_batch_tokens": 256}
    cfg = resolve(tmp_path, data)
    assert cfg.reward is None and cfg.agent.enabled


def test_an_agent_run_takes_env_or_client_and_room_for_a_whole_episode(base, tmp_path):
    data = copy.deepcopy(base)
    data["agent"] = {"env": "a.py:Env", "client": "b.py:run"}
    with pytest.raises(ConfigError, match="agent.env and agent.client"):
        resolve(tmp_path, data)
    data["agent"] = {"client": "b.py:run", "max_total_tokens": 4096}
    data["train"] = {**data.get("train", {}), "micro_batch_tokens": 2048}
    with pytest.raises(ConfigError, match=r"micro_batch_tokens \(2048\) must hold a whole episode"):
        resolve(tmp_path, data)


@pytest.mark.parametrize("agent", [{}, {"client": "b.py:run"}])
def test_environment_arguments_without_an_environment_are_refused_not_ignored(agent, base, tmp_path):
    base["agent"] = {**agent, "env_args": {"max_tool_calls": 3}, "max_total_tokens": 256}
    base["train"] = {**base.get("train", {}), "micro_batch_tokens": 256}
    assert "agent.env_args are the arguments of the agent.env class, and agent.env is not set" in _error(tmp_path, base)


@pytest.mark.parametrize(
    ("agent", "problem"),
    [
        (
            {"env": "raylign.agents.tools:CalculatorEnv", "env_args": {"max_tool_call": 3}},
            "agent.env_args: CalculatorEnv does not take them (got an unexpected keyword argument 'max_tool_call'); "
            "its arguments: system_prompt, max_tool_calls, tool_role, call_format, template_tools, step_budget_s",
        ),
        ({"env": "raylign.agents.tools:NoSuchEnv"}, "agent.env: raylign.agents.tools has no 'NoSuchEnv'"),
        ({"env": "raylign.agents.tools:numeric_match"}, "agent.env: raylign.agents.tools:numeric_match has no reset"),
        ({"client": "raylign.agents.tools:NO_CLIENT"}, "agent.client: raylign.agents.tools has no 'NO_CLIENT'"),
    ],
)
def test_an_agents_code_and_arguments_are_checked_before_anything_starts(agent, problem, base, tmp_path, monkeypatch):
    # Found at the first episode before, after Ray, the workers and the engines had started, as a bare TypeError.
    base["agent"] = {**agent, "max_total_tokens": 256}
    base["train"] = {**base.get("train", {}), "micro_batch_tokens": 256}
    trainer = RLTrainer(resolve(tmp_path, base))
    ray_starts = []
    monkeypatch.setattr("raylign.rl.trainer.start_ray", lambda *args, **kwargs: ray_starts.append(args))
    with pytest.raises(ValueError) as err:
        trainer.setup()
    assert problem in str(err.value)
    assert ray_starts == []


def test_dapo_s_overlong_penalty_is_refused_for_agent_episodes_whose_turns_each_have_the_limit(base, tmp_path):
    data = copy.deepcopy(base)
    data["preset"] = "dapo"
    data["sampling"] = {**data.get("sampling", {}), "max_new_tokens": 64}
    data["agent"] = {"env": "raylign.agents.tools:CalculatorEnv", "max_total_tokens": 512}
    data["train"] = {**data.get("train", {}), "micro_batch_tokens": 512}
    with pytest.raises(ConfigError, match=r"overlong_buffer \(16\) .* several turns.*set algorithm.overlong_buffer 0"):
        resolve(tmp_path, data)
    data["algorithm"] = {**data.get("algorithm", {}), "overlong_buffer": 0}
    assert resolve(tmp_path, data).algorithm.overlong_buffer == 0


def test_a_4bit_policy_base_trains_on_local_fsdp2_or_zero2_and_is_refused_under_zero3(base, tmp_path):
    base["model"]["lora"] = {"rank": 4, "quantize_base": "nf4"}
    assert resolve(tmp_path, base).model.lora.quantize_base == "nf4"  # the local backend, one policy rank
    base["engine"] = {**base.get("engine", {}), "backend": "fsdp2"}
    base["placement"] = {**base.get("placement", {}), "policy_workers": 2}
    assert resolve(tmp_path, base).engine.backend == "fsdp2"  # data-parallel ranks, each with the 4-bit base
    base["engine"]["backend"] = "deepspeed"  # ZeRO-2, the default: each rank holds the whole model
    assert resolve(tmp_path, base).engine.zero_stage == 2
    base["engine"]["zero_stage"] = 3
    message = _error(tmp_path, base)
    assert "model.lora.quantize_base 'nf4': rl trains a 4-bit base with engine.backend local, fsdp2, or" in message
