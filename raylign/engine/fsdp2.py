"""FSDP2 backend: torch ``fully_shard`` on every decoder layer and on the root.

Each rank holds a 1/world_size shard of every parameter, gradient and optimizer state
(ZeRO-3 style); a layer's full weights exist only while that layer runs. Gradients are
reduce-scattered and averaged across ranks in every ``backward``, and summed over the
micro-batches until ``step``.

A bf16 model is trained with fp32 sharded master weights: the engine upcasts it before
sharding and a ``MixedPrecisionPolicy`` casts each layer's gathered weights to bf16 for
compute, so the forward pass runs in bf16 while small AdamW updates are not rounded away. With
``optim.master_weights: false`` the shards stay bf16 and the optimizer rounds each update into them
stochastically (:class:`~raylign.engine.optim.StochasticRoundingAdamW`).
Exports and :meth:`full_state_dict` hand weights back in bf16.

A model whose parameters are on the meta device (``load_causal_lm(..., empty=True)``, chosen by
``engine.load_sharded``) is sharded first and then filled by :func:`load_sharded_weights`: each
rank reads only its own rows of every weight from the safetensors files, so no rank ever holds the
whole model, in the checkpoint's dtype or in fp32.

Checkpoints are sharded (torch.distributed.checkpoint) and must be loaded on the same
world size; :meth:`export_hf` gathers full weights to rank 0 for anything else.

A 4-bit base (QLoRA) is left out of the sharding: every rank keeps bitsandbytes' packed weights
whole, and shards the rest (the adapters, embeddings, norms); its checkpoints keep the trainable
weights alone.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from raylign.buffers import ReusedBuffers
from raylign.config.engine import EngineConfig
from raylign.config.optim import OptimConfig
from raylign.engine.base import TrainEngine, floating_dtype
from raylign.engine.distributed import ensure_process_group
from raylign.engine.export import is_adapter_weight, stream_hf_tensors, tied_output_key
from raylign.engine.optim import build_adamw, build_scheduler, clip_grad_norm, move_optimizer_state
from raylign.engine.sequence_sharded_activations import (
    NORM_STYLE,
    SEQUENCE_STYLES,
    register_styles,
    sequence_sharded_plan,
    shard_activations_by_sequence,
)
from raylign.models.loading import dequantized_state_dict, is_quantized, quantized_weights, stored_name

DCP_FOLDER = "dcp"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: modules whose class the model lists in
    ``_no_split_modules`` (transformers marks its decoder layers so), innermost first."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"fsdp2: cannot find the decoder layers of {type(model).__name__}: it declares no "
            f"_no_split_modules matching its modules (declared: {sorted(names) or 'none'})"
        )
    # modules() is pre-order; nested blocks must be sharded before the blocks that hold them.
    return layers[::-1]


def mixed_precision_policy(model_dtype: torch.dtype, reduce_dtype: str) -> MixedPrecisionPolicy:
    """Compute in the model's own low precision; fp32 models compute in fp32."""
    param_dtype = None if model_dtype == torch.float32 else model_dtype
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=_DTYPES[reduce_dtype])


def offload_policy(engine_cfg: EngineConfig, device: torch.device) -> OffloadPolicy:
    """Keep shards and the optimizer step on the CPU when asked (params and optimizer go together
    in FSDP2). Pinned memory speeds up GPU copies; it does not exist without a GPU."""
    if engine_cfg.offload_params or engine_cfg.offload_optimizer:
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def load_sharded_weights(model: torch.nn.Module, device: torch.device) -> int:
    """Give an FSDP2 model sharded on the meta device its memory on ``device`` and fill each rank's
    shard of every parameter from the safetensors files of ``model.config._name_or_path``, reading
    only that shard's block (FSDP2's rows; with tensor parallel, the rows or columns of its slice of
    them too) and casting it to the shard's dtype. Buffers (rotary frequencies) keep the values they
    were built with. Returns the bytes this rank read."""
    from safetensors import safe_open

    folder = Path(model.config._name_or_path)
    files = _weight_files(folder)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    # Weights the files lack (a new head, LoRA adapters), made whole by a function; names as stored.
    fresh = getattr(model, "fresh_weights", {})
    model.to_empty(device=device)
    read = 0
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        for peft_name, param in model.named_parameters():
            name = stored_name(peft_name)
            if name in fresh:
                whole = torch.empty(param.shape, dtype=param.dtype)
                fresh[name](name, whole)
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(whole[_block_of_rank(param)])
                continue
            if name not in files:
                raise ValueError(
                    f"engine.load_sharded: the safetensors files in {folder} hold no weight {name!r} (names there "
                    f"must equal the model's parameter names); set engine.load_sharded: false to load it whole"
                )
            local = param.to_local() if isinstance(param, DTensor) else param
            block = _block_of_rank(param)
            if tuple(local.shape) != tuple(s.stop - s.start for s in block):
                raise RuntimeError(f"fsdp2: shard of {name!r} is {tuple(local.shape)}, expected the block {block}")
            # Opened for each weight: the file is memory-mapped, and pages read stay resident until it closes.
            with safe_open(str(files[name]), framework="pt", device="cpu") as handle:
                stored = handle.get_slice(name)
                if list(stored.get_shape()) != list(param.shape):
                    shapes = f"{stored.get_shape()}, the model {list(param.shape)}"
                    raise ValueError(f"{files[name]}: weight {name!r} has shape {shapes}")
                if local.numel():
                    values = stored[block]
                    local.copy_(values)
                    read += values.numel() * values.element_size()
                    del values
    return read


