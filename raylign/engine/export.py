"""Turn a training model's full state dict into a plain Hugging Face folder.

The folder holds ``config.json``, ``model.safetensors`` (sharded with an index above 5 GB),
``generation_config.json`` and the tokenizer, so ``AutoModelForCausalLM.from_pretrained`` and
vLLM load it with no raylign code. LoRA adapters are merged into the base weights and the
PEFT name prefixes removed; a tied output embedding is left out as transformers does.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel

_PEFT_PREFIX = "base_model.model."
MAX_SHARD_SIZE = "5GB"
ADAPTER_FOLDER = "adapter"  # a LoRA model's export keeps its adapter alone in this subfolder


def base_hf_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model under an optional PEFT wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(base, PreTrainedModel):
        raise TypeError(f"export needs a transformers PreTrainedModel, got {type(base).__name__}")
    return base


def lora_layers(model: torch.nn.Module) -> dict[str, tuple[float, bool]]:
    """``{module name: (scaling, fan_in_fan_out)}`` of every LoRA layer of the active adapter.

    The scaling is ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), read from the layer itself so
    that per-module rank and alpha patterns are honoured.
    """
    adapter = active_adapter(model)
    layers: dict[str, tuple[float, bool]] = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if not isinstance(scaling, dict) or adapter not in scaling or not hasattr(module, "lora_A"):
            continue
        if getattr(module, "use_dora", {}).get(adapter, False):
            raise NotImplementedError(f"merging DoRA adapters is not supported (module {name})")
        layers[name] = (float(scaling[adapter]), bool(getattr(module, "fan_in_fan_out", False)))
    return layers


def active_adapter(model: torch.nn.Module) -> str:
    adapter = getattr(model, "active_adapter", "default")
    return adapter if isinstance(adapter, str) else adapter[0]


def is_adapter_weight(name: str) -> bool:
    """A weight a PEFT adapter folder holds: a LoRA tensor (``lora_A``, ``lora_B``, ``lora_embedding_A`` ...)
    or a fully trained module's copy (``modules_to_save``: a score model's head)."""
    return ".lora_" in name or ".modules_to_save." in name


def adapter_weights(
    raw: dict[str, torch.Tensor], model: torch.nn.Module, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """A LoRA model's adapter tensors (from its full state dict ``raw``, or ``raw`` holding only them)
    under the names PEFT saves them with (``...q_proj.lora_A.weight``: the adapter's name left out),
    floats cast to ``dtype``: the ``adapter_model.safetensors`` of a PEFT adapter folder."""
    from peft import get_peft_model_state_dict

    adapter = active_adapter(model)
    # save_embedding_layers=False: PEFT's "auto" would look the base model up on the hub.
    weights = get_peft_model_state_dict(
        model,
        state_dict={k: v for k, v in raw.items() if is_adapter_weight(k)},
        adapter_name=adapter,
        save_embedding_layers=False,
    )
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}


def adapter_config(model: torch.nn.Module) -> dict[str, Any]:
    """The active adapter's PEFT config as plain JSON values: its ``adapter_config.json``."""
    config = model.peft_config[active_adapter(model)].to_dict()  # type: ignore[index, operator]
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def _lora_delta(state_dict: dict[str, torch.Tensor], prefix: str, adapter: str, fan_in_fan_out: bool) -> torch.Tensor:
    """``B @ A`` of one layer, shaped like its base weight (before scaling)."""
    linear_a = f"{prefix}.lora_A.{adapter}.weight"
    if linear_a in state_dict:  # A: r x in, B: out x r
        delta = state_dict[f"{prefix}.lora_B.{adapter}.weight"].float() @ state_dict[linear_a].float()
        return delta.T if fan_in_fan_out else delta
    embedding_a = f"{prefix}.lora_embedding_A.{adapter}"
    if embedding_a in state_dict:  # A: r x vocab, B: dim x r; the table is vocab x dim
        return (state_dict[f"{prefix}.lora_embedding_B.{adapter}"].float() @ state_dict[embedding_a].float()).T
    raise NotImplementedError(f"cannot merge the LoRA adapter of {prefix}: only Linear and Embedding layers can be")


def merge_lora(
    state_dict: dict[str, torch.Tensor], layers: dict[str, tuple[float, bool]], adapter: str
) -> dict[str, torch.Tensor]:
    """Fold each LoRA pair into its base weight: ``W' = W + s * B @ A`` (Hu et al. 2021, eq. 3).

    Keys of a wrapped layer ``P`` are ``P.base_layer.weight`` and ``P.lora_A.<adapter>.weight``
    (r x in), ``P.lora_B.<adapter>.weight`` (out x r), or ``P.lora_embedding_{A,B}.<adapter>``
    for embeddings; the result keeps ``P.weight``.
    """
    merged: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if any(part in key for part in (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.")):
            continue
        if ".base_layer." not in key:
            merged[key] = value
            continue
        prefix, leaf = key.split(".base_layer.", 1)
        if leaf == "weight" and prefix in layers:
            scaling, fan_in_fan_out = layers[prefix]
            delta = _lora_delta(state_dict, prefix, adapter, fan_in_fan_out)
            value = (value.float() + scaling * delta).to(value.dtype)
        merged[f"{prefix}.{leaf}"] = value
    return merged


def strip_peft_names(state_dict: dict[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    """PEFT FQNs to the base model's: drop ``base_model.model.``; ``modules_to_save`` copies win."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if ".original_module." in key:
            continue
        name = key.removeprefix(_PEFT_PREFIX).replace(f".modules_to_save.{adapter}.", ".")
        out[name] = value
    return out


def to_hf_state_dict(
    raw: dict[str, torch.Tensor], model: torch.nn.Module, dtype: torch.dtype, merge: bool = True
) -> dict[str, torch.Tensor]:
    """Full training state dict (rank 0) -> HF names, LoRA merged (with ``merge=False`` left out: the
    base weights the adapters sit on), floats cast to ``dtype``."""
    if hasattr(model, "get_base_model"):
        adapter = active_adapter(model)
        raw = strip_peft_names(merge_lora(raw, lora_layers(model) if merge else {}, adapter), adapter)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in raw.items()}


def stream_hf_tensors(
    raw: Iterable[tuple[str, torch.Tensor]], model: torch.nn.Module, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`to_hf_state_dict` over a stream of full training tensors in state-dict order: each LoRA
    layer's base and adapter tensors are merged as soon as the last of them arrives, every other tensor
    goes on at once, so at most one layer's tensors are held."""
    layers = lora_layers(model) if hasattr(model, "get_base_model") else {}
    pending: dict[str, torch.Tensor] = {}
    unit: str | None = None  # the LoRA layer whose tensors are pending

    def flush() -> Iterator[tuple[str, torch.Tensor]]:
        converted = to_hf_state_dict(pending, model, dtype)
        pending.clear()
        for key in list(converted):
            yield key, converted.pop(key)

    for key, value in raw:
        owner = _lora_layer_of(key, layers)
        if pending and (owner is None or owner != unit):
            yield from flush()
        unit = owner
        pending[key] = value
        if owner is None:
            yield from flush()
    yield from flush()


def _lora_layer_of(key: str, layers: dict[str, tuple[float, bool]]) -> str | None:
    """The LoRA layer (a :func:`lora_layers` name) a state-dict key belongs to, or None."""
    for marker in (".base_layer.", ".lora_"):
        if marker in key and (prefix := key.split(marker, 1)[0]) in layers:
            return prefix
    return None


def tied_output_key(model: torch.nn.Module) -> str | None:
    """Name of the output-embedding weight when the config ties it to the input embedding."""
    model = base_hf_model(model)
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return None
    output = model.get_output_embeddings()
    for name, module in model.named_modules():
        if module is output:
            return f"{name}.weight"
    return None


def without_tied_output(state_dict: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` without the output embedding when ``model``'s config ties it to the input
    embedding (state dicts list the one tensor under both names): what a checkpoint stores and a
    weight sync sends, once."""
    tied_key = tied_output_key(model)
    return {k: v for k, v in state_dict.items() if k != tied_key}


def _architecture_name(model: PreTrainedModel) -> str:
    """The transformers class name, seen through FSDP2's dynamic ``FSDP<Class>`` subclass."""
    for cls in type(model).__mro__:
        if issubclass(cls, PreTrainedModel) and not issubclass(cls, FSDPModule):
            return cls.__name__
    return type(model).__name__


def _standalone_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its storage: safetensors refuses views into shared buffers."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _write_safetensors(directory: Path, state_dict: dict[str, torch.Tensor]) -> None:
    plan = split_torch_state_dict_into_shards(state_dict, max_shard_size=MAX_SHARD_SIZE)
    for filename, names in plan.filename_to_tensors.items():
        shard = {name: state_dict[name].contiguous() for name in names}
        save_file(shard, directory / filename, metadata={"format": "pt"})
    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_adapter_folder(directory: str | Path, tensors: dict[str, torch.Tensor], adapter: dict[str, Any]) -> Path:
    """A PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) that vLLM loads
    as a LoRA adapter; written under a temporary name, then renamed into place."""
    final = Path(directory)
    temp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, temp / "adapter_model.safetensors")
    (temp / "adapter_config.json").write_text(json.dumps(adapter, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    temp.rename(final)
    return final


def merge_adapter_folder(
    adapter: str | Path,
    base: str | Path,
    model_class: Any = None,
    config: Any = None,
    dtype: torch.dtype | str = "auto",
) -> PreTrainedModel:
    """The base model in ``base`` (``model_class``, a causal LM by default, built with ``config`` when
    given) loaded in ``dtype``, with the PEFT adapter folder ``adapter`` merged into its weights. An adapter
    on the embedding or head of a base that ties them is refused (:func:`check_tied_head_unadapted`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raylign.models.loading import check_tied_head_unadapted

    kwargs: dict[str, Any] = {"dtype": dtype}
    if config is not None:
        kwargs["config"] = config
    model = (model_class or AutoModelForCausalLM).from_pretrained(base, **kwargs)
    try:
        adapted = PeftModel.from_pretrained(model, str(adapter))
    except RuntimeError as err:  # torch's load_state_dict: tensors of other shapes than the base's
        if "size mismatch" not in str(err):
            raise
        first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
        raise ValueError(f"the adapter {adapter} does not fit the base model {base}: {first}") from None
    check_tied_head_unadapted(adapted, f"the target_modules of {Path(adapter) / 'adapter_config.json'}")
    return adapted.merge_and_unload()


def write_hf_folder(
    directory: str | Path,
    state_dict: dict[str, torch.Tensor],
    model: torch.nn.Module,
    dtype: torch.dtype,
    tokenizer: Any | None = None,
) -> Path:
    """Write the folder via a temp sibling and a rename, so readers never see half a model."""
    final = Path(directory)
    temp = final.parent / f".{final.name}.tmp"
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir(parents=True)
    hf_model = base_hf_model(model)
    weights = {k: _standalone_cpu(v) for k, v in without_tied_output(state_dict, model).items()}
    _write_safetensors(temp, weights)
    config = copy.deepcopy(hf_model.config)
    config.architectures = [_architecture_name(hf_model)]
    config.dtype = dtype
    if hasattr(config, "quantization_config"):  # the folder holds plain tensors, a 4-bit base's dequantised
        del config.quantization_config
    config.save_pretrained(temp)
    if getattr(hf_model, "generation_config", None) is not None:
        hf_model.generation_config.save_pretrained(temp)
    if tokenizer is not None:
        tokenizer.save_pretrained(temp)
    if final.exists():
        shutil.rmtree(final)
    temp.rename(final)
    return final
