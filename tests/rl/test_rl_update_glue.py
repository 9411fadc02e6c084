"""One RL step's update through the controller and its workers equals a plain single-process update.

The controller's ``update`` splits a hand-made experience into mini-batches (one optimizer step
each), every mini-batch over two data-parallel ranks and each rank's share into several packed
micro-batches. The reference here does what the papers write: per mini-batch one unpacked forward
per sample, the loss summed by hand from the formula, one ``torch.optim.AdamW`` step. The weights
after the step, and the logged metrics (loss, KL, entropy, clip fraction, gradient norm, value loss,
the off-policy correction's statistics), must be the reference's whatever the split; an agent
episode's environment tokens are context only, whatever per-token values they carry.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from raylign.rl.experience import Experience, response_mask, response_tensor
from raylign.rl.group import WorkerGroup
from raylign.rl.trainer import RLTrainer

from .rl_helpers import fp32_model, make_sample, resolve, rl_config_data, state_dict_of

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
WORKERS, MINI_BATCHES, MAX_TOKENS = 2, 2, 24
PPO_EPOCHS = 2
LR, CLIP, BETAS = 1e-2, 0.2, (0.9, 0.95)
KL_COEF, ENTROPY_COEF, VF_COEF, VALUE_CLIP = 0.5, 0.01, 0.5, 0.05
# eps above every gradient entry: Adam's step is then close to lr * g, so a gradient scaled wrongly
# (per micro-batch, per rank) moves the weights by a different amount (see test_rl_data_parallel).
ADAM_EPS = 1.0
# fp32 throughout; packing, micro-batches and the all-reduce change only the summation order.
WEIGHT_ATOL, METRIC_ABS = 1e-6, 1e-5
# 16 samples: two mini-batches of 8, each 4 per rank in 2 micro-batches of at most 24 tokens.
LENGTHS = [(3, 9), (5, 7), (2, 8), (4, 6), (6, 2), (3, 3), (5, 4), (2, 1)] * 2
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.75, -1.5, 0.75, 1.25, -0.25, 0.5, 1.0, -1.0, -0.5]
# Agent episodes: the environment's tokens inside a response (0) are context, never trained.
LOSS_MASKS = {0: [1, 1, 0, 0, 0, 1, 1, 1, 1], 3: [1, 0, 1, 1, 0, 1], 9: [1, 1, 1, 0, 0, 1, 1]}


def _samples(with_environment_tokens: bool = False) -> list:
    rng = random.Random(0)
    samples = [
        make_sample([rng.randrange(10, 500) for _ in range(p)], [rng.randrange(10, 500) for _ in range(r)])
        for p, r in LENGTHS
    ]
    for i, loss_mask in LOSS_MASKS.items() if with_environment_tokens else ():
        assert len(loss_mask) == len(samples[i].response_ids)
        samples[i].loss_mask = loss_mask
    return samples


def _trained(sample) -> torch.Tensor:
    """Which response tokens are the policy's (all but an episode's environment tokens)."""
    return torch.tensor(sample.loss_mask or [1] * len(sample.response_ids), dtype=torch.bool)


def _response_rows(logits: torch.Tensor, sample) -> torch.Tensor:
    """``log_softmax`` of the logits predicting each response token of an unpacked ``[T, V]`` forward."""
    start = len(sample.prompt_ids) - 1
    return torch.log_softmax(logits[start : start + len(sample.response_ids)].float(), dim=-1)


def _policy_terms(model, sample) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the sampled response tokens and the entropy ``-sum_v p log p`` before each (with graph)."""
    rows = _response_rows(model(torch.tensor([sample.prompt_ids + sample.response_ids])).logits[0], sample)
    logprobs = rows.gather(-1, torch.tensor(sample.response_ids).unsqueeze(-1)).squeeze(-1)
    return logprobs, -(rows.exp() * rows).sum(dim=-1)


