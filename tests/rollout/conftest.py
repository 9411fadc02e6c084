"""Tiny models for the rollout tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def untied_model_dir(tmp_path_factory):
    """Llama, separate output head, fp32."""
    from raylign.models.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("untied") / "model",
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        tie_word_embeddings=False,
        seed=2,
    )
