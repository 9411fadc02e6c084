"""The typed contract between the controller and its workers, and the metrics it carries back.

The controller builds one :class:`Experience` per step and hands each rank :class:`MicroBatch` es
whose ``behaviour`` says where the ratio's behaviour log-probs come from; workers return
:class:`Metric` s that say how they combine. The logged batch losses must not depend on how a
batch is cut into micro-batches: they are checked against the whole-batch loss written out here.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from raylign.config.rl import AlgorithmConfig
from raylign.models.packed_attention import ONE_ROW
from raylign.rl.experience import Experience, behaviour_for, pack_samples, response_tensor
from raylign.rl.group import WorkerGroup
from raylign.rl.metric import Metric, average_updates, combine
from raylign.rl.trainer import RLTrainer
from raylign.rl.worker import _correction_metrics, bind_off_policy_correction
from raylign.trainers.guard import SkippedSteps

from .rl_helpers import fp32_model, make_sample, resolve, response_logprobs, rl_config_data

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
CLIP = 0.2
# Lengths (prompt, response): 70 tokens in all, the longest sample 14 tokens.
LENGTHS = [(3, 9), (5, 7), (2, 8), (4, 6), (6, 2), (3, 3), (5, 4), (2, 1)]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.75]


def _samples() -> list:
    rng = random.Random(0)
    return [
        make_sample([rng.randrange(10, 500) for _ in range(p)], [rng.randrange(10, 500) for _ in range(r)])
        for p, r in LENGTHS
    ]


def _config_data(model_dir, prompt_file, tmp_path, preset: str = "grpo", **algorithm) -> dict:
    """A run on the tiny model without a reference policy; samples short enough for tiny micro-batches."""
    data = rl_config_data(model_dir, prompt_file, tmp_path / "run", preset)
    data["data"]["max_prompt_length"] = 8  # lets train.micro_batch_tokens go down to 8 + 16 tokens
    data["algorithm"] = {"kl_mode": "none", "kl_coef": 0.0, **algorithm}
    return data


# ---- the typed batches -------------------------------------------------------------------


def test_a_per_token_tensor_of_the_wrong_shape_is_an_error_naming_the_field():
    samples = [make_sample([1, 2], [3, 4, 5]), make_sample([6], [7])]
    with pytest.raises(ValueError, match="MicroBatch.advantages"):
        pack_samples(samples, {"advantages": torch.zeros(3, 3)})  # three rows for two samples
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="Experience.values"):
        Experience(
            mask,
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.zeros(2, 3, dtype=torch.long),
            "this_policy",
            values=torch.zeros(2, 4),
        )
    with pytest.raises(ValueError, match="old_logprobs"):  # the behaviour names a field that is not there
        pack_samples(samples, {"advantages": torch.zeros(2, 3)}, behaviour="trainer_recomputed")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, "this_policy"),
        ({"train.ppo_epochs": 2}, "trainer_recomputed"),
        ({"train.mini_batches": 2}, "trainer_recomputed"),
        ({"algorithm.off_policy": "truncated_is"}, "trainer_recomputed"),
        ({"rollout.max_staleness": 1}, "engine"),  # asynchronous: the weights that sampled are gone
        ({"rollout.max_staleness": 2, "algorithm.off_policy": "truncated_is"}, "trainer_recomputed"),  # decoupled PPO
    ],
)
def test_behaviour_is_fixed_by_the_config(rl_model_dir, prompt_file, tmp_path, overrides, expected):
    cfg = resolve(tmp_path, _config_data(rl_model_dir, prompt_file, tmp_path), overrides)
    assert behaviour_for(cfg) == expected


def test_on_policy_and_async_experience_carry_no_recomputed_logprobs(rl_model_dir, prompt_file, tmp_path):
    """Without a recomputation the controller calls no worker; the step's samples are the whole input."""
    samples = _samples()
    for i, s in enumerate(samples):
        s.reward, s.weight_version = float(i % 2), 3
    samples[0].token_versions = [3] * 5 + [4] * 4  # a partial rollout: an update came after token 5
    for overrides, behaviour in (({}, "this_policy"), ({"rollout.max_staleness": 1}, "engine")):
        cfg = resolve(tmp_path, _config_data(rl_model_dir, prompt_file, tmp_path), overrides)
        exp = RLTrainer(cfg).make_experience(samples)
        assert exp.behaviour == behaviour and exp.old_logprobs is None
        assert exp.versions.dtype == torch.int64
        assert exp.versions[0].tolist() == [3, 3, 3, 3, 3, 4, 4, 4, 4]
        assert exp.versions[1].tolist() == [3] * 7 + [0, 0]  # weight_version on every token, 0 past the end


