"""bf16 training without fp32 master weights (``optim.master_weights: false``): stochastic rounding.

Expected values come from torch's own AdamW on fp32 copies and from the rounding rule worked out by
hand: bf16 keeps the top 16 bits of fp32, so near 1.0 its step is 2^-7.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from raylign.config.engine import EngineConfig
from raylign.config.optim import OptimConfig
from raylign.engine import create_engine
from raylign.engine.optim import StochasticRoundingAdamW, stochastic_round_to_bf16

from .engine_testing import local_cfg, tiny_model, token_batch

REPO = Path(__file__).resolve().parents[2]
STEP_AT_ONE = 2.0**-7  # bf16 spacing on [1, 2)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9])
def test_stochastic_rounding_picks_a_neighbour_with_the_probability_of_its_distance(sign, fraction):
    torch.manual_seed(0)
    n = 200_000
    x = torch.full((n,), sign * (1.0 + (3 + fraction) * STEP_AT_ONE))
    rounded = stochastic_round_to_bf16(x).float()
    low, high = sign * (1.0 + 3 * STEP_AT_ONE), sign * (1.0 + 4 * STEP_AT_ONE)
    away = (rounded == high).float().mean().item()
    assert bool(((rounded == low) | (rounded == high)).all())
    if fraction == 0.0:
        assert away == 0.0  # representable values are kept exactly
    else:
        sigma = (fraction * (1 - fraction) / n) ** 0.5
        assert abs(away - fraction) < 5 * sigma
        assert abs(rounded.mean().item() - x[0].item()) < 5 * sigma * STEP_AT_ONE  # unbiased


def test_fp32_parameters_are_updated_exactly_as_by_torch_adamw():
    model = tiny_model()
    reference = copy.deepcopy(model)
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    ours = StochasticRoundingAdamW([{"params": list(model.parameters()), "weight_decay": 0.1}], **kwargs)
    theirs = torch.optim.AdamW([{"params": list(reference.parameters()), "weight_decay": 0.1}], **kwargs)
    for seed in range(3):
        ids = token_batch(seed)
        for m, opt in ((model, ours), (reference, theirs)):
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_bf16_update_below_resolution_survives_on_average_where_round_to_nearest_loses_it():
    """A first AdamW step moves each weight by lr * sign(g); lr = 1e-4 is 1/78 of bf16's step at 1.0.
    Rounded to nearest, no weight moves; rounded stochastically, one in 78 moves a full step, so the
    mean moves by lr (the fp32 reference's move), within five standard errors."""
    n, lr = 1 << 20, 1e-4
    start = (1.0 + torch.rand(n, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    grad = torch.ones(n, dtype=torch.bfloat16)

    def one_step(weight: torch.Tensor, optimizer_class: type) -> torch.Tensor:
        param = torch.nn.Parameter(weight.clone())
        optimizer = optimizer_class([param], lr=lr, weight_decay=0.0)
        param.grad = grad.to(param.dtype)
        optimizer.step()
        return param.detach().float()

    torch.manual_seed(0)
    fp32_move = (one_step(start.float(), torch.optim.AdamW) - start.float()).mean().item()
    stochastic_move = one_step(start, StochasticRoundingAdamW) - start.float()
    nearest_move = one_step(start, torch.optim.AdamW) - start.float()
    assert fp32_move == pytest.approx(-lr, rel=1e-3)
    assert nearest_move.abs().max().item() == 0.0
    standard_error = stochastic_move.std().item() / n**0.5
    assert abs(stochastic_move.mean().item() - fp32_move) < 5 * standard_error
    assert standard_error < 0.02 * lr  # the check above is tight


def engine_bytes(engine) -> int:
    """Bytes of weights, fp32 masters and optimizer moments the engine keeps between steps."""
    tensors = list(engine.module.parameters())
    if engine.master is not None:
        tensors += engine.master.masters
    for state in engine.optimizer.state.values():
        tensors += [v for k, v in state.items() if k != "step"]
    return sum(t.numel() * t.element_size() for t in tensors)


def fixed_batch_losses(engine, steps: int = 30) -> list[float]:
    """The loss before each of ``steps`` updates on one fixed batch."""
    ids = token_batch(5, batch=4, length=16)
    losses = []
    for _ in range(steps):
        loss = engine.module(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses


def test_local_engine_without_masters_keeps_bf16_weights_fp32_moments_and_learns():
    """Between steps: bf16 weight 2 + fp32 master 4 + two fp32 moments 8 = 14 bytes per parameter with
    masters, 10 without. On one fixed batch both runs bring the loss down alike."""
    results = {}
    for master_weights in (True, False):
        torch.manual_seed(0)
        model = tiny_model(dtype=torch.bfloat16)
        cfg = OptimConfig(lr=3e-3, scheduler="constant", max_grad_norm=1.0, master_weights=master_weights)
        engine = create_engine(model, local_cfg(), cfg, total_steps=30)
        losses = fixed_batch_losses(engine)
        n_params = sum(p.numel() for p in model.parameters())
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        results[master_weights] = (losses, engine_bytes(engine) / n_params)
    (with_masters, bytes_with), (without, bytes_without) = results[True], results[False]
    assert bytes_with == 14 and bytes_without == 10
    assert without[0] == with_masters[0]
    assert without[-1] < 0.8 * without[0]
    assert without[-1] == pytest.approx(with_masters[-1], rel=0.05)


def test_a_resumed_run_without_masters_gets_its_fp32_moments_back_exactly(tmp_path):
    # torch's Optimizer.load_state_dict casts state to each parameter's dtype: bf16 moments would be
    # rounded (about 3e-3) and the next step would fail on an fp32 gradient against them.
    cfg = OptimConfig(lr=3e-3, scheduler="constant", master_weights=False)
    torch.manual_seed(0)
    engine = create_engine(tiny_model(dtype=torch.bfloat16), local_cfg(), cfg, total_steps=10)
    fixed_batch_losses(engine, steps=2)
    engine.save_checkpoint(tmp_path / "ckpt", {})
    saved = {name: copy.deepcopy(state) for name, state in engine.optimizer.state.items()}

    torch.manual_seed(1)
    resumed = create_engine(tiny_model(dtype=torch.bfloat16), local_cfg(), cfg, total_steps=10)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for state, before in zip(resumed.optimizer.state.values(), saved.values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.float32
            assert torch.equal(state[key], before[key])
    fixed_batch_losses(resumed, steps=1)  # and it steps


def test_deepspeed_refuses_to_drop_master_weights_naming_the_setting():
    with pytest.raises(ValueError, match="optim.master_weights: false needs engine.backend 'local' or 'fsdp2'"):
        create_engine(
            tiny_model(dtype=torch.bfloat16),
            EngineConfig(backend="deepspeed"),
            OptimConfig(lr=1e-3, master_weights=False),
            total_steps=1,
        )


FSDP2_SCRIPT = """
import torch
from torch.distributed.tensor import DTensor
from raylign.config.engine import EngineConfig
from raylign.config.optim import OptimConfig
from raylign.engine import create_engine
from tests.engine.engine_testing import tiny_model
from tests.engine.test_engine_no_master_weights import fixed_batch_losses

engine = create_engine(
    tiny_model(dtype=torch.bfloat16),
    EngineConfig(backend="fsdp2"),
    OptimConfig(lr=3e-3, scheduler="constant", master_weights=False),
    total_steps=30,
)
losses = fixed_batch_losses(engine)
params = list(engine.module.parameters())
assert all(isinstance(p, DTensor) and p.dtype == torch.bfloat16 for p in params)
moments = [v for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"]
assert moments and all(isinstance(m, DTensor) and m.dtype == torch.float32 for m in moments)
print("LOSSES", losses[0], losses[-1])
"""


def test_fsdp2_without_masters_keeps_bf16_shards_and_learns():
    """In its own process (FSDP2 creates a one-rank process group)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FSDP2_SCRIPT)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, last = (float(x) for x in done.stdout.split("LOSSES")[1].split())
    assert last < 0.8 * first
