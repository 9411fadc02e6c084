"""``raylign merge-lora``: fold a PEFT LoRA adapter into its base model and write a plain HF folder."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from pydantic import Field

from raylign.config.base import Section
from raylign.files import read_json_object

log = logging.getLogger("raylign")


class MergeLoraConfig(Section):
    """raylign merge-lora: a LoRA adapter folder (adapter_config.json, adapter_model.safetensors; raylign
    writes one in <output_dir>/final/adapter of a LoRA run) merged into its base model; a reward model's adapter
    (task_type SEQ_CLS) gives a sequence-classification folder with the score head the adapter holds."""

    adapter: str = Field(..., description="The PEFT adapter folder.")
    base: str | None = Field(
        None,
        description="The base model folder, or 'smollm2-135m-instruct'; None: the base_model_name_or_path the "
        "adapter's config names.",
    )
    output_dir: str = Field(..., description="Folder to write the merged model and its tokenizer to.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="dtype of the merged weights; auto: the base model's own."
    )


def adapter_base(adapter: Path, given: str | None) -> str:
    """``given``, or else the base model an adapter folder's config names; raises naming the file
    when it is missing."""
    config_file = adapter / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: no such file; adapter must be a PEFT adapter folder")
    weights = [adapter / name for name in ("adapter_model.safetensors", "adapter_model.bin")]
    if not any(w.is_file() for w in weights):  # else PEFT looks for them on the hub and says only that
        raise FileNotFoundError(f"{weights[0]}: no such file (nor {weights[1].name}); the adapter has no weights")
    if given is not None:
        return given
    base = read_json_object(config_file).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{config_file}: names no base_model_name_or_path; give the base model with --base")
    return str(base)


def score_head_outputs(adapter: Path) -> int | None:
    """Outputs of the score head a sequence-classification adapter holds (``task_type: SEQ_CLS``: a reward
    model's, trained whole beside the LoRA matrices); None for any other adapter (a causal LM's)."""
    from safetensors import safe_open

    from raylign.models.heads import HEAD_NAME

    if read_json_object(adapter / "adapter_config.json").get("task_type") != "SEQ_CLS":
        return None
    weights = adapter / "adapter_model.safetensors"
    with safe_open(str(weights), framework="pt") as tensors:
        for name in tensors.keys():  # noqa: SIM118 (a safetensors file handle is not iterable)
            if name.endswith(f".{HEAD_NAME}.weight"):
                return int(tensors.get_slice(name).get_shape()[0])
    raise ValueError(
        f"{weights}: a sequence-classification adapter (task_type SEQ_CLS) without its '{HEAD_NAME}' head; "
        "merged, the head would be random"
    )


def run_merge_lora(cfg: MergeLoraConfig) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from raylign.engine.checkpoint import check_writable
    from raylign.engine.export import merge_adapter_folder
    from raylign.models import resolve_model_path

    adapter = Path(cfg.adapter)
    base_path = resolve_model_path(adapter_base(adapter, cfg.base))
    output = Path(cfg.output_dir)
    if output.is_file():
        raise NotADirectoryError(f"output_dir '{output}' is a file, not a folder")
    created = not output.exists()
    check_writable(output, "output_dir")  # before minutes of loading and merging
    try:
        dtype = "auto" if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        tokenizer = AutoTokenizer.from_pretrained(base_path)
        labels = score_head_outputs(adapter)
        if labels is None:
            merged = merge_adapter_folder(adapter, base_path, dtype=dtype)
        else:  # a reward model: its head comes from the adapter, and padded batches need the pad id in the config
            config = AutoConfig.from_pretrained(base_path, num_labels=labels, pad_token_id=tokenizer.pad_token_id)
            merged = merge_adapter_folder(adapter, base_path, AutoModelForSequenceClassification, config, dtype)
    except BaseException:
        if created:  # the check made it; a refused merge leaves nothing behind
            output.rmdir()
        raise
    merged.save_pretrained(output)
    tokenizer.save_pretrained(output)
    log.info("merged the adapter %s into %s: written to %s", adapter, base_path, output)
    return str(output)