@pytest.mark.parametrize(
    ("algorithm", "reads_reference"),
    [
        ({"kl_mode": "none"}, False),  # a kl_coef above 0 with it is refused (test_rl_config.py)
        ({"kl_mode": "loss", "kl_coef": 0.0}, False),
        ({"kl_mode": "reward", "kl_coef": 0.0}, False),
        ({"kl_mode": "loss", "kl_coef": 0.05}, True),
        ({"kl_mode": "reward", "kl_coef": 0.05}, True),
    ],
)
def test_a_reference_policy_is_started_only_where_a_kl_term_reads_it(
    rl_model_dir, prompt_file, tmp_path, algorithm, reads_reference
):
    data = _config_data(rl_model_dir, prompt_file, tmp_path, **algorithm)
    data["placement"] = {"reference_workers": 2}
    cfg = resolve(tmp_path, data)
    assert cfg.worker_roles == ({"policy": 1, "reference": 2} if reads_reference else {"policy": 1})
    # one CPU slot per model worker, one for the engine
    assert cfg.ray_cpus_needed == (1 + 2 * reads_reference) + 1
    if reads_reference:
        return
    # The step's experience is made without any model worker: no reference (and no policy) pass.
    samples = _samples()
    exp = RLTrainer(cfg).make_experience(samples)
    assert exp.ref_logprobs is None and "kl/reference" not in exp.metrics


@pytest.mark.parametrize(
    ("kernel", "reference_kernel", "rows"), [("sdpa", None, ONE_ROW), ("eager", None, 0), ("sdpa", "eager", 0)]
)
def test_micro_batches_are_one_row_where_every_model_computes_samples_apart(
    rl_model_dir, prompt_file, tmp_path, kernel, reference_kernel, rows
):
    """The tiny Qwen2 with sdpa attends within each packed sample (raylign_sdpa): a micro-batch is one row.
    An eager policy, or an eager reference beside an sdpa policy, keeps rows as long as the longest sample."""
    kl = {} if reference_kernel is None else {"kl_mode": "loss", "kl_coef": 0.05}  # a KL term reads the reference
    data = _config_data(rl_model_dir, prompt_file, tmp_path, **kl)
    data["model"]["attn_implementation"] = kernel
    if reference_kernel is not None:
        data["reference"] = {"path": str(rl_model_dir), "attn_implementation": reference_kernel}
    assert RLTrainer(resolve(tmp_path, data)).row_tokens == rows


@pytest.mark.slow
def test_with_a_kl_term_the_experience_carries_the_reference_logprobs(ray_session, rl_model_dir, prompt_file, tmp_path):
    """The reference is the initial policy: its log-probs are those of one fp32 forward per sample."""
    data = _config_data(rl_model_dir, prompt_file, tmp_path, kl_mode="loss", kl_coef=0.05)
    cfg = resolve(tmp_path, data)
    trainer = RLTrainer(cfg)
    trainer.groups = {"reference": WorkerGroup("reference", cfg.model_dump(mode="json"), 1, 1, None, env=ENV)}
    trainer.threads = {"reference": [1]}  # what setup() would decide with placement.threads_per_worker: 1
    samples = _samples()
    try:
        exp = trainer.make_experience(samples)
    finally:
        trainer.groups["reference"].kill()
    model = fp32_model(rl_model_dir)
    with torch.no_grad():
        for i, s in enumerate(samples):
            expected = response_logprobs(model, s.prompt_ids, s.response_ids)
            torch.testing.assert_close(exp.ref_logprobs[i, : len(s.response_ids)], expected, atol=1e-5, rtol=0)
    assert "kl/reference" in exp.metrics


def test_a_micro_batch_moves_to_a_device_whole():
    samples = [make_sample([1, 2], [3, 4, 5]), make_sample([6], [7])]
    batch = pack_samples(
        samples, {"advantages": torch.ones(2, 4), "rollout_logprobs": torch.zeros(2, 4)}, behaviour="engine"
    ).to("meta")
    assert batch.behaviour == "engine" and batch.advantages.shape == (2, 3)  # cut to the micro-batch's width
    assert all(t.device.type == "meta" for t in (batch.input_ids, batch.mask, batch.advantages))


