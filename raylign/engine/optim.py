"""AdamW parameter groups, learning-rate schedules and global-norm gradient clipping.

Shared by every backend so that the same config gives the same update everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_update
from torch.optim.lr_scheduler import LambdaLR

from raylign.config.optim import OptimConfig
from raylign.engine.host_stash import HostStash


def is_no_decay_parameter(name: str, param: torch.Tensor) -> bool:
    """Biases and normalisation weights (any tensor with fewer than 2 dims) get no weight decay.

    Decaying a norm's gain pulls it towards zero, which shrinks activations rather than
    regularising; biases have too few entries to overfit.
    """
    return param.ndim < 2 or name.endswith(".bias")


def build_param_groups(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed matrices and undecayed biases/norms; frozen parameters left out."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in named_params:
        if not param.requires_grad:
            continue
        (no_decay if is_no_decay_parameter(name, param) else decay).append(param)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


# Devices with torch's fused AdamW kernel.
FUSED_ADAMW_DEVICES = frozenset({"cpu", "cuda"})


def torch_adamw(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.AdamW:
    """torch AdamW over ``groups``, with its fused kernel where every parameter is a floating-point tensor on
    a device that has one. The fused kernel updates each tensor in one vectorised pass where the default
    loops over the moments with separate ops: on one CPU thread it steps SmolLM2-135M's fp32 weights in
    0.085 s against 0.53 s, the memory traffic of one pass. Transformers' Trainer picks it by default too."""
    params = [p for g in groups for p in g["params"]]
    fused = all(p.is_floating_point() and p.device.type in FUSED_ADAMW_DEVICES for p in params)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None)


def build_adamw(named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch AdamW (decoupled weight decay, Loshchilov & Hutter 2019) over :func:`build_param_groups`;
    :class:`StochasticRoundingAdamW` when ``optim.master_weights`` is off (it updates bf16 weights in place).
    """
    groups = build_param_groups(named_params, cfg.weight_decay)
    if not cfg.master_weights:
        return StochasticRoundingAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    return torch_adamw(groups, cfg)


def stochastic_round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to one of its two neighbouring bf16 values at random, up with probability equal
    to how far ``x`` lies towards the upper one, so that ``E[round(x)] = x`` (Gupta et al. 2015).

    bf16 is the top 16 bits of fp32: adding a uniform integer in ``[0, 2^16)`` to the bit pattern and
    dropping the low 16 bits carries into the kept bits with exactly that probability, for either sign.
    """
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device)
    return ((bits + noise) & -(1 << 16)).view(torch.float32).to(torch.bfloat16)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds of an FSDP2 DTensor (sharing its storage), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW on bf16 weights without fp32 master copies (``optim.master_weights: false``).

    Each step runs torch's own AdamW arithmetic on an fp32 copy of one parameter at a time, with the
    moments kept in fp32, and writes the result back to the bf16 weight with
    :func:`stochastic_round_to_bf16`. With round-to-nearest an update smaller than half the weight's
    rounding step (about ``|w| / 256``) would be lost every time, so small learning rates would not
    train; rounded stochastically it survives in expectation, at the price of noise in each weight.
    fp32 parameters are updated exactly as by ``torch.optim.AdamW``.
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, with the moments kept in fp32: it casts every floating state tensor to its
        parameter's dtype, which for a bf16 weight would round them and fail the next step."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            for param, param_id in zip(group["params"], saved_group["params"]):
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in saved.get(param_id, {}):
                        self.state[param][key] = saved[param_id][key].to(param.device, torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("StochasticRoundingAdamW.step takes no closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                weight = _local(param)
                updated = weight.float()
                adamw_update(
                    [updated],
                    [_local(param.grad).float()],
                    [_local(state["exp_avg"])],
                    [_local(state["exp_avg_sq"])],
                    [],
                    [state["step"]],
                    foreach=False,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
                weight.copy_(stochastic_round_to_bf16(updated) if weight.dtype == torch.bfloat16 else updated)


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Factor applied to ``cfg.lr`` for optimizer step ``step`` (0-based).

    With ``W = warmup_steps``, ``T = total_steps`` and ``m = min_lr_ratio``:

    - warmup, ``step < W``:  ``(step + 1) / W``  (the first step already moves, the W-th reaches lr)
    - after, ``p = min(1, (step - W) / max(1, T - W))``:
        cosine: ``m + (1 - m) * (1 + cos(pi * p)) / 2``;  linear: ``1 - (1 - m) * p``;  constant: ``1``.
    """
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if cfg.scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = cfg.min_lr_ratio
    if cfg.scheduler == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_schedule(cfg: OptimConfig, total_steps: int) -> None:
    """Refuse a schedule that cannot run ``total_steps`` optimizer steps (a warm-up longer than the run)."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be at least 1 (got {total_steps})")
    if cfg.warmup_steps > total_steps:
        raise ValueError(f"optim.warmup_steps={cfg.warmup_steps} exceeds the run's total_steps={total_steps}")


def build_scheduler(optimizer: Any, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    """A ``LambdaLR`` of :func:`lr_multiplier`; step it once after each optimizer step."""
    check_schedule(cfg, total_steps)
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))


def global_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients together, ``sqrt(sum_i ||g_i||^2)``, across every shard.

    FSDP2 gradients are DTensor shards: their norm is a partial value that ``full_tensor``
    all-reduces, so each rank gets the norm of the whole model. With tensor parallelism the
    gradients live on two meshes (the 2-D one of the split matrices, the data-parallel one of
    the rest); each mesh's share is reduced on its own and the squares added.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = []
    for group in _by_mesh(grads).values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.stack([n.float() ** 2 for n in norms]).sum().sqrt()


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scale gradients by ``min(1, max_norm / (norm + 1e-6))``; returns the norm before clipping.

    ``max_norm <= 0`` only measures. Same rule as ``torch.nn.utils.clip_grad_norm_``.
    """
    params = list(params)
    norm = global_grad_norm(params)
    if max_norm > 0:
        for group in _by_mesh([p for p in params if p.grad is not None], lambda p: p.grad).values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)  # one mesh at a time (tensor parallel)
    return float(norm)


def _by_mesh(tensors: list[torch.Tensor], key: Any = lambda t: t) -> dict[Any, list[torch.Tensor]]:
    """``tensors`` grouped by the device mesh of ``key(tensor)`` (None for plain tensors): DTensor
    operations need all their operands on one mesh."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for tensor in tensors:
        value = key(tensor)
        groups.setdefault(value.device_mesh if isinstance(value, DTensor) else None, []).append(tensor)
    return groups


def current_lr(optimizer: Any) -> float:
    """The learning rate the next optimizer step will use (all groups share it)."""
    return float(optimizer.param_groups[0]["lr"])


def move_optimizer_state(
    optimizer: torch.optim.Optimizer, device: torch.device | str, stash: HostStash | None = None
) -> None:
    """Move AdamW moments to ``device`` (the ``step`` counters stay where torch keeps them); to the
    CPU through ``stash``'s pinned buffers where one is given."""
    device = torch.device(device)
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                state[key] = value.to(device) if stash is None else stash.move(f"optim.{index}.{key}", value, device)
