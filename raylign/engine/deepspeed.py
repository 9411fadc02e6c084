"""DeepSpeed ZeRO backend (stages 1, 2 and 3).

The optimizer is torch's own AdamW handed to DeepSpeed as a client optimizer, so nothing has
to be compiled. With ``offload_optimizer`` it is ``DeepSpeedCPUAdam`` instead (DeepSpeed
requires it for ZeRO-Offload): that op is JIT-compiled on first use, 1-4 minutes, and cached
under ``TORCH_EXTENSIONS_DIR``. Unless that is set, raylign sets it to
:func:`torch_extensions_dir`, one folder per Python environment, and ``scripts/install.sh``
builds the op there at install time (:func:`prebuild_ops`), so runs and tests find it built.
DeepSpeed's shared-memory communication op, which it would compile on CPU machines, is
switched off (gloo does those reductions).

Gradient accumulation is the caller's, as in the other backends. DeepSpeed runs with
``gradient_accumulation_steps=1`` and ``managed_gradient_accumulation=false``: ``backward``
only accumulates (no loss scaling by 1/GAS, and no premature reduction that would drop earlier
micro-batches, which DeepSpeed's managed mode does when ``backward`` is called several times
with GAS=1), and ``step`` reduces, clips to ``max_grad_norm`` (global norm over all
partitions), and updates. Data-parallel ranks average their gradients, like FSDP2.

A bf16 model runs with DeepSpeed's bf16 mode: bf16 weights for compute, fp32 master
partitions in the optimizer.

On CPU the accelerator is DeepSpeed's ``cpu`` one with the gloo backend; oneCCL is not needed.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from raylign.config.engine import EngineConfig
from raylign.config.optim import OptimConfig
from raylign.engine.base import TrainEngine, floating_dtype
from raylign.engine.checkpoint import CheckpointError
from raylign.engine.distributed import ensure_process_group
from raylign.engine.export import is_adapter_weight, stream_hf_tensors, tied_output_key
from raylign.engine.optim import build_param_groups, build_scheduler, torch_adamw
from raylign.errors import MissingPackageError
from raylign.hardware import name_cpu_accelerator_for_deepspeed
from raylign.models.loading import dequantized_state_dict, is_quantized

CHECKPOINT_TAG = "zero"


# The DeepSpeed ops raylign can need, by builder name: DeepSpeedCPUAdam (offload_optimizer).
PREBUILT_OPS = ("CPUAdamBuilder",)


def torch_extensions_dir() -> Path:
    """Where DeepSpeed's JIT-compiled ops are cached: ``TORCH_EXTENSIONS_DIR`` when set, else
    ``~/.cache/raylign/torch_extensions/<python>-<hash of sys.prefix>``.

    One folder per Python environment: a build records the absolute include paths of its
    environment, so two environments sharing one folder would each rebuild it for themselves."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    tag = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path.home() / ".cache" / "raylign" / "torch_extensions" / f"{python}-{tag}"


def _import_deepspeed() -> Any:
    # Before any op is built: JIT builds then land where scripts/install.sh prebuilt them.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(torch_extensions_dir()))
    name_cpu_accelerator_for_deepspeed()
    try:
        import deepspeed
    except ImportError as err:
        message = "the deepspeed backend needs the deepspeed package: pip install 'raylign[deepspeed]'"
        raise MissingPackageError(message) from err
    return deepspeed


