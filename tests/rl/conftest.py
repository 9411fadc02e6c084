"""Fixtures of the RL tests: one tiny policy and one prompt file for the whole session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raylign.models.tiny import build_tiny_model
from raylign.tasks.strings import make_string_rows


@pytest.fixture(scope="session")
def rl_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen2 with tied embeddings, fp32. Head size 32: the smallest vLLM's CPU
    attention supports, so the same folder serves the hf and the vllm engine."""
    return build_tiny_model(
        tmp_path_factory.mktemp("rl") / "policy", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=3
    )


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """32 copy-task prompts with their answers as labels."""
    path = tmp_path_factory.mktemp("rl_data") / "prompts.jsonl"
    rows = make_string_rows("copy", 32, seed=0)
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "label": r["completion"]}) + "\n" for r in rows))
    return path
