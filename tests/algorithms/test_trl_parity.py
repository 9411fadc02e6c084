"""Numerical parity with TRL on the same inputs.

TRL 1.x computes most of these quantities inside trainer methods (``_compute_loss``,
``_generate_and_score_completions``) rather than in standalone functions. Those methods are
called unbound with a ``types.SimpleNamespace`` as ``self`` that carries only the attributes
the method reads, a real tiny Llama (with TRL's own fused LM head) as the model and a real
``accelerate.Accelerator``. Static methods (GKD) are called directly. raylign computes the
same quantity from the same model's log-probs and must agree in value and gradient.
TRL is a test dependency; it is imported inside the tests only.
"""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from raylign.algorithms import (
    LossScale,
    compute_kl_loss,
    compute_ppo_policy_loss,
    compute_rloo_advantages,
    dpo_loss,
    generalized_jsd_loss,
    ipo_loss,
    kto_loss,
    last_token_positions,
    orpo_loss,
    simpo_loss,
)

# importing TRL's trainers (which import vLLM) takes 10-20 s on a 2-core machine; the checks themselves are fast
pytestmark = pytest.mark.slow

VOCAB = 48
PROMPT = 3


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def build_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    # TRL's trainers call `model(..., fused_lm_head=True)`; this is how TRL itself prepares its models
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"))
    return model.train()


