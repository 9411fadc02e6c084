from __future__ import annotations

from pathlib import Path

import pytest

from raylign.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, num_layers=2)
