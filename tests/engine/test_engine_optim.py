"""Learning-rate schedules, AdamW parameter groups and gradient clipping against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from raylign.config.optim import OptimConfig
from raylign.engine.optim import build_param_groups, build_scheduler, clip_grad_norm, lr_multiplier

from .engine_testing import tiny_model


def lrs_over_steps(cfg: OptimConfig, total_steps: int) -> list[float]:
    """The learning rate each optimizer step uses, read off a real optimizer driven by the scheduler."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    seen = []
    for _ in range(total_steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_cosine_schedule_with_warmup_matches_hand_values():
    cfg = OptimConfig(lr=2.0, warmup_steps=2, scheduler="cosine", min_lr_ratio=0.1)
    # warmup: (s+1)/2; then p = (s-2)/8 and factor 0.1 + 0.45 * (1 + cos(pi p))
    expected_factor = {
        0: 0.5,
        1: 1.0,
        2: 1.0,
        4: 0.1 + 0.45 * (1 + 0.70710678),  # p = 1/4
        6: 0.55,  # p = 1/2
        9: 0.1 + 0.45 * (1 - 0.92387953),  # p = 7/8
    }
    seen = lrs_over_steps(cfg, total_steps=10)
    for step, factor in expected_factor.items():
        assert seen[step] == pytest.approx(2.0 * factor, rel=1e-7), f"step {step}"


def test_linear_schedule_reaches_min_ratio_at_total_steps():
    cfg = OptimConfig(lr=1.0, warmup_steps=0, scheduler="linear", min_lr_ratio=0.2)
    seen = lrs_over_steps(cfg, total_steps=5)
    # p = s/5, factor 1 - 0.8 p
    assert seen == pytest.approx([1.0, 0.84, 0.68, 0.52, 0.36], rel=1e-12)
    assert lr_multiplier(5, cfg, 5) == pytest.approx(0.2)
    assert lr_multiplier(50, cfg, 5) == pytest.approx(0.2)  # stays at the floor past the end


def test_constant_schedule_only_warms_up():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, scheduler="constant")
    assert lrs_over_steps(cfg, total_steps=6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_scheduler_rejects_warmup_longer_than_run():
    with pytest.raises(ValueError, match="warmup_steps=8 exceeds the run's total_steps=5"):
        build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), OptimConfig(warmup_steps=8), 5)


def test_biases_and_norms_get_no_weight_decay_and_frozen_params_are_left_out():
    model = tiny_model()
    model.model.embed_tokens.weight.requires_grad_(False)
    groups = build_param_groups(model.named_parameters(), weight_decay=0.1)
    ids = {g["weight_decay"]: {id(p) for p in g["params"]} for g in groups}
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = sorted(names[i] for i in ids[0.0])
    decay = sorted(names[i] for i in ids[0.1])
    assert "model.layers.0.self_attn.q_proj.bias" in no_decay
    assert "model.layers.0.input_layernorm.weight" in no_decay
    assert "model.norm.weight" in no_decay
    assert "model.layers.1.mlp.down_proj.weight" in decay
    assert "lm_head.weight" in decay
    assert all(p.ndim < 2 for g in groups if g["weight_decay"] == 0.0 for p in g["params"])
    assert "model.embed_tokens.weight" not in no_decay + decay


def test_clip_grad_norm_reports_global_norm_and_scales_to_max():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1, 2))
    a.grad = torch.tensor([3.0, 0.0])
    b.grad = torch.tensor([[0.0, 4.0]])
    norm = clip_grad_norm([a, b], max_norm=1.0)
    assert norm == pytest.approx(5.0)  # sqrt(3^2 + 4^2)
    scale = 1.0 / (5.0 + 1e-6)
    torch.testing.assert_close(a.grad, torch.tensor([3.0 * scale, 0.0]))
    torch.testing.assert_close(b.grad, torch.tensor([[0.0, 4.0 * scale]]))


def test_clip_grad_norm_leaves_small_gradients_and_zero_disables():
    a = torch.nn.Parameter(torch.zeros(3))
    a.grad = torch.tensor([1.0, 2.0, 2.0])
    assert clip_grad_norm([a], max_norm=10.0) == pytest.approx(3.0)
    assert clip_grad_norm([a], max_norm=0.0) == pytest.approx(3.0)
    torch.testing.assert_close(a.grad, torch.tensor([1.0, 2.0, 2.0]))
    assert math.isclose(clip_grad_norm([torch.nn.Parameter(torch.zeros(1))], 1.0), 0.0)


def test_cosine_last_step_as_the_min_lr_ratio_description_says():
    # min_lr_ratio's description quotes this figure: cosine over 7 steps, ratio 0.1, no warm-up.
    cfg = OptimConfig(lr=1.0, warmup_steps=0, scheduler="cosine", min_lr_ratio=0.1)
    last = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 6 / 7))
    assert lr_multiplier(6, cfg, 7) == pytest.approx(last, rel=1e-12)
    assert round(last, 3) == 0.145
    assert "0.145 * lr" in OptimConfig.model_fields["min_lr_ratio"].description
