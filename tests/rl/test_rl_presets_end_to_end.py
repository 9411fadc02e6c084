"""Presets run end to end with the hf engine on a tiny model: 2 steps with a checkpoint after
each, then an exported policy that transformers loads and runs; for ppo (a critic and a reference)
and dapo (no reference; the dynamic-sampling feed) a rerun of the same output folder with
``max_steps: 3`` that resumes at step 2 and runs step 3 only. The other presets keep nothing else
in a checkpoint; grpo's resume is checked against an uninterrupted run below.

One run per way through the controller and workers, not one per preset: ppo (a critic, GAE),
grpo (a group estimator, KL to the reference as a loss), reinforce_pp (KL as a per-token reward
penalty, batch whitening), gspo (a sequence-level ratio), dapo (dynamic sampling, clip-higher,
the overlong penalty). dr_grpo, reinforce_pp_baseline and rloo differ from these only in the
estimator or aggregation, which tests/algorithms checks against closed forms and TRL.

gspo and dapo, which have no reference model, generate with an engine inside the policy worker
(``placement.colocate``); the others with a separate engine actor.

Each preset's runs happen once (a module fixture) and the tests below read what they left behind.
grpo and ppo stay in the quick suite; the other presets are marked slow.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from raylign.engine.checkpoint import CheckpointError, latest_checkpoint
from raylign.rl.trainer import TRAINED_ROLES, RLTrainer, check_checkpoint_roles
from raylign.trainers.metrics import read_metrics

from .rl_helpers import TIMING_PARTS, fp32_model, resolve, rl_config_data, set_dotted, state_dict_of

QUICK = ("grpo", "ppo")
PRESETS = ("ppo", "grpo", "reinforce_pp", "gspo", "dapo")
RESUMED = ("ppo", "dapo")
COLOCATED = {"gspo", "dapo"}


def _params(presets: tuple[str, ...]) -> list:
    return [p if p in QUICK else pytest.param(p, marks=pytest.mark.slow) for p in presets]


USES_REFERENCE = {"ppo", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"}


class ResumeRecordingTrainer(RLTrainer):
    """The real controller; remembers the step it stood at once set-up (and any resume) was done."""

    resumed_at: int | None = None

    def setup(self) -> None:
        super().setup()
        self.resumed_at = self.step


@dataclass
class PresetRuns:
    preset: str
    out: Path
    model_dir: Path
    first_records: list[dict]  # metrics.jsonl after the 2-step run
    second_records: list[dict]  # records the rerun with max_steps 3 added (ppo and dapo only)
    checkpoints_after_first: list[str]
    resumed_at: int | None
    roles: list[str]  # the model-worker groups the first run started


def _checkpoint_names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir() and p.name.startswith("step_"))


@pytest.fixture(scope="module", params=_params(PRESETS))
def runs(request, ray_session, rl_model_dir, prompt_file, tmp_path_factory) -> PresetRuns:
    preset = request.param
    tmp = tmp_path_factory.mktemp(f"rl_{preset}")
    out = tmp / "run"
    data = set_dotted(rl_config_data(rl_model_dir, prompt_file, out, preset), "train.save_every", 1)
    if preset in COLOCATED:
        data["placement"] = {"colocate": True}
    trainer = RLTrainer(resolve(tmp, data))
    trainer.run()
    roles = sorted(trainer.groups)
    first = read_metrics(out)
    checkpoints = _checkpoint_names(out)
    if preset not in RESUMED:
        return PresetRuns(preset, out, rl_model_dir, first, [], checkpoints, None, roles)
    rerun = ResumeRecordingTrainer(resolve(tmp, set_dotted(data, "train.max_steps", 3)))
    rerun.run()
    second = read_metrics(out)[len(first) :]
    return PresetRuns(preset, out, rl_model_dir, first, second, checkpoints, rerun.resumed_at, roles)


def test_a_checkpoint_resumes_only_in_a_run_that_trains_the_same_models(runs):
    # A PPO checkpoint resumed as GRPO dropped its critic without a word; the other way, the critic's
    # missing folder was reported as an incomplete checkpoint.
    ckpt = latest_checkpoint(runs.out / "checkpoints")
    trained = [role for role in TRAINED_ROLES if role in runs.roles]
    assert trained == (["policy", "critic"] if runs.preset == "ppo" else ["policy"])
    check_checkpoint_roles(ckpt, trained)
    other = ["policy"] if "critic" in trained else ["policy", "critic"]
    with pytest.raises(CheckpointError) as err:
        check_checkpoint_roles(ckpt, other)
    assert str(err.value).startswith(
        f"checkpoint {ckpt} holds {' and '.join(trained)}; this run trains {' and '.join(other)}"
    )


@pytest.mark.parametrize("runs", _params(("ppo",)), indirect=True)
def test_a_resume_refuses_a_checkpoint_with_a_file_cut_short_before_any_model_loads(runs, tmp_path):
    # A copy cut short keeps the COMPLETE marker, which sorts first; each backend's own loader then
    # failed deep inside (DCP, DeepSpeed) with an error naming no file, or none at all.
    ckpt = latest_checkpoint(runs.out / "checkpoints")
    listed = json.loads((ckpt / "meta.json").read_text())["files"]
    files = {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in ckpt.rglob("*") if p.is_file()}
    on_disk = {name: size for name, size in files.items() if name not in ("meta.json", "COMPLETE")}
    assert listed == on_disk
    assert {"controller.pt", "policy/meta.json", "critic/scheduler.pt"} <= set(listed)
    copy = tmp_path / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, copy)
    damaged = max((name for name in listed if name.startswith("critic/")), key=listed.get)  # its weights
    (copy / damaged).write_bytes((copy / damaged).read_bytes()[:100])
    config = yaml.safe_load((runs.out / "config.yaml").read_text())
    trainer = RLTrainer(resolve(tmp_path, set_dotted(config, "train.output_dir", str(tmp_path))))
    trainer.groups = {"policy": None, "critic": None}  # never called: the check comes first
    with pytest.raises(CheckpointError) as err:
        trainer._maybe_resume()
    assert str(err.value) == (
        f"checkpoint {copy} is damaged: {damaged} is 100 bytes, {listed[damaged]} when written. "
        "Delete this folder to resume from the checkpoint before it"
    )


def test_each_step_logs_its_training_metrics_and_no_kl_before_the_first_update(runs):
    assert [r["step"] for r in runs.first_records] == [1, 2]
    kl_key = "kl/reference" if runs.preset in USES_REFERENCE else "policy/approx_kl"
    wanted = [
        "reward/mean",
        kl_key,
        "policy/entropy",
        "policy/clip_fraction",
        "policy/grad_norm",
        "time/step_s",
        *TIMING_PARTS,
    ]
    if runs.preset == "ppo":
        wanted += ["critic/value_loss", "critic/grad_norm"]
    for record in runs.first_records + runs.second_records:
        missing = [k for k in wanted if k not in record]
        assert not missing, (record["step"], missing)
        bad = {k: record[k] for k in wanted if not math.isfinite(record[k])}
        assert not bad, (record["step"], bad)
        assert 0.0 <= record["policy/clip_fraction"] <= 1.0
        assert record["policy/entropy"] > 0.0  # a random policy is far from deterministic
        assert record["rollout/weight_lag"] == 0  # synchronous: samples come from the weights being trained
        # The parts are disjoint intervals inside the step.
        assert sum(record[k] for k in TIMING_PARTS) <= record["time/step_s"] + 1e-6
        # The workers' own compute is inside the phase that waited for it: the policy's update (and the
        # critic's, one after the other) in train; the passes left for the experience phase in it.
        assert 0.0 < record["time/train_compute_s"] <= record["time/train_s"]
        if "threads/experience" in record:
            assert 0.0 < record["time/experience_compute_s"] <= record["time/experience_s"]
        else:
            assert "time/experience_compute_s" not in record
    if runs.preset in USES_REFERENCE:  # step 1 samples from the initial weights, which the reference holds
        assert abs(runs.first_records[0]["kl/reference"]) < 1e-6
    # Generation rate: the step's response tokens over the seconds its groups were being generated.
    config = yaml.safe_load((runs.out / "config.yaml").read_text())
    samples = config["train"]["prompts_per_step"] * config["sampling"]["n"]
    for record in runs.first_records:
        if runs.preset != "dapo":  # dynamic sampling keeps a varying number of groups
            generated = record["response_length/mean"] * samples
            rate_times_span = record["throughput/generated_tokens_per_s"] * record["time/generation_span_s"]
            assert rate_times_span == pytest.approx(generated, rel=1e-9)
        assert record["time/generation_span_s"] > 0.0


def test_while_a_phase_runs_alone_its_workers_compute_on_every_core(runs):
    """Synchronous rollout: generation, experience and training take turns, and each role has one
    rank, so under the default placement.threads_per_worker (auto) the worker of each phase computes
    with all the cores this machine lets the run use. Presets without a KL term have no forward pass
    before training (on-policy: the training forward's own log-probs are the behaviour's). The engine
    generates with every core too (rollout.threads_per_engine auto), so the reference's pass does not
    run beside it (train.early_reference auto) but in the experience phase, on every core; and then the
    policy's workers host the reference model (placement.reference_with_policy auto): no reference workers."""
    cores = len(os.sched_getaffinity(0))
    assert runs.roles == (["critic", "policy"] if runs.preset == "ppo" else ["policy"])
    for record in runs.first_records + runs.second_records:
        assert record["threads/train"] == cores
        assert "threads/reference_early" not in record
        if runs.preset in USES_REFERENCE:
            assert record["threads/experience"] == cores and "experience/reference_early" not in record
        else:
            assert record.get("threads/experience", cores) == cores  # only the critic's pass (ppo) is left there


