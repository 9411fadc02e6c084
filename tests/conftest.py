"""Suite-wide settings: one thread per process (2-core machines), no hub access."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/raylign/torch_extensions"))

import torch  # noqa: E402

torch.set_num_threads(1)
torch.set_flush_denormal(True)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (starting Ray costs seconds)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=8,  # logical slots: actors here are mostly idle waiting on each other
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                      "RAY_AUTH_MODE": "disabled"}},
        )
    yield ray
    ray.shutdown()
