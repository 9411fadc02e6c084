"""Tiny random models built once per test session (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raylign.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A 2-layer, hidden-64 random Qwen2 (tied embeddings) with the ChatML byte-level tokenizer, float32."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer, hidden-64 random Llama with untied embeddings, float32."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", tie_word_embeddings=False, seed=1)


@pytest.fixture(scope="session", params=["qwen2", "llama"])
def tiny_model_dir(request, tiny_qwen2, tiny_llama) -> Path:
    """Each tiny architecture in turn."""
    return {"qwen2": tiny_qwen2, "llama": tiny_llama}[request.param]