# ---- metrics and their reductions -----------------------------------------------------------


def test_metrics_combine_as_they_say():
    # Token means of 2 and 6 tokens: (0.5 * 2 + 0.1 * 6) / 8 = 0.2; maxima the largest; shares add.
    parts = [
        {"clip": Metric(0.5, "mean", 2), "ratio_max": Metric(1.5, "max"), "loss": Metric(0.25, "sum")},
        {"clip": Metric(0.1, "mean", 6), "ratio_max": Metric(1.2, "max"), "loss": Metric(0.5, "sum")},
    ]
    one = combine(parts)
    assert one["clip"] == Metric(pytest.approx(0.2), "mean", 8)
    assert one["ratio_max"].value == 1.5 and one["loss"].value == 0.75
    # Over updates, a loss total is averaged: (0.75 + 0.25) / 2; a token mean stays token-weighted.
    other = {"clip": Metric(0.6, "mean", 2), "ratio_max": Metric(1.0, "max"), "loss": Metric(0.25, "sum")}
    step = average_updates([one, other])
    assert step == {"clip": pytest.approx((0.2 * 8 + 0.6 * 2) / 10), "ratio_max": 1.5, "loss": pytest.approx(0.5)}
    with pytest.raises(ValueError, match="clip"):
        combine([{"clip": Metric(0.5, "mean")}, {"clip": Metric(0.5, "max")}])


# Importance ratios old / rollout of each rank's micro-batches, one list per sample (rows of unequal
# length: the padding must not count). Within each micro-batch every ratio is equal.
RATIOS_BY_RANK = [
    [[[1.0, 1.0, 1.0], [1.0]], [[3.0, 3.0], [3.0, 3.0]]],
    [[[0.5, 0.5], [0.5]], [[2.0], [2.0, 2.0]]],
]


def _correction_batch(ratios: list[list[float]]):
    """A micro-batch whose ratio ``exp(old - rollout)`` at each response token is the given one."""
    samples = [make_sample([1, 2], list(range(3, 3 + len(row)))) for row in ratios]
    old = response_tensor([[math.log(r) - 1.0 for r in row] for row in ratios])
    rollout = response_tensor([[-1.0] * len(row) for row in ratios])
    return pack_samples(samples, {"old_logprobs": old, "rollout_logprobs": rollout}, behaviour="engine")


def _rank_metrics(micro_batches: list[list[list[float]]]) -> dict[str, Metric]:
    """One rank's metrics of an update, combined over its micro-batches as ``train_policy`` does."""
    correct = bind_off_policy_correction(AlgorithmConfig(off_policy="truncated_is", tis_cap=2.0))
    parts = []
    for ratios in micro_batches:
        batch = _correction_batch(ratios)
        parts.append(_correction_metrics(correct(batch)[2], batch))
    return combine(parts)


def _kish_fraction(ratios: list[float]) -> float:
    """``(sum rho)^2 / (N sum rho^2)``, written out."""
    return sum(ratios) ** 2 / (len(ratios) * sum(r * r for r in ratios))


def test_is_ess_fraction_is_that_of_all_the_tokens_of_the_micro_batches():
    # rank 0: 4 tokens of ratio 1 and 4 of ratio 3: (4 + 12)^2 / (8 (4 + 36)) = 0.8, not the
    # fraction 1 of either micro-batch.
    metric = _rank_metrics(RATIOS_BY_RANK[0])["is_ess_fraction"]
    assert metric.value == pytest.approx(0.8, rel=1e-6)


def test_is_ess_fraction_is_that_of_all_the_tokens_of_the_ranks_and_updates():
    per_rank = [_rank_metrics(micro_batches) for micro_batches in RATIOS_BY_RANK]
    pooled = [r for micro_batches in RATIOS_BY_RANK for ratios in micro_batches for row in ratios for r in row]
    expected = _kish_fraction(pooled)  # 14 tokens: 23.5^2 / (14 * 52.75) = 0.748
    assert expected == pytest.approx(552.25 / 738.5)
    update = combine(per_rank)  # the controller's combination of the ranks' answers
    assert update["is_ess_fraction"].value == pytest.approx(expected, rel=1e-6)
    # A second epoch over the same tokens (the ratios are fixed for the step) leaves the fraction alone.
    assert average_updates([update, update])["is_ess_fraction"] == pytest.approx(expected, rel=1e-6)


