"""Single-process backend: the plain model, torch AdamW, no sharding.

For laptops, tests and small models. A bf16 (or fp16) model keeps its low-precision weights for
the forward pass, but the optimizer updates fp32 master copies that are copied back after each
step: without them an AdamW update smaller than the weight's rounding step (about
``|w| / 256`` in bf16) would be lost, and small learning rates would not train at all. Each
``backward``'s gradients move into the masters' fp32 gradients, which sum the micro-batches as
fsdp2's fp32 shards and DeepSpeed's fp32 gradients do (in bf16, 32 micro-batches were 0.56% off). With
``optim.master_weights: false`` there are no copies: the optimizer rounds each update into the bf16
weights stochastically (:class:`~raylign.engine.optim.StochasticRoundingAdamW`).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from raylign.config.engine import EngineConfig
from raylign.config.optim import OptimConfig
from raylign.engine.base import TrainEngine, floating_dtype
from raylign.engine.distributed import select_device
from raylign.engine.host_stash import HostStash
from raylign.engine.optim import build_adamw, build_scheduler, clip_grad_norm, move_optimizer_state
from raylign.models.loading import dequantized_state_dict, is_quantized

ENGINE_STATE_FILE = "engine_state.pt"


class Fp32MasterWeights:
    """fp32 copies of low-precision trainable parameters; the optimizer works on the copies."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
        self.model_params = [p for _, p in named_params]
        self.named_masters = [
            (name, torch.nn.Parameter(p.detach().float().clone(), requires_grad=True)) for name, p in named_params
        ]
        self.masters = [m for _, m in self.named_masters]

    def accumulate_grads(self) -> None:
        """Add the model's gradients of the last backward to the masters' and clear them: summed over
        micro-batches in bf16, every addition would round to 8 significant bits."""
        for master, param in zip(self.masters, self.model_params, strict=True):
            if param.grad is None:
                continue
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

    def push_weights(self) -> None:
        with torch.no_grad():
            for master, param in zip(self.masters, self.model_params, strict=True):
                param.copy_(master)

    def to(self, device: torch.device, stash: HostStash) -> None:
        """The masters to ``device``; to the CPU through ``stash``'s pinned buffers."""
        for name, master in self.named_masters:
            master.data = stash.move(f"master.{name}", master.data, device)


class LocalEngine(TrainEngine):
    """One process; ``engine_cfg`` sharding fields do not apply and are ignored."""

    backend_name = "local"

    def __init__(
        self, model: torch.nn.Module, engine_cfg: EngineConfig, optim_cfg: OptimConfig, total_steps: int
    ) -> None:
        self.rank, self.world_size = 0, 1
        self.device = select_device()
        self.model_dtype = floating_dtype(model)
        self.max_grad_norm = optim_cfg.max_grad_norm
        self.module = model.to(self.device)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        with_master = self.model_dtype != torch.float32 and optim_cfg.master_weights
        self.master = Fp32MasterWeights(trainable) if with_master else None
        self.optimizer = build_adamw(self.master.named_masters if self.master else trainable, optim_cfg)
        self.scheduler = build_scheduler(self.optimizer, optim_cfg, total_steps)
        self.stash = HostStash()  # pinned host memory for offload(), on GPUs

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.master is not None:
            self.master.accumulate_grads()

    def _trainable_params(self) -> list[torch.Tensor]:
        if self.master is not None:
            return self.master.masters
        return [p for p in self.module.parameters() if p.requires_grad]

    def _clip_and_update(self, max_grad_norm: float, update: bool) -> tuple[float, bool]:
        grad_norm = clip_grad_norm(self._trainable_params(), max_grad_norm)
        update = update and math.isfinite(grad_norm)
        if update:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if update and self.master is not None:
            self.master.push_weights()
        return grad_norm, update

    def _save_engine_state(self, directory: Path) -> None:
        state = {"model": self._model_state(), "optimizer": self.optimizer.state_dict()}
        if self.master is not None:
            state["master"] = [m.detach() for m in self.master.masters]
        torch.save(state, directory / ENGINE_STATE_FILE)

    def _load_engine_state(self, directory: Path) -> None:
        state = torch.load(directory / ENGINE_STATE_FILE, map_location=self.device, weights_only=True)
        if is_quantized(self.module):
            load_trainable(self.module, state["model"], directory)
        else:
            self.module.load_state_dict(state["model"])
        if self.master is not None:
            with torch.no_grad():
                for master, saved in zip(self.master.masters, state["master"], strict=True):
                    master.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint keeps: all of them, or with a 4-bit base (frozen, and read again from
        the model folder on resume) the trainable ones alone."""
        if is_quantized(self.module):
            return {name: p.detach() for name, p in self.module.named_parameters() if p.requires_grad}
        return self.module.state_dict()

    def _gather_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights on the CPU; a 4-bit base's as the values it computes with."""
        state = dequantized_state_dict(self.module) if is_quantized(self.module) else self.module.state_dict()
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def offload(self, keep_weights: bool = False) -> None:
        """Parameters, fp32 masters and optimizer state to the CPU (nothing to do on a CPU run)."""
        self._move_to(torch.device("cpu"), weights=not keep_weights)

    def onload(self) -> None:
        self._move_to(self.device)

    def _move_to(self, device: torch.device, weights: bool = True) -> None:
        if self.device.type == "cpu":
            return
        if weights:
            self.stash.move_module(self.module, device, "model.")
        if self.master is not None:
            self.master.to(device, self.stash)
        move_optimizer_state(self.optimizer, device, self.stash)
        if device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()


def load_trainable(model: torch.nn.Module, saved: dict[str, torch.Tensor], directory: Path) -> None:
    """Restore the trainable parameters of ``model`` from ``saved``; raises naming the checkpoint when
    it lacks one of them or holds a name the model does not have."""
    params = dict(model.named_parameters())
    wanted = {name for name, p in params.items() if p.requires_grad}
    missing, unknown = sorted(wanted - set(saved)), sorted(set(saved) - set(params))
    if missing or unknown:
        raise ValueError(
            f"checkpoint {directory}: does not match the model's trainable weights (missing {missing[:3]}, "
            f"unknown {unknown[:3]}); was it written with the same model.lora settings?"
        )
    with torch.no_grad():
        for name, value in saved.items():
            params[name].copy_(value)