def prebuild_ops(builders: tuple[str, ...] = PREBUILT_OPS) -> list[str]:
    """Compile DeepSpeed's ops now, into :func:`torch_extensions_dir`, instead of at their first
    use in a run (what ``scripts/install.sh`` calls). An op already built there only loads.
    Prints each op, where it goes and how long it took; a failure is printed, not raised (the
    op is then JIT-compiled at first use, as without this). Returns the ops that failed."""
    directory = torch_extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(directory)
    failed = []
    try:
        _import_deepspeed()
        from deepspeed.accelerator import get_accelerator
    except ImportError as err:
        print(f"raylign: not building DeepSpeed ops: {err}", flush=True)
        return list(builders)
    for name in builders:
        started = time.monotonic()
        try:
            builder = get_accelerator().create_op_builder(name)
            if builder is None or not builder.is_compatible():
                raise RuntimeError(f"DeepSpeed's {get_accelerator()._name} accelerator cannot build it here")
            print(
                f"raylign: DeepSpeed op {builder.name}: compiling into {directory / builder.name} "
                "(only loads if already built there) ...",
                flush=True,
            )
            builder.load(verbose=False)
        except Exception as err:  # reported, not raised: the op JIT-compiles at first use instead
            print(
                f"raylign: warning: DeepSpeed op {name} was not built ({' | '.join(str(err).splitlines())[:500]}); "
                "it will be JIT-compiled at its first use instead",
                flush=True,
            )
            failed.append(name)
            continue
        print(f"raylign: DeepSpeed op {builder.name} ready in {time.monotonic() - started:.1f} s", flush=True)
    return failed