@pytest.fixture(scope="module")
def model():
    return build_model(0)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """raylign side: log-prob of token t+1 from a plain forward, ``[batch, seq - 1]``."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def sequences(completion_lengths: list[int], seed: int):
    """Prompt of ``PROMPT`` tokens + completion, right-padded with 0; returns ids, attention and completion masks."""
    generator = torch.Generator().manual_seed(seed)
    width = PROMPT + max(completion_lengths)
    ids = torch.zeros(len(completion_lengths), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    completion = torch.zeros_like(ids)
    for row, length in enumerate(completion_lengths):
        ids[row, : PROMPT + length] = torch.randint(1, VOCAB, (PROMPT + length,), generator=generator)
        attention[row, : PROMPT + length] = 1
        completion[row, PROMPT : PROMPT + length] = 1
    return ids, attention, completion


def new_metrics():
    return defaultdict(lambda: defaultdict(list))


def grads(loss: torch.Tensor, model) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        g if g is not None else torch.zeros_like(p)
        for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)
    ]


def assert_same(trl_loss, our_loss, model, atol=1e-5):
    assert our_loss.item() == pytest.approx(trl_loss.item(), abs=atol, rel=1e-5)
    for ours, theirs in zip(grads(our_loss, model), grads(trl_loss, model), strict=True):
        assert torch.allclose(ours, theirs, atol=atol, rtol=1e-4), (ours - theirs).abs().max()


# ---------------------------------------------------------------- DPO (sigmoid) and IPO


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_and_ipo_match_trl(model, accelerator, loss_type):
    from trl import DPOTrainer

    ids, attention, completion = sequences([4, 2, 5, 3, 5, 1], seed=1)  # 3 chosen, then 3 rejected
    ref_chosen = torch.tensor([-14.0, -7.5, -18.0])
    ref_rejected = torch.tensor([-11.0, -16.0, -3.5])
    beta = 0.2
    # only the attributes DPOTrainer._compute_loss reads
    trainer = types.SimpleNamespace(
        model=model,
        accelerator=accelerator,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics=new_metrics(),
        _total_train_tokens=0,
        _tp_size=1,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
    )
    inputs = {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    trl_loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)

    sums = (token_logprobs(model, ids, attention) * completion[:, 1:]).sum(-1)
    chosen, rejected = sums.chunk(2)
    if loss_type == "sigmoid":
        ours, _ = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta)
    else:
        lengths_c, lengths_r = completion.sum(-1).chunk(2)
        ours, _ = ipo_loss(
            chosen, rejected, ref_chosen, ref_rejected, beta=beta, chosen_lengths=lengths_c, rejected_lengths=lengths_r
        )
    assert_same(trl_loss, ours, model)


# ---------------------------------------------------------------- KTO


def test_kto_matches_trl(model, accelerator):
    from trl import KTOTrainer

    ids, attention, completion = sequences([4, 2, 5, 3], seed=2)
    kl_ids, kl_attention, kl_completion = sequences([3, 5, 2, 4], seed=3)  # mismatched completions
    desirable = torch.tensor([True, False, True, False])
    ref_logps = torch.tensor([-15.0, -8.0, -20.0, -12.0])
    ref_kl_logps = torch.tensor([-13.0, -19.0, -6.0, -17.0])
    trainer = types.SimpleNamespace(
        model=model,
        accelerator=accelerator,
        calculate_KL=True,
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        loss_type="kto",
        beta=0.1,
        desirable_weight=1.0,
        undesirable_weight=1.33,
        _metrics=new_metrics(),
        _total_train_tokens=0,
        _tp_size=1,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
    )
    # the loss method calls this helper on `self`: bind TRL's own implementation
    trainer._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, trainer)
    inputs = {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "label": desirable,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": kl_attention,
        "KL_completion_mask": kl_completion,
        "ref_logps": ref_logps,
        "ref_KL_logps": ref_kl_logps,
    }
    trl_loss = KTOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)

    policy = (token_logprobs(model, ids, attention) * completion[:, 1:]).sum(-1)
    with torch.no_grad():
        policy_kl = (token_logprobs(model, kl_ids, kl_attention) * kl_completion[:, 1:]).sum(-1)
    ours, _ = kto_loss(
        policy,
        ref_logps,
        desirable,
        policy_kl_logps=policy_kl,
        ref_kl_logps=ref_kl_logps,
        beta=0.1,
        desirable_weight=1.0,
        undesirable_weight=1.33,
    )
    assert_same(trl_loss, ours, model)


# ---------------------------------------------------------------- SimPO (CPO trainer) and ORPO


def test_simpo_matches_trl_cpo_trainer(accelerator):
    from trl.experimental.cpo import CPOTrainer

    chosen = torch.tensor([-0.8, -1.9, -0.3, -2.5], requires_grad=True)  # average log-probs
    rejected = torch.tensor([-1.1, -1.2, -0.9, -2.0], requires_grad=True)
    trainer = types.SimpleNamespace(
        accelerator=accelerator,
        loss_type="simpo",
        beta=2.0,
        simpo_gamma=0.7,
        label_smoothing=0.1,
        cpo_alpha=0.0,
        alpha=0.0,
    )
    losses, _, _ = CPOTrainer.cpo_loss(trainer, chosen, rejected)
    ours, _ = simpo_loss(chosen, rejected, beta=2.0, gamma=0.7, label_smoothing=0.1)
    assert ours.item() == pytest.approx(losses.mean().item(), rel=1e-6)
    assert all(
        torch.allclose(a, b)
        for a, b in zip(
            torch.autograd.grad(ours, (chosen, rejected)), torch.autograd.grad(losses.mean(), (chosen, rejected))
        )
    )


def test_orpo_odds_ratio_term_matches_trl(accelerator):
    from trl.experimental.orpo import ORPOTrainer

    chosen = torch.tensor([-0.8, -1.9, -0.3, -2.5], requires_grad=True)  # average log-probs
    rejected = torch.tensor([-1.1, -1.2, -0.9, -2.0], requires_grad=True)
    trainer = types.SimpleNamespace(accelerator=accelerator, beta=0.25)
    odds_losses, *_ = ORPOTrainer.odds_ratio_loss(trainer, chosen, rejected)
    ours, metrics = orpo_loss(chosen, rejected, lam=0.25)
    # ORPO loss = NLL - lambda * mean(log sigma(log odds ratio)); TRL returns lambda * log sigma(...) per pair
    assert (ours - metrics["nll"]).item() == pytest.approx(-odds_losses.mean().item(), rel=1e-6)


# ---------------------------------------------------------------- GKD generalised JSD


@pytest.mark.parametrize(("beta", "temperature"), [(0.5, 1.0), (0.1, 2.0), (0.0, 1.0), (1.0, 0.7)])
def test_generalized_jsd_matches_trl_gkd(beta, temperature):
    from trl.experimental.gkd import GKDTrainer

    torch.manual_seed(7)
    student = torch.randn(3, 4, 11, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 4, 11, dtype=torch.float64)
    labels = torch.tensor([[5, 2, -100, -100], [-100, 1, 1, 3], [4, -100, 9, 9]])
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=temperature)
    ours, _ = generalized_jsd_loss(student, teacher, labels != -100, beta=beta, temperature=temperature)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-10)
    (g_ours,) = torch.autograd.grad(ours, student)
    (g_theirs,) = torch.autograd.grad(theirs, student)
    assert torch.allclose(g_ours, g_theirs, atol=1e-12)


# ---------------------------------------------------------------- GRPO loss types

GRPO_AGGREGATION = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dr_grpo": "constant_normalizer",
    "dapo": "token_mean",
}


@pytest.mark.parametrize("loss_type", sorted(GRPO_AGGREGATION))
def test_grpo_loss_types_match_trl(model, accelerator, loss_type):
    from trl import GRPOTrainer

    ids, attention, completion = sequences([5, 2, 4, 1], seed=4)
    prompt_ids, completion_ids = ids[:, :PROMPT], ids[:, PROMPT:]
    prompt_mask, completion_mask = attention[:, :PROMPT], completion[:, PROMPT:]
    with torch.no_grad():
        base = token_logprobs(model, ids, attention)[:, PROMPT - 1 :]
    generator = torch.Generator().manual_seed(5)
    old = base + 0.3 * torch.randn(base.shape, generator=generator)  # some ratios leave the clip range
    ref = base + 0.5 * torch.randn(base.shape, generator=generator)
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5])
    beta, max_completion_length = 0.04, 8
    num_items = completion_mask.sum() * 2  # a micro-batch holding half the step's tokens
    trainer = types.SimpleNamespace(
        model=model,
        accelerator=accelerator,
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        use_vllm=False,
        current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length,
        _entropy_bonus_enabled=False,
        _metrics=new_metrics(),
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
    )
    trainer._get_per_token_logps_and_entropies = types.MethodType(
        GRPOTrainer._get_per_token_logps_and_entropies, trainer
    )
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": num_items,
    }
    trl_loss = GRPOTrainer._compute_loss(trainer, model, inputs)

    logprobs = token_logprobs(model, ids, attention)[:, PROMPT - 1 :]
    scale = {
        "grpo": None,
        "bnpo": None,
        "dr_grpo": LossScale(max_response_length=max_completion_length),
        "dapo": LossScale(global_tokens=float(num_items)),
    }[loss_type]
    aggregation = GRPO_AGGREGATION[loss_type]
    policy, metrics = compute_ppo_policy_loss(
        logprobs,
        old,
        advantages,
        completion_mask,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        aggregation=aggregation,
        scale=scale,
    )
    kl, _ = compute_kl_loss(logprobs, ref, completion_mask, "k3", aggregation=aggregation, scale=scale)
    assert metrics["clip_fraction"].item() > 0  # the comparison exercises clipping
    assert_same(trl_loss, policy + beta * kl, model)


# ---------------------------------------------------------------- RLOO advantages


def test_rloo_advantages_match_trl(model, accelerator):
    from trl import RLOOTrainer

    group, beta = 3, 0.05
    ids, attention, completion = sequences([4, 2, 5, 3, 1, 4], seed=6)
    rewards = [1.0, 0.0, 0.5, 0.2, 0.2, 0.9]
    prompt_ids = [ids[i, :PROMPT].tolist() for i in range(6)]
    completion_ids = [ids[i, PROMPT:][completion[i, PROMPT:].bool()].tolist() for i in range(6)]
    ref_model = build_model(1)

    def fixed_rewards(prompts, completions, **kwargs):
        return rewards

    # the method generates first: return fixed samples instead of sampling (everything after is TRL's code)
    def fixed_generation(prompts):
        return prompt_ids, completion_ids, [f"completion {i}" for i in range(6)]

    trainer = types.SimpleNamespace(
        model=model,
        ref_model=ref_model,
        accelerator=accelerator,
        beta=beta,
        num_generations=group,
        _generate=fixed_generation,
        _tokenizer=types.SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        aux_loss_enabled=False,
        reward_funcs=[fixed_rewards],
        reward_processing_classes=[None],
        reward_func_names=["fixed"],
        reward_weights=torch.ones(1),
        reward_clip_range=None,
        normalize_advantages=False,
        state=types.SimpleNamespace(global_step=0),
        args=types.SimpleNamespace(per_device_train_batch_size=6, gradient_checkpointing_kwargs=None, report_to=[]),
        _metrics=new_metrics(),
        _pending_extra_logs=defaultdict(list),
        _pending_metrics=defaultdict(list),
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": defaultdict(list),
            "advantages": [],
            "extra": defaultdict(list),
        },
        log_multimodal=False,
    )
    for name in ("_get_per_token_logps_and_entropies", "_calculate_rewards", "_log_completion_extra", "_log_metric"):
        setattr(trainer, name, types.MethodType(getattr(RLOOTrainer, name), trainer))
    output = RLOOTrainer._generate_and_score_completions(
        trainer, [{"prompt": f"prompt {i // group}"} for i in range(6)]
    )

    with torch.no_grad():
        policy = token_logprobs(model, ids, attention)
        reference = token_logprobs(ref_model, ids, attention)
    # RLOO's sequence-level KL penalty (Ahmadian et al. 2024): r - beta * sum_t (log pi - log pi_ref)
    shaped = torch.tensor(rewards) - beta * ((policy - reference) * completion[:, 1:]).sum(-1)
    ours, _ = compute_rloo_advantages(shaped, completion, group_size=group)
    per_sequence = ours[torch.arange(6), last_token_positions(completion)]  # the same value on every token
    assert output["advantages"].abs().min() > 1e-3  # no group is degenerate
    assert torch.allclose(per_sequence, output["advantages"], atol=1e-5)