def _shifted(model, samples, seed: int, spread: float) -> list[torch.Tensor]:
    """The model's own log-probs moved by up to ``+-spread / 2`` (old or reference log-probs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return [
            lp + (torch.rand(lp.shape, generator=generator) - 0.5) * spread
            for lp in (_policy_terms(model, s)[0] for s in samples)
        ]


def _grad_norm(params) -> float:
    return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params if p.grad is not None))


def _reference_grpo(model_dir, samples, old, ref, aggregation: str):
    """GRPO (Shao et al. 2024, eq. 3) with the k3 KL term and an entropy bonus, one AdamW step per mini-batch:

    ``l_it = max(-A_i r_it, -A_i clip(r_it, 1 - eps, 1 + eps)) + beta k3_it - c H_it``,
    ``r_it = exp(logp_it - old_it)``, ``k3 = ref/pi - 1 - log(ref/pi)``; ``token_mean``:
    ``sum_it l_it / N_tokens``; ``seq_mean_token_mean``: ``sum_i (sum_t l_it / |y_i|) / N_seq``.
    Returns the weights after the step and the step's metrics (mean over the mini-batches; token
    statistics weighted by the tokens of each)."""
    model = fp32_model(model_dir).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=ADAM_EPS, weight_decay=0.0)
    size = len(samples) // MINI_BATCHES
    sums = {"policy_loss": 0.0, "policy_loss_total": 0.0, "grad_norm": 0.0}
    token_sums = {"kl": 0.0, "entropy": 0.0, "clip_fraction": 0.0}
    all_tokens = 0
    for m in range(MINI_BATCHES):
        chosen = range(m * size, (m + 1) * size)
        tokens = sum(int(_trained(samples[i]).sum()) for i in chosen)
        pg_total, kl_total, entropy_total = torch.zeros(()), torch.zeros(()), torch.zeros(())
        for i in chosen:
            trained = _trained(samples[i])
            logprobs, entropy = (t[trained] for t in _policy_terms(model, samples[i]))
            advantage = ADVANTAGES[i]
            ratio = torch.exp(logprobs - old[i][trained])
            unclipped, clipped = -advantage * ratio, -advantage * ratio.clamp(1 - CLIP, 1 + CLIP)
            pg = torch.maximum(unclipped, clipped)
            log_ratio = logprobs - ref[i][trained]
            kl = torch.exp(-log_ratio) - 1 + log_ratio
            # each sequence weighs 1 / N_seq (its tokens 1 / |y_i| each), or each token 1 / N_tokens
            weight = 1 / (size * len(logprobs)) if aggregation == "seq_mean_token_mean" else 1 / tokens
            pg_total = pg_total + pg.sum() * weight
            kl_total = kl_total + kl.sum() * weight
            entropy_total = entropy_total + entropy.sum() * weight
            token_sums["kl"] += float(kl.detach().sum())
            token_sums["entropy"] += float(entropy.detach().sum())
            token_sums["clip_fraction"] += float((clipped > unclipped).sum())
        all_tokens += tokens
        loss = pg_total + KL_COEF * kl_total - ENTROPY_COEF * entropy_total
        loss.backward()
        sums["policy_loss"] += float(pg_total.detach())
        sums["policy_loss_total"] += float(loss.detach())
        sums["grad_norm"] += _grad_norm(model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    metrics = {k: v / MINI_BATCHES for k, v in sums.items()} | {k: v / all_tokens for k, v in token_sums.items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, metrics


def _config(model_dir, prompt_file, tmp_path, preset: str, epochs: int = 1, **algorithm):
    data = rl_config_data(model_dir, prompt_file, tmp_path / "run", preset)
    data["data"]["max_prompt_length"] = 8  # lets train.micro_batch_tokens go down to 8 + 16 tokens
    data["algorithm"] = {"clip_eps_low": CLIP, **algorithm}
    data["sampling"]["n"] = 4 if preset == "grpo" else 1
    data["train"].update(
        prompts_per_step=len(LENGTHS) // data["sampling"]["n"],
        mini_batches=MINI_BATCHES,
        ppo_epochs=epochs,
        micro_batch_tokens=MAX_TOKENS,
    )
    optim = {"lr": LR, "betas": list(BETAS), "eps": ADAM_EPS, "max_grad_norm": 0.0, "scheduler": "constant"}
    data["optim"] = dict(optim)
    if preset == "ppo":
        data["critic"] = {"optim": dict(optim)}
    data["placement"] = {"policy_workers": WORKERS, "critic_workers": WORKERS}
    data["engine"] = {"backend": "fsdp2", "dist_timeout_s": 120}
    return resolve(tmp_path, data)


def _trainer(cfg, roles) -> RLTrainer:
    trainer = RLTrainer(cfg)
    dump = cfg.model_dump(mode="json")
    trainer.groups = {role: WorkerGroup(role, dump, WORKERS, cfg.optimizer_steps, None, env=ENV) for role in roles}
    trainer.threads = {role: [1] * WORKERS for role in roles}  # as setup() with threads_per_worker: 1
    return trainer


def _max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# grpo's own aggregation, the one whose weights (1 / |y_i|) count trained tokens only; the policy-gradient,
# KL and entropy terms share it, and token_mean is checked below (the PPO step, truncated_is).
@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean"])
def test_a_grpo_step_over_mini_batches_ranks_and_micro_batches_is_the_plain_update(
    aggregation, ray_session, rl_model_dir, prompt_file, tmp_path
):
    cfg = _config(
        rl_model_dir,
        prompt_file,
        tmp_path,
        "grpo",
        aggregation=aggregation,
        kl_mode="loss",
        kl_estimator="k3",
        kl_coef=KL_COEF,
        entropy_coef=ENTROPY_COEF,
    )
    samples = _samples(with_environment_tokens=True)
    model = fp32_model(rl_model_dir)
    old = _shifted(model, samples, seed=1, spread=0.6)  # ratios past the clip range 1 +- 0.2
    ref = _shifted(model, samples, seed=2, spread=1.0)
    expected, expected_metrics = _reference_grpo(rl_model_dir, samples, old, ref, aggregation)
    assert _max_gap(expected, state_dict_of(rl_model_dir)) > 1e-4  # the step is large enough to tell

    mask = response_mask(samples)
    advantages = torch.tensor(ADVANTAGES).unsqueeze(-1) * response_tensor(
        [[1.0] * len(s.response_ids) for s in samples]
    )
    # At the environment's tokens the per-token inputs are nonsense: they must not count.
    environment = response_tensor([[float(not m) for m in _trained(s)] for s in samples]).bool()
    old_logprobs, ref_logprobs = response_tensor([o.tolist() for o in old]), response_tensor([r.tolist() for r in ref])
    old_logprobs[environment], ref_logprobs[environment], advantages[environment] = 3.0, -7.0, 100.0
    exp = Experience(
        mask,
        advantages,
        torch.zeros_like(mask),
        old_logprobs,
        torch.zeros_like(mask, dtype=torch.long),
        "trainer_recomputed",
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
    )
    trainer = _trainer(cfg, ["policy"])
    try:
        size = len(samples) // MINI_BATCHES
        shards = trainer._shard(samples, list(range(size)), exp, WORKERS)
        assert [len(rank) for rank in shards] == [2, 2]  # several micro-batches on every rank
        metrics = trainer.update(samples, exp)
        trainer.groups["policy"].call("export_hf", str(tmp_path / "export"))
    finally:
        trainer.groups["policy"].kill()

    assert _max_gap(state_dict_of(tmp_path / "export"), expected) <= WEIGHT_ATOL
    for name, value in expected_metrics.items():
        assert metrics[f"policy/{name}"] == pytest.approx(value, abs=METRIC_ABS, rel=1e-5), name
    assert 0 < metrics["policy/clip_fraction"] < 1


def _critic_rows(critic, sample) -> torch.Tensor:
    """The critic's ``V(s_t)`` of the state before each response token, from one unpacked forward."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    hidden = critic.model(input_ids=ids).last_hidden_state[0]
    start = len(sample.prompt_ids) - 1
    return critic.score(hidden[start : start + len(sample.response_ids)]).squeeze(-1).float()