def deepspeed_config(
    engine_cfg: EngineConfig, optim_cfg: OptimConfig, model_dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """The DeepSpeed JSON config that gives this engine's step semantics."""
    if model_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the deepspeed backend trains float32 or bfloat16 models, got {model_dtype}")
    pin = device.type == "cuda"
    zero: dict[str, Any] = {"stage": engine_cfg.zero_stage, "overlap_comm": False}
    if engine_cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if engine_cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: batches are the caller's
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": optim_cfg.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if engine_cfg.tensor_parallel_size > 1:
        # AutoTP: DeepSpeed splits every linear layer of the model over groups of this many consecutive ranks
        # as it initialises, and ZeRO then runs over the data-parallel ranks.
        # Full-vocabulary logits: raylign's losses read log-probs from them (a vocabulary-parallel head, which
        # DeepSpeed picks by itself for a tied one, would hand each rank a slice of the vocabulary).
        config["tensor_parallel"] = {"autotp_size": engine_cfg.tensor_parallel_size, "vocab_parallel_lm_head": False}
    if model_dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
        config["communication_data_type"] = "fp32" if engine_cfg.reduce_dtype == "float32" else "bf16"
    return config


def client_optimizer(groups: list[dict[str, Any]], optim_cfg: OptimConfig, offload: bool) -> torch.optim.Optimizer:
    """torch AdamW (:func:`torch_adamw`); DeepSpeedCPUAdam (same AdamW math, JIT-compiled) when the
    optimizer is offloaded."""
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        kwargs = {"lr": optim_cfg.lr, "betas": optim_cfg.betas, "eps": optim_cfg.eps}
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch_adamw(groups, optim_cfg)


def _require_caller_owned_accumulation(engine: Any, version: str) -> None:
    """Older DeepSpeed ignores ``managed_gradient_accumulation``; with GAS=1 it would then keep only
    the last micro-batch's gradients of a step, silently. Refuse to run rather than train wrong."""
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if managed is None or managed():
        raise RuntimeError(
            f"deepspeed {version} does not support managed_gradient_accumulation=false, which the deepspeed "
            "backend needs for caller-owned gradient accumulation; install deepspeed>=0.19.8"
        )


def _refuse_another_tensor_parallel_layout(tensor_parallel: int) -> None:
    """DeepSpeed sets its AutoTP groups up once per process and keeps them: a later engine of another
    tensor-parallel size in the same process would train on the first one's groups (or fail deep inside
    DeepSpeed without any), so it is refused here, naming both sizes."""
    from deepspeed.utils import groups

    existing = groups._TENSOR_MODEL_PARALLEL_GROUP  # None until an AutoTP engine was built in this process
    if existing is None:
        return
    earlier = torch.distributed.get_world_size(existing)
    if earlier != tensor_parallel:
        raise RuntimeError(
            f"engine.tensor_parallel_size {tensor_parallel} with engine.backend deepspeed: this process built a "
            f"DeepSpeed AutoTP engine of tensor_parallel_size {earlier} already, and DeepSpeed keeps its "
            "tensor-parallel groups for the life of a process; run the second training in a new process"
        )


def _load_trainable(src: dict[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """DeepSpeed's ``custom_load_fn`` for a model with a frozen 4-bit base: a checkpoint saved without its
    frozen weights restores every trainable one, and a trainable weight it lacks is an error naming it
    (the 4-bit layers' own entries, bitsandbytes' quantisation state, are left as loaded from the folder)."""
    trainable = {name for name, param in dst.named_parameters() if param.requires_grad}
    missing = sorted(trainable - src.keys())
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} trainable weight(s) of the model, e.g. {missing[0]!r}"
        )
    dst.load_state_dict({name: src[name] for name in trainable}, strict=False)


class DeepSpeedZeroEngine(TrainEngine):
    backend_name = "deepspeed"

    def __init__(
        self, model: torch.nn.Module, engine_cfg: EngineConfig, optim_cfg: OptimConfig, total_steps: int
    ) -> None:
        deepspeed = _import_deepspeed()
        self.rank, self.world_size, self.device = ensure_process_group(engine_cfg.dist_timeout_s)
        if self.device.type == "cpu":
            # DeepSpeed would compile its shared-memory all-reduce (about 40 s on a fresh machine) to
            # replace collectives that gloo already does; the reductions here are gloo's.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # Reuses the process group created above (gloo on CPU, nccl on GPU).
        deepspeed.init_distributed(
            dist_backend="nccl" if self.device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=engine_cfg.dist_timeout_s),
        )
        _refuse_another_tensor_parallel_layout(engine_cfg.tensor_parallel_size)
        self.model_dtype = floating_dtype(model)
        self.max_grad_norm = optim_cfg.max_grad_norm
        self.zero_stage = engine_cfg.zero_stage
        self.tensor_parallel = engine_cfg.tensor_parallel_size
        self.offload_params = engine_cfg.offload_params
        config = deepspeed_config(engine_cfg, optim_cfg, self.model_dtype, self.device)
        groups = build_param_groups(model.named_parameters(), optim_cfg.weight_decay)
        optimizer = client_optimizer(groups, optim_cfg, engine_cfg.offload_optimizer)
        # The schedule is driven here, not by DeepSpeed, so it matches the other backends exactly;
        # it edits the client optimizer's param groups, which DeepSpeed's wrapper shares.
        self.scheduler = build_scheduler(optimizer, optim_cfg, total_steps)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        _require_caller_owned_accumulation(self.engine, deepspeed.__version__)
        self.module = self.engine
        self._deepspeed = deepspeed

    @property
    def hf_model(self) -> torch.nn.Module:
        return self.engine.module

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def _clip_and_update(self, max_grad_norm: float, update: bool) -> tuple[float, bool]:
        # DeepSpeed reduces, clips (config gradient_clipping), updates and zeroes grads in one call,
        # and measures the norm only inside it: it cannot skip, so it always updates.
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return (float("nan") if norm is None else float(norm)), True

    def _save_engine_state(self, directory: Path) -> None:
        # A 4-bit base is frozen and read again from the model folder on resume: its packed weights stay out.
        self.engine.save_checkpoint(
            str(directory),
            tag=CHECKPOINT_TAG,
            client_state={},
            save_latest=False,
            exclude_frozen_parameters=is_quantized(self.hf_model),
        )

    def _load_engine_state(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(
            str(directory),
            tag=CHECKPOINT_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            custom_load_fn=_load_trainable if is_quantized(self.hf_model) else None,
        )
        if path is None:
            raise CheckpointError(f"DeepSpeed found no '{CHECKPOINT_TAG}' checkpoint in {directory}")

    def _gather_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model on rank 0's CPU; a 4-bit base's as the values it computes with."""
        state = dict(self._iter_gathered(self.engine.module))
        if is_quantized(self.hf_model) and state:
            state = dequantized_state_dict(self.hf_model, state)
        return state

    def iter_full_state(self, every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight sync sends, one tensor at a time, on rank 0 (with ``every_rank``, on every
        rank): under ZeRO-3 or AutoTP each submodule's parameters gathered in turn and handed out before
        the next is gathered; under ZeRO-1/2 the rank's own (whole) weights copied out one at a time.
        No rank holds the whole model a second time (a LoRA model: one layer's base and adapter
        tensors, merged once all are there). Collective: every rank iterates it to the end."""
        if is_quantized(self.hf_model):  # dequantised as a whole (a 4-bit base trains under ZeRO-1/2 only)
            yield from super().iter_full_state(every_rank)
            return
        tied = tied_output_key(self.hf_model)
        raw = self._iter_gathered(self.engine.module, every_rank)
        for name, tensor in stream_hf_tensors(raw, self.hf_model, self.model_dtype):
            if name != tied:
                yield name, tensor

    def _iter_gathered(self, module: torch.nn.Module, every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's whole weights under its state-dict names, as CPU copies, on rank 0 (nothing
        elsewhere), or with ``every_rank`` on every rank. Collective under ZeRO-3 and AutoTP."""
        keeps = every_rank or self.rank == 0
        if self.tensor_parallel > 1:
            from deepspeed.module_inject.layers import GatherReplacedLayerParams

            # AutoTP's split layers made whole by DeepSpeed's own gather.
            yield from self._iter_layer_by_layer(
                module, lambda params, submodule: GatherReplacedLayerParams(params, submodule, enabled=True), keeps
            )
        elif self.zero_stage < 3:  # every rank holds the full (updated) weights
            if keeps:
                for key, tensor in module.state_dict().items():
                    yield key, tensor.detach().to("cpu", copy=True)
        else:  # ZeRO-3: the partitioned parameters of one submodule at a time
            yield from self._iter_layer_by_layer(
                module, lambda params, _: self._deepspeed.zero.GatheredParameters(params, modifier_rank=None), keeps
            )

    def _gather_adapter_state_dict(self, every_rank: bool = False) -> dict[str, torch.Tensor]:
        """The adapter's parameters only, gathered together (they are small) under ZeRO-3; on rank 0,
        or with ``every_rank`` on every rank."""
        named = [(n, p) for n, p in self.engine.module.named_parameters() if is_adapter_weight(n)]
        keeps = every_rank or self.rank == 0
        if self.zero_stage < 3:
            return {n: p.detach().to("cpu", copy=True) for n, p in named} if keeps else {}
        with self._deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {n: p.detach().to("cpu", copy=True) for n, p in named} if keeps else {}

    def _iter_layer_by_layer(
        self, module: torch.nn.Module, gather: Any, keeps: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each submodule's own parameters made whole by ``gather(params, submodule)`` (a context
        manager) in turn, a rank that ``keeps`` them copying them and the buffers out under the model's
        state-dict names: the peak extra memory is one layer rather than the whole model."""
        wanted = set(module.state_dict().keys())
        for prefix, submodule in module.named_modules():
            own = list(submodule.named_parameters(recurse=False))
            with gather([p for _, p in own], submodule):
                if keeps:
                    for name, tensor in own + list(submodule.named_buffers(recurse=False)):
                        key = f"{prefix}.{name}" if prefix else name
                        if key in wanted:
                            yield key, tensor.detach().to("cpu", copy=True)

    def offload(self, keep_weights: bool = False) -> None:
        """ZeRO states (weights, fp32 masters, optimizer moments, grads) to the CPU with DeepSpeed's
        ``offload_states``; with ``keep_weights`` all but the (partitioned) model weights. No-op on CPU
        runs, and with ``offload_params`` (already on the CPU)."""
        if self.device.type == "cpu" or self.offload_params:
            return
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        # DeepSpeed skips states offloaded already: a later call without keep_weights moves the weights alone.
        states = [s for s in OffloadStateTypeEnum if not (keep_weights and s == OffloadStateTypeEnum.lp_params)]
        self.engine.offload_states(include=states, pin_memory=True)
        torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.device.type != "cpu" and not self.offload_params:
            self.engine.reload_states()