# ---- the logged losses -----------------------------------------------------------------------


def _perturbed_logprobs(model, samples) -> list[list[float]]:
    """The model's own log-probs shifted by up to +-0.3, so ratios reach past the clip range 1 +- 0.2."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        return [
            (lp + (torch.rand(lp.shape, generator=generator) - 0.5) * 0.6).tolist()
            for lp in (response_logprobs(model, s.prompt_ids, s.response_ids) for s in samples)
        ]


def _reference_policy_loss(model_dir, samples, old) -> float:
    """Token-mean PPO loss of the whole batch in one unpacked forward per sample:
    ``sum_it max(-A_i r_it, -A_i clip(r_it, 1 - eps, 1 + eps)) / N_tokens``, ``r = exp(logp - old)``."""
    model = fp32_model(model_dir)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for s, old_row, advantage in zip(samples, old, ADVANTAGES):
            ratio = torch.exp(response_logprobs(model, s.prompt_ids, s.response_ids) - torch.tensor(old_row))
            total += float(torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - CLIP, 1 + CLIP)).sum())
            tokens += len(s.response_ids)
    return total / tokens


@pytest.mark.slow
@pytest.mark.parametrize(
    ("micro_batch_tokens", "workers", "micro_batches"),
    [
        # 70 tokens in micro-batches of 24: 12+12, 10+10+3 and 8+6+9 (the whole batch in one micro-batch is
        # the reference these sums are checked against)
        pytest.param(24, 1, 3, id="3-micro-batches"),
        pytest.param(24, 2, 2, id="2-ranks-2-micro-batches"),
    ],
)
def test_logged_losses_are_the_whole_batch_losses_whatever_the_micro_batches(
    micro_batch_tokens, workers, micro_batches, ray_session, rl_model_dir, prompt_file, tmp_path
):
    """One update of a PPO policy and critic through the controller's ``update``, on a hand-made
    experience whose behaviour log-probs differ from the policy's (the ratio is not 1)."""
    data = _config_data(
        rl_model_dir, prompt_file, tmp_path, "ppo", aggregation="token_mean", clip_eps_low=CLIP, value_clip=0.2
    )
    data["train"].update(prompts_per_step=8, micro_batch_tokens=micro_batch_tokens)
    data["placement"] = {"policy_workers": workers, "critic_workers": workers}
    data["engine"] = {"backend": "fsdp2" if workers > 1 else "local", "dist_timeout_s": 120}
    cfg = resolve(tmp_path, data)
    trainer = RLTrainer(cfg)
    samples = _samples()
    dump = cfg.model_dump(mode="json")
    trainer.groups = {role: WorkerGroup(role, dump, workers, 1, None, env=ENV) for role in ("policy", "critic")}
    trainer.threads = {role: [1] * workers for role in trainer.groups}  # as setup() with threads_per_worker: 1
    try:
        old = _perturbed_logprobs(fp32_model(rl_model_dir), samples)
        values = trainer._forward_all("critic", "compute_values", samples)
        mask = response_tensor([[1.0] * len(s.response_ids) for s in samples])
        # Returns a fixed distance from the critic's values: at the first update V = V_old, the clip is
        # inactive and the value loss is 0.5 * sum_t delta_t^2 / N_tokens, whatever the critic computes.
        delta = torch.linspace(-1.0, 1.0, mask.numel()).reshape(mask.shape) * mask
        advantages = torch.tensor(ADVANTAGES).unsqueeze(-1) * mask
        versions = torch.zeros_like(mask, dtype=torch.long)
        exp = Experience(
            mask,
            advantages,
            values + delta,
            response_tensor(old),
            versions,
            "trainer_recomputed",
            old_logprobs=response_tensor(old),
            values=values,
        )
        shards = trainer._shard(samples, list(range(8)), exp, workers)
        assert [len(rank) for rank in shards] == [micro_batches] * workers
        metrics = trainer.update(samples, exp)
    finally:
        for group in trainer.groups.values():
            group.kill()
    assert metrics["policy/policy_loss"] == pytest.approx(_reference_policy_loss(rl_model_dir, samples, old), abs=1e-6)
    assert metrics["policy/policy_loss_total"] == pytest.approx(metrics["policy/policy_loss"], abs=1e-9)
    assert metrics["critic/value_loss"] == pytest.approx(0.5 * float(delta.square().sum() / mask.sum()), abs=1e-6)
    assert 0 < metrics["policy/clip_fraction"] < 1  # both branches of the clipped surrogate took part