def test_rewards_gave_the_policy_a_gradient(runs):
    norms = [r["policy/grad_norm"] for r in runs.first_records + runs.second_records]
    assert max(norms) > 0.0


def test_a_checkpoint_is_written_after_every_step(runs):
    assert runs.checkpoints_after_first == ["step_1", "step_2"]


@pytest.mark.parametrize("runs", _params(RESUMED), indirect=True)
def test_the_rerun_keeps_the_last_two_checkpoints(runs):
    assert _checkpoint_names(runs.out) == ["step_2", "step_3"]  # keep_last: 2
    state = torch.load(runs.out / "checkpoints" / "step_3" / "controller.pt", weights_only=False)
    assert state["step"] == 3


@pytest.mark.parametrize("runs", _params(RESUMED), indirect=True)
def test_the_rerun_resumes_at_step_two_and_runs_step_three_only(runs):
    assert runs.resumed_at == 2
    assert [r["step"] for r in runs.second_records] == [3]
    logged = [json.loads(line)["step"] for line in (runs.out / "samples.jsonl").read_text().splitlines()]
    assert logged == [1, 1, 2, 2, 3, 3]  # log_samples: 2 per step


def test_exported_policy_loads_generates_and_differs_from_the_start(runs):
    model = fp32_model(runs.out / "final")
    out = model.generate(torch.tensor([[5, 6, 7]]), do_sample=False, max_new_tokens=4)
    assert out.shape == (1, 7)
    initial = state_dict_of(runs.model_dir)
    moved = max(float((model.state_dict()[k] - v).abs().max()) for k, v in initial.items())
    assert moved > 1e-4  # two or three AdamW steps at lr 1e-3 move weights by about 1e-3