def _reference_ppo(model_dir, critic_dir, samples, old, returns):
    """PPO (Schulman et al. 2017) with a clipped value loss, one AdamW step of each model per mini-batch
    and epoch (``V_old`` and ``pi_old`` stay those before the first):
    policy ``sum_it max(-A_it r_it, -A_it clip(r_it)) / N_tokens``; critic
    ``vf_coef * sum_it 0.5 max((V - R)^2, (V_old + clip(V - V_old, -e, e) - R)^2) / N_tokens``."""
    from transformers import AutoModelForSequenceClassification

    policy = fp32_model(model_dir).train()
    critic = AutoModelForSequenceClassification.from_pretrained(str(critic_dir), dtype=torch.float32).train()
    with torch.no_grad():
        old_values = [_critic_rows(critic, s) for s in samples]
    optimizers = [
        torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS, eps=ADAM_EPS, weight_decay=0.0) for m in (policy, critic)
    ]
    size = len(samples) // MINI_BATCHES
    sums = {"policy_loss": 0.0, "grad_norm": 0.0, "value_loss": 0.0, "critic_grad_norm": 0.0}
    clipped_values, all_tokens = 0.0, 0
    for m in [m for _ in range(PPO_EPOCHS) for m in range(MINI_BATCHES)]:
        chosen = range(m * size, (m + 1) * size)
        tokens = sum(len(samples[i].response_ids) for i in chosen)
        pg_total, value_total = torch.zeros(()), torch.zeros(())
        for i in chosen:
            ratio = torch.exp(_policy_terms(policy, samples[i])[0] - old[i])
            advantage = returns[i] - old_values[i]
            pg_total = pg_total + torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - CLIP, 1 + CLIP)).sum()
            v = _critic_rows(critic, samples[i])
            v_clipped = old_values[i] + (v - old_values[i]).clamp(-VALUE_CLIP, VALUE_CLIP)
            unclipped, clipped = (v - returns[i]).square(), (v_clipped - returns[i]).square()
            value_total = value_total + 0.5 * torch.maximum(unclipped, clipped).sum()
            clipped_values += float((clipped > unclipped).sum())
        all_tokens += tokens
        (pg_total / tokens).backward()
        (VF_COEF * value_total / tokens).backward()
        sums["policy_loss"] += float(pg_total.detach()) / tokens
        sums["value_loss"] += float(value_total.detach()) / tokens
        sums["grad_norm"] += _grad_norm(policy.parameters())
        sums["critic_grad_norm"] += _grad_norm(critic.parameters())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    updates = MINI_BATCHES * PPO_EPOCHS
    metrics = {k: v / updates for k, v in sums.items()} | {"value_clip_fraction": clipped_values / all_tokens}
    weights = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in (policy, critic)]
    return weights, old_values, metrics