def _block_of_rank(param: torch.Tensor) -> tuple[slice, ...]:
    """The block of the whole parameter this rank holds, one slice per dimension: from DTensor's own
    placement arithmetic, whatever the mesh (FSDP2's dim-0 shards, tensor-parallel row or column
    slices, both nested, replicas)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, size) for size in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


def _weight_files(folder: Path) -> dict[str, Path]:
    """Weight name -> the safetensors file of ``folder`` holding it (one file, or a sharded index)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(
            f"engine.load_sharded: {folder} has neither model.safetensors nor model.safetensors.index.json"
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt", device="cpu") as handle:
        return dict.fromkeys(handle.keys(), single)


def build_meshes(
    device_type: str, world_size: int, tensor_parallel: int, shard_size: int | None, timeout_s: int
) -> tuple[DeviceMesh, DeviceMesh]:
    """The engine's device mesh and the part of it FSDP2 shards over.

    Ranks ``r*t .. r*t+t-1`` form one tensor-parallel group (``t = tensor_parallel``); the data-parallel
    ranks (``world_size / t``) shard over groups of ``shard_size`` (None: all of them), which replicate
    one another when there are several (HSDP: FSDP2 given a 2-D ``("replicate", "shard")`` mesh). The
    collectives of every group of the mesh give up after ``timeout_s`` (``engine.dist_timeout_s``)."""
    data_parallel = world_size // tensor_parallel
    if world_size % tensor_parallel:
        raise ValueError(f"engine.tensor_parallel_size ({tensor_parallel}) must divide the ranks ({world_size})")
    shard = shard_size or data_parallel
    if data_parallel % shard:
        raise ValueError(
            f"engine.data_parallel_shard_size ({shard}) must divide the data-parallel ranks ({data_parallel})"
        )
    replicate = data_parallel // shard
    sizes, names = [replicate, shard], ["replicate", "shard"]
    if tensor_parallel > 1:
        sizes, names = [*sizes, tensor_parallel], [*names, "tp"]
    if len(sizes) == 2 and replicate == 1:
        mesh = init_device_mesh(device_type, (world_size,))  # plain FSDP over every rank
        return mesh, mesh
    mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
    # init_device_mesh makes the groups of a dimension that is not the whole world with torch's default
    # timeout (30 minutes on gloo, 10 on nccl), not the default group's: a rank whose partner is gone would
    # wait that long instead of engine.dist_timeout_s.
    timeout = datetime.timedelta(seconds=timeout_s)
    for dim in range(mesh.ndim):
        _set_pg_timeout(timeout, mesh.get_group(dim))
    return mesh, (mesh["replicate", "shard"] if replicate > 1 else mesh["shard"])


@torch.no_grad()
def whole_tensor(tensor: DTensor, buffers: ReusedBuffers | None = None) -> torch.Tensor:
    """``tensor.full_tensor()`` on every rank. A CPU tensor sharded by rows over a 1-D mesh (what
    ``fully_shard`` makes of every parameter without tensor parallelism) is gathered by one gloo
    broadcast from each rank into its rows of the result: gloo's all-gather is several times slower
    than its broadcast for the same bytes (``benchmarks/colocated_sync.py``, ``benchmarks/README.md``);
    into memory from ``buffers`` when given (the result is then a view of it, valid until the next
    gather of that shape once the caller has let go of it)."""
    mesh = tensor.device_mesh
    if mesh.device_type != "cpu" or mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        return tensor.full_tensor()
    group = mesh.get_group()
    if buffers is None:
        whole = torch.empty(tensor.shape, dtype=tensor.dtype)
    else:
        whole = buffers.take(tensor.shape, tensor.dtype).view(tensor.shape)
    local = tensor.to_local()
    # fully_shard splits rows as torch.chunk does: ceil(rows / ranks) each, the last ranks fewer or none.
    for index, rows in enumerate(whole.chunk(mesh.size(), dim=0)):
        if index == mesh.get_local_rank():
            rows.copy_(local)
        dist.broadcast(rows, group_src=index, group=group)
    return whole


def apply_tensor_parallel(model: torch.nn.Module, mesh: DeviceMesh, shard_activations: bool = False) -> None:
    """Split ``model``'s matrices over ``mesh`` with the tensor-parallel plan transformers ships for its
    architecture (attention and MLP projections column- then row-wise, embedding and output head over
    the vocabulary); every rank must hold the same full weights first, and each keeps its slice. Raises,
    naming the model and the sizes, for an architecture without a plan or sizes the ranks cannot split.
    ``shard_activations``: the activations between the split matrices are split along the sequence too
    (``engine.tensor_parallel_shard_activations``, :mod:`raylign.engine.sequence_sharded_activations`)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = getattr(model, "tp_plan", None) or {}
    name = type(model).__name__
    if not plan:
        raise ValueError(
            f"engine.tensor_parallel_size: {name} has no tensor-parallel plan in transformers (Llama, Qwen2, Qwen3, "
            "Mistral and most decoder-only models do); set engine.tensor_parallel_size: 1"
        )
    tp, config = mesh.size(), model.config.get_text_config()
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "intermediate_size": getattr(config, "intermediate_size", tp),
        "vocab_size": config.vocab_size,
    }
    uneven = {key: value for key, value in sizes.items() if value % tp}
    if uneven:
        raise ValueError(
            f"engine.tensor_parallel_size {tp}: {name}'s {', '.join(f'{k}={v}' for k, v in uneven.items())} "
            "cannot be split evenly over that many ranks"
        )
    peft = hasattr(model, "get_base_model")
    model = model.get_base_model() if peft else model
    if shard_activations:
        register_styles()
        plan = sequence_sharded_plan(model, plan)
    if peft:  # its LoRA layers wrap the planned linear layers
        plan = lora_tensor_parallel_plan(model, plan)
    trained = {name: param.requires_grad for name, param in model.named_parameters()}
    apply_tensor_parallelism(model, mesh, plan)
    for name, param in model.named_parameters():  # a style that makes a parameter anew makes it trainable
        param.requires_grad_(trained.get(name, param.requires_grad))  # (a tied head is untied until below)
    if shard_activations:
        shard_activations_by_sequence(model, mesh)
    if getattr(config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        # (A score model has no output embeddings to tie.) The plan gives the embedding and the output head a
        # parameter each (both split over the vocabulary alike); tied, they must stay one, or each trains its
        # own half of the gradient.
        model.tie_weights()
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if head is None or head.weight is not embedding.weight:
            raise RuntimeError(f"engine.tensor_parallel_size: {name}'s tied output head could not be tied again")


def lora_tensor_parallel_plan(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` for ``model`` whose planned linear layers PEFT wrapped in LoRA layers. The wrapped layer
    (``base_layer``) keeps its style, and the adapter splits so that its output is laid out as the base
    layer's: beside a column-split layer, ``lora_B`` splits its output columns too (each rank adds its
    columns of B·A·x to its columns of W·x; ``lora_A`` stays whole); beside a row-split layer, ``lora_A``
    splits its input rows like W, and its partial products are summed over the ranks before the whole
    ``lora_B``, as W's are. Where that output is split along the sequence
    (:mod:`~raylign.engine.sequence_sharded_activations`), the whole ``lora_B`` sees its rank's part of the
    sequence and its gradient is summed over the parts, as a norm's is. Raises naming the layer for a
    wrapped layer of any other style."""
    from peft.tuners.lora import LoraLayer
    from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard

    adapted = {
        replace_layer_number_by_wildcard(name): module
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }
    split = {"colwise": "lora_B", "rowwise": "lora_A"}
    split.update({sequence: split[style] for style, sequence in SEQUENCE_STYLES.items()})
    lora_plan: dict[str, str] = {}
    for key, style in plan.items():
        if key not in adapted:
            lora_plan[key] = style
            continue
        if style not in split:
            raise ValueError(
                f"engine.tensor_parallel_size with model.lora: the plan splits {key} as {style!r}, which LoRA "
                f"adapters cannot follow (colwise and rowwise layers can); leave it out of "
                f"model.lora.target_modules"
            )
        lora_plan[f"{key}.base_layer"] = style
        for adapter in adapted[key].active_adapters:
            lora_plan[f"{key}.{split[style]}.{adapter}"] = style
            if style in SEQUENCE_STYLES.values():  # lora_B then sees this rank's part of the sequence only:
                lora_plan[f"{key}.lora_B.{adapter}"] = NORM_STYLE  # its gradient is summed over the parts
    return lora_plan


def shard_model(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    mp: MixedPrecisionPolicy,
    offload: OffloadPolicy,
    reshard_root: bool | None = None,
    reshard_layers: bool = True,
) -> None:
    """Shard every decoder layer, then the root (embeddings, final norm, output head). Layers give up
    their gathered weights after their forward unless ``reshard_layers`` is false
    (``engine.reshard_after_forward``). The root keeps its own until the backward (FSDP2's default,
    ``reshard_root`` None: it is needed again there); a model that has no backward passes
    ``reshard_root=True``, or its embedding stays whole between forwards. A 4-bit base's packed
    weights (QLoRA) stay whole on every rank, as bitsandbytes computes with them: frozen, and an
    eighth of the full-precision bytes; the rest, the adapters included, is sharded."""
    whole = quantized_weights(model) or None
    for layer in decoder_layers(model):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=reshard_layers,
            ignored_params=whole,
        )
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp,
        offload_policy=offload,
        reshard_after_forward=reshard_root,
        ignored_params=whole,
    )