def _step_records(out: Path, step: int) -> tuple[list[dict], dict]:
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    metrics = [r for r in read_metrics(out) if r["step"] == step]
    assert len(metrics) == 1
    return [s for s in samples if s["step"] == step], metrics[0]


@pytest.mark.slow
def test_resumed_run_repeats_the_step_an_uninterrupted_run_takes(ray_session, rl_model_dir, prompt_file, tmp_path):
    """Weights, optimizer, prompt order, RNG and the running reward statistics all come back: step 3
    after a resume from step 2 is the step 3 of a run that never stopped (same prompts, completions,
    rewards and update)."""
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "resumed", "grpo")
    data["train"].update(save_every=1, log_samples=16)
    # Normalised rewards plus a length penalty: the penalty's weight against the reward depends on
    # the statistics of steps 1 and 2, so a resume that lost them would train step 3 differently.
    data.setdefault("algorithm", {}).update(normalize_rewards=True, length_penalty="linear", length_penalty_coef=0.05)
    data["optim"]["scheduler"] = "constant"  # max_steps sets a decaying schedule's horizon: 2 and 3 would differ
    RLTrainer(resolve(tmp_path, data)).run()
    RLTrainer(resolve(tmp_path, set_dotted(data, "train.max_steps", 3))).run()
    straight = set_dotted(set_dotted(data, "train.output_dir", str(tmp_path / "straight")), "train.save_every", 0)
    RLTrainer(resolve(tmp_path, straight)).run()

    resumed_samples, resumed = _step_records(tmp_path / "resumed", 3)
    straight_samples, uninterrupted = _step_records(tmp_path / "straight", 3)
    assert len(resumed_samples) == 16
    assert [(s["prompt"], s["response"], s["reward"]) for s in resumed_samples] == [
        (s["prompt"], s["response"], s["reward"]) for s in straight_samples
    ]
    assert resumed["reward/running_mean"] != 0.0 and resumed["reward/length_penalty"] < 0.0
    for key in (
        "reward/mean",
        "reward/running_mean",
        "reward/running_std",
        "policy/policy_loss",
        "policy/grad_norm",
        "kl/reference",
        "policy/lr",
    ):
        assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-7), key

    # Started over in the same folder: the earlier run's records are set aside, each step is logged once.
    out = tmp_path / "resumed"
    again = {**data, "train": {**data["train"], "output_dir": str(out), "resume": False, "max_steps": 1}}
    RLTrainer(resolve(tmp_path, again)).run()
    assert [r["step"] for r in read_metrics(out)] == [1]
    assert [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()] == [1] * 16
    aside = [json.loads(line)["step"] for line in (out / "metrics.superseded.jsonl").read_text().splitlines()]
    assert aside == [1, 2, 3]
    aside = [json.loads(line)["step"] for line in (out / "samples.superseded.jsonl").read_text().splitlines()]
    assert aside == [1] * 16 + [2] * 16 + [3] * 16