@pytest.mark.slow
def test_engine_behaviour_takes_the_ratio_against_the_rollout_logprobs(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    """rollout = logp - d_t, old = logp: the ratio is exp(d_t) from the engine's log-probs (1 from old's)."""
    data = _config_data(rl_model_dir, prompt_file, tmp_path, aggregation="token_mean")
    group = WorkerGroup("policy", resolve(tmp_path, data).model_dump(mode="json"), 1, 1, None, env=ENV)
    try:
        samples = _samples()
        (logprobs,) = group.call("compute_logprobs", [pack_samples(samples)])[0]
        mask = response_tensor([[1.0] * len(s.response_ids) for s in samples])
        shift = torch.linspace(0.0, 0.3, mask.numel()).reshape(mask.shape) * mask
        per_token = {"advantages": mask.clone(), "rollout_logprobs": logprobs - shift, "old_logprobs": logprobs}
        (stats,) = group.call("train_policy", [pack_samples(samples, per_token, behaviour="engine")])
    finally:
        group.kill()
    counted = mask.bool()
    expected = torch.exp(shift[counted])
    assert stats["ratio_mean"].value == pytest.approx(float(expected.mean()), abs=1e-5)
    assert stats["ratio_max"].value == pytest.approx(float(expected.max()), abs=1e-5)
    assert stats["ratio_max"].reduce == "max" and stats["ratio_mean"].weight == float(counted.sum())
    assert math.isfinite(stats["policy_loss"].value)


@pytest.mark.slow
def test_an_update_with_a_non_finite_loss_is_skipped_on_every_rank(ray_session, rl_model_dir, prompt_file, tmp_path):
    """One sample's advantage is NaN, so one rank's micro-batch loss is: both ranks drop the update
    (the weights give the same log-probs as before, to the bit), the step is counted as skipped,
    and with ``train.max_skipped_steps: 0`` the controller stops naming the role."""
    data = _config_data(rl_model_dir, prompt_file, tmp_path, aggregation="token_mean")
    data["train"].update(prompts_per_step=8, micro_batch_tokens=24, max_skipped_steps=0)
    data["placement"] = {"policy_workers": 2}
    data["engine"] = {"backend": "fsdp2", "dist_timeout_s": 120}
    cfg = resolve(tmp_path, data)
    trainer = RLTrainer(cfg)
    trainer.skipped = SkippedSteps(cfg.train.max_skipped_steps)  # what setup() would make
    samples = _samples()
    trainer.groups = {"policy": WorkerGroup("policy", cfg.model_dump(mode="json"), 2, 1, None, env=ENV)}
    trainer.threads = {"policy": [1, 1]}  # what setup() would decide with placement.threads_per_worker: 1
    try:
        before = trainer._forward_all("policy", "compute_logprobs", samples)
        mask = response_tensor([[1.0] * len(s.response_ids) for s in samples])
        advantages = torch.tensor(ADVANTAGES).unsqueeze(-1) * mask
        advantages[5, 0] = float("nan")
        exp = Experience(
            mask,
            advantages,
            advantages.clone(),
            before,
            torch.zeros_like(mask, dtype=torch.long),
            "trainer_recomputed",
            old_logprobs=before,
        )
        metrics = trainer.update(samples, exp)
        after = trainer._forward_all("policy", "compute_logprobs", samples)
        advantages[5, 0] = -2.0
        finite = trainer.update(
            samples,
            Experience(
                mask, advantages, advantages.clone(), before, exp.versions, "trainer_recomputed", old_logprobs=before
            ),
        )
        moved = trainer._forward_all("policy", "compute_logprobs", samples)
    finally:
        trainer.groups["policy"].kill()
    assert metrics["policy/skipped"] == 1.0 and not math.isfinite(metrics["policy/grad_norm"])
    assert torch.equal(after, before)
    assert finite["policy/skipped"] == 0.0 and math.isfinite(finite["policy/grad_norm"])
    assert not torch.equal(moved, before)
    with pytest.raises(FloatingPointError, match=r"step 1: 100% of the policy updates skipped .*max_skipped_steps = 0"):
        trainer._count_skipped(metrics)