def shard_frozen(model: torch.nn.Module, engine_cfg: EngineConfig) -> tuple[torch.nn.Module, torch.device]:
    """A model that is never trained (the RL reference) sharded over the process group like a trained
    one: each rank keeps a shard of every weight in the model's own dtype (no fp32 copy, no optimizer),
    and a layer's full weights are gathered only while it runs. A model on the meta device is filled
    shard by shard (:func:`load_sharded_weights`). Returns the sharded model, in eval mode, and its device."""
    _, world_size, device = ensure_process_group(engine_cfg.dist_timeout_s)
    model.eval().requires_grad_(False)
    offload = offload_policy(engine_cfg, device)
    empty = any(p.is_meta for p in model.parameters())
    if not isinstance(offload, CPUOffloadPolicy) and not empty:
        model.to(device)
    shard_model(model, init_device_mesh(device.type, (world_size,)), MixedPrecisionPolicy(), offload, reshard_root=True)
    if empty:
        load_sharded_weights(model, torch.device("cpu") if isinstance(offload, CPUOffloadPolicy) else device)
    return model, device


class FSDP2Engine(TrainEngine):
    backend_name = "fsdp2"

    def __init__(
        self, model: torch.nn.Module, engine_cfg: EngineConfig, optim_cfg: OptimConfig, total_steps: int
    ) -> None:
        self.rank, self.world_size, self.device = ensure_process_group(engine_cfg.dist_timeout_s)
        self.model_dtype = floating_dtype(model)
        self.max_grad_norm = optim_cfg.max_grad_norm
        self.offload_policy = offload_policy(engine_cfg, self.device)
        self._whole_buffers = ReusedBuffers()  # the weight stream's gathers on CPU (whole_tensor)
        empty = any(p.is_meta for p in model.parameters())
        if optim_cfg.master_weights:
            model.float()  # sharded fp32 master weights; no-op for fp32 models (and only metadata on meta)
        if not isinstance(self.offload_policy, CPUOffloadPolicy) and not empty:
            model.to(self.device)
        self.mesh, data_mesh = build_meshes(
            self.device.type,
            self.world_size,
            engine_cfg.tensor_parallel_size,
            engine_cfg.data_parallel_shard_size,
            engine_cfg.dist_timeout_s,
        )
        if engine_cfg.tensor_parallel_size > 1:
            apply_tensor_parallel(model, self.mesh["tp"], engine_cfg.tensor_parallel_shard_activations)
        precision = mixed_precision_policy(self.model_dtype, engine_cfg.reduce_dtype)
        shard_model(model, data_mesh, precision, self.offload_policy, reshard_layers=engine_cfg.reshard_after_forward)
        if empty:
            on_cpu = isinstance(self.offload_policy, CPUOffloadPolicy)
            self.bytes_read = load_sharded_weights(model, torch.device("cpu") if on_cpu else self.device)
        self.module = model
        self.optimizer = build_adamw(model.named_parameters(), optim_cfg)
        self.scheduler = build_scheduler(self.optimizer, optim_cfg, total_steps)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _clip_and_update(self, max_grad_norm: float, update: bool) -> tuple[float, bool]:
        params = [p for p in self.module.parameters() if p.requires_grad]
        grad_norm = clip_grad_norm(params, max_grad_norm)  # global: the same on every rank
        update = update and math.isfinite(grad_norm)
        if update:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, update

    def _state_options(self) -> StateDictOptions:
        """A 4-bit base is frozen and read again from its folder on resume: its checkpoints keep the
        trainable weights alone."""
        quantized = is_quantized(self.module)
        return StateDictOptions(ignore_frozen_params=quantized, strict=not quantized)

    def _sharded_state(self) -> dict[str, dict]:
        model = get_model_state_dict(self.module, options=self._state_options())
        if is_quantized(self.module):  # bitsandbytes adds each packed weight's quantisation state beside it
            trainable = {name for name, param in self.module.named_parameters() if param.requires_grad}
            model = {name: value for name, value in model.items() if name in trainable}
        return {"model": model, "optimizer": get_optimizer_state_dict(self.module, self.optimizer)}

    def _save_engine_state(self, directory: Path) -> None:
        dcp.save(self._sharded_state(), checkpoint_id=str(directory / DCP_FOLDER))

    def _load_engine_state(self, directory: Path) -> None:
        state = self._sharded_state()  # templates with this run's sharding; DCP fills them in place
        dcp.load(state, checkpoint_id=str(directory / DCP_FOLDER))
        set_model_state_dict(self.module, state["model"], options=self._state_options())
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])

    def _gather_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model on rank 0's CPU; a 4-bit base's as the values it computes with."""
        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if is_quantized(self.module) and state:
            state = {k: v.to("cpu") for k, v in dequantized_state_dict(self.module, state).items()}
        return state

    def iter_full_state(self, every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter all-gathered on its own, on the device, and handed out before the next is
        gathered: rank 0 (with ``every_rank``, every rank: the all-gather gives each one the whole
        tensor) holds one full tensor at a time, never the whole model (a LoRA model: one layer's base
        and adapter tensors, merged once all are there). CPU-offloaded shards on a GPU, and a 4-bit base
        (dequantised on rank 0), take the whole-model gather instead."""
        if is_quantized(self.module) or (
            self.device.type != "cpu" and isinstance(self.offload_policy, CPUOffloadPolicy)
        ):
            yield from super().iter_full_state(every_rank)
            return
        tied = tied_output_key(self.hf_model)
        lora = hasattr(self.hf_model, "get_base_model")  # a tied head is known by its name after the merge
        main = every_rank or not dist.is_initialized() or dist.get_rank() == 0

        def gathered() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.module.state_dict().items():
                if name == tied and not lora:
                    continue
                # every rank, in order; into reused memory (a tensor a consumer still holds is not written over)
                full = whole_tensor(tensor, self._whole_buffers) if isinstance(tensor, DTensor) else tensor
                if main:
                    yield name, full.detach()
                del full

        for name, tensor in stream_hf_tensors(gathered(), self.hf_model, self.model_dtype):
            if name != tied:
                yield name, tensor

    def _gather_adapter_state_dict(self, every_rank: bool = False) -> dict[str, torch.Tensor]:
        """Each adapter tensor all-gathered on its own (every rank, in the same order); rank 0 (with
        ``every_rank``, every rank) keeps them."""
        if self.device.type != "cpu" and isinstance(self.offload_policy, CPUOffloadPolicy):
            return super()._gather_adapter_state_dict(every_rank)
        gathered: dict[str, torch.Tensor] = {}
        main = every_rank or not dist.is_initialized() or dist.get_rank() == 0
        for name, param in self.module.named_parameters():
            if not is_adapter_weight(name):
                continue
            full = whole_tensor(param) if isinstance(param, DTensor) else param
            if main:
                gathered[name] = full.detach().to("cpu", copy=True)
        return gathered

    def offload(self, keep_weights: bool = False) -> None:
        """Sharded parameters and optimizer state to the CPU; no-op on CPU runs or with CPU offload."""
        if self._moves_needed():
            if not keep_weights:
                self.module.to("cpu")
            move_optimizer_state(self.optimizer, torch.device("cpu"))
            torch.cuda.empty_cache()

    def onload(self) -> None:
        if self._moves_needed():
            self.module.to(self.device)
            move_optimizer_state(self.optimizer, self.device)

    def _moves_needed(self) -> bool:
        return self.device.type != "cpu" and not isinstance(self.offload_policy, CPUOffloadPolicy)