def test_a_ppo_step_with_a_critic_over_epochs_mini_batches_ranks_and_micro_batches_is_the_plain_update(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    cfg = _config(
        rl_model_dir,
        prompt_file,
        tmp_path,
        "ppo",
        PPO_EPOCHS,
        kl_mode="none",
        kl_coef=0.0,
        vf_coef=VF_COEF,
        value_clip=VALUE_CLIP,
    )
    samples = _samples()
    old = _shifted(fp32_model(rl_model_dir), samples, seed=1, spread=0.6)
    generator = torch.Generator().manual_seed(3)
    returns = [torch.randn(len(s.response_ids), generator=generator) * 0.5 for s in samples]
    trainer = _trainer(cfg, ["policy", "critic"])
    try:
        trainer.groups["critic"].call("export_hf", str(tmp_path / "critic-before"))
        values = trainer._forward_all("critic", "compute_values", samples)
        (policy_weights, critic_weights), old_values, expected = _reference_ppo(
            rl_model_dir, tmp_path / "critic-before", samples, old, returns
        )
        for i, s in enumerate(samples):  # the critic's values are those of the state before each token
            torch.testing.assert_close(values[i, : len(s.response_ids)], old_values[i], atol=1e-5, rtol=0)
        mask = response_tensor([[1.0] * len(s.response_ids) for s in samples])
        returns_tensor = response_tensor([r.tolist() for r in returns])
        exp = Experience(
            mask,
            returns_tensor - values,
            returns_tensor,
            response_tensor([o.tolist() for o in old]),
            torch.zeros_like(mask, dtype=torch.long),
            "trainer_recomputed",
            old_logprobs=response_tensor([o.tolist() for o in old]),
            values=values,
        )
        metrics = trainer.update(samples, exp)
        trainer.groups["policy"].call("export_hf", str(tmp_path / "policy-after"))
        trainer.groups["critic"].call("export_hf", str(tmp_path / "critic-after"))
    finally:
        for group in trainer.groups.values():
            group.kill()

    from transformers import AutoModelForSequenceClassification

    critic_after = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "critic-after"))
    assert _max_gap(state_dict_of(tmp_path / "policy-after"), policy_weights) <= WEIGHT_ATOL
    assert _max_gap({k: v.float() for k, v in critic_after.state_dict().items()}, critic_weights) <= WEIGHT_ATOL
    assert metrics["policy/policy_loss"] == pytest.approx(expected["policy_loss"], abs=METRIC_ABS)
    assert metrics["policy/grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert metrics["critic/value_loss"] == pytest.approx(expected["value_loss"], abs=METRIC_ABS)
    assert metrics["critic/grad_norm"] == pytest.approx(expected["critic_grad_norm"], rel=1e-5)
    assert metrics["critic/value_clip_fraction"] == pytest.approx(expected["value_clip_fraction"], abs=1e-6)
    assert 0 < metrics["critic/value_clip_fraction"] < 1


TIS_CAP, MASK_LOW, MASK_HIGH = 2.0, 0.5, 2.0
OUT_OF_RANGE = (7, 15)  # one-token samples whose every ratio rho lies above the mask's range


def _rollout_logprobs(old: list[torch.Tensor]) -> list[torch.Tensor]:
    """Engine log-probs: ``rho = exp(old - rollout)`` spread over [e^-1, e^1] (past the cap and the mask
    range at both ends), and about 5 on the samples ``OUT_OF_RANGE``."""
    generator = torch.Generator().manual_seed(5)
    rollout = [o - (torch.rand(o.shape, generator=generator) * 2 - 1) for o in old]
    for i in OUT_OF_RANGE:
        rollout[i] = old[i] - 1.6
    return rollout


def _reference_corrected(model_dir, samples, old, rollout, correction: str):
    """PPO with the trainer-vs-engine correction, ``rho_t = exp(old_t - rollout_t)``, one AdamW step per
    mini-batch. ``truncated_is`` (token mean): ``sum_it min(rho_it, C) l_it / N_tokens``; ``ratio_mask``
    (sequence mean of token means): the tokens with ``rho`` outside ``[low, high]`` left out, and the
    sequences left without tokens not counted: ``sum_i (sum_{t kept} l_it / |kept_i|) / N_seq_kept``."""
    model = fp32_model(model_dir).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=ADAM_EPS, weight_decay=0.0)
    size = len(samples) // MINI_BATCHES
    policy_loss, weights, capped, masked, mismatch_kl, tokens_all = 0.0, 0.0, 0.0, 0.0, 0.0, 0
    for m in range(MINI_BATCHES):
        chosen = list(range(m * size, (m + 1) * size))
        rho = {i: torch.exp(old[i] - rollout[i]) for i in chosen}
        kept = {i: (rho[i] >= MASK_LOW) & (rho[i] <= MASK_HIGH) for i in chosen}
        tokens = sum(len(samples[i].response_ids) for i in chosen)
        sequences = sum(bool(kept[i].any()) for i in chosen)
        total = torch.zeros(())
        for i in chosen:
            ratio = torch.exp(_policy_terms(model, samples[i])[0] - old[i])
            advantage = ADVANTAGES[i]
            token_loss = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - CLIP, 1 + CLIP))
            if correction == "truncated_is":
                total = total + (rho[i].clamp(max=TIS_CAP) * token_loss).sum() / tokens
            elif kept[i].any():
                total = total + token_loss[kept[i]].sum() / int(kept[i].sum()) / sequences
            weights += float(rho[i].clamp(max=TIS_CAP).sum())
            capped += float((rho[i] > TIS_CAP).sum())
            masked += float((~kept[i]).sum())
            mismatch_kl += float((rho[i] - 1 - rho[i].log()).sum())
        tokens_all += tokens
        total.backward()
        policy_loss += float(total.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    metrics = {"policy_loss": policy_loss / MINI_BATCHES, "mismatch_kl": mismatch_kl / tokens_all}
    if correction == "truncated_is":
        metrics |= {"is_weight_mean": weights / tokens_all, "is_capped_fraction": capped / tokens_all}
    else:
        metrics["is_masked_fraction"] = masked / tokens_all
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, metrics


@pytest.mark.parametrize(
    ("correction", "aggregation"), [("truncated_is", "token_mean"), ("ratio_mask", "seq_mean_token_mean")]
)
def test_an_off_policy_correction_over_mini_batches_and_ranks_is_the_plain_corrected_update(
    correction, aggregation, ray_session, rl_model_dir, prompt_file, tmp_path
):
    cfg = _config(
        rl_model_dir,
        prompt_file,
        tmp_path,
        "grpo",
        aggregation=aggregation,
        kl_mode="none",
        kl_coef=0.0,
        off_policy=correction,
        tis_cap=TIS_CAP,
        mask_low=MASK_LOW,
        mask_high=MASK_HIGH,
    )
    samples = _samples()
    old = _shifted(fp32_model(rl_model_dir), samples, seed=1, spread=0.6)
    rollout = _rollout_logprobs(old)
    expected, expected_metrics = _reference_corrected(rl_model_dir, samples, old, rollout, correction)
    mask = response_tensor([[1.0] * len(s.response_ids) for s in samples])
    exp = Experience(
        mask,
        torch.tensor(ADVANTAGES).unsqueeze(-1) * mask,
        torch.zeros_like(mask),
        response_tensor([r.tolist() for r in rollout]),
        torch.zeros_like(mask, dtype=torch.long),
        "trainer_recomputed",
        old_logprobs=response_tensor([o.tolist() for o in old]),
    )
    trainer = _trainer(cfg, ["policy"])
    try:
        metrics = trainer.update(samples, exp)
        trainer.groups["policy"].call("export_hf", str(tmp_path / "export"))
    finally:
        trainer.groups["policy"].kill()

    assert _max_gap(state_dict_of(tmp_path / "export"), expected) <= WEIGHT_ATOL
    for name, value in expected_metrics.items():
        assert metrics[f"policy/{name}"] == pytest.approx(value, abs=METRIC_ABS, rel=1e-5), name
