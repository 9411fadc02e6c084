"""Fixtures of the reward tests: a tiny reward model folder and uvicorn servers on loopback."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from raylign.models.tiny import build_tiny_model

# The normalisation written into the tiny reward model's config.json.
RM_MEAN = 0.25
RM_STD = 2.0


def chatml(prompt: str, response: str) -> str:
    """The tiny tokenizer's ChatML rendering of [user: prompt, assistant: response], written out by hand."""
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{response}<|im_end|>\n"


def _reference_text_scores(model_dir: Path, texts: list[str]) -> list[float]:
    """One unpadded Hugging Face forward per text: the score head's output at the last token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    scores = []
    for text in texts:
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            scores.append(model(input_ids=ids).logits[0, 0].item())
    return scores


@pytest.fixture(scope="session")
def reference_rm_text_scores():
    """``reference_rm_text_scores(model_dir, texts)``: raw scores of hand-rendered texts by an independent forward."""
    return _reference_text_scores


@pytest.fixture(scope="session")
def reference_rm_scores():
    """``reference_rm_scores(model_dir, prompts, responses)``: raw scores of the ChatML two-turn conversations."""
    return lambda model_dir, prompts, responses: _reference_text_scores(
        model_dir, [chatml(p, r) for p, r in zip(prompts, responses)]
    )


@pytest.fixture(scope="session")
def rm_mean_std() -> tuple[float, float]:
    return RM_MEAN, RM_STD


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> Path:
    """A one-label Qwen2 sequence-classification model with a unit-scale head and known mean/std in config.json."""
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("tiny_rm")
    lm_dir = build_tiny_model(root / "lm", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    model = AutoModelForSequenceClassification.from_pretrained(lm_dir, num_labels=1)
    torch.manual_seed(0)
    with torch.no_grad():  # the default init (std 0.02) makes all scores nearly equal
        model.score.weight.normal_(0.0, 1.0)
    model.config.raylign_reward_mean = RM_MEAN
    model.config.raylign_reward_std = RM_STD
    rm_dir = root / "rm"
    model.save_pretrained(rm_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (lm_dir / name).exists():
            shutil.copy(lm_dir / name, rm_dir / name)
    return rm_dir


class LoopbackServer:
    """Serves ``app`` with uvicorn in a thread on 127.0.0.1 and a free port, for a ``with`` block."""

    def __init__(self, app):
        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/score"

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


@pytest.fixture
def loopback_server() -> type[LoopbackServer]:
    """``with loopback_server(app) as server:`` serves ``app`` at ``server.url`` on 127.0.0.1."""
    return LoopbackServer


@pytest.fixture
def unused_loopback_url() -> Iterator[str]:
    """A /score address on 127.0.0.1 where nothing listens: its port stays bound, without listening,
    until the test ends, so no other process can start listening there meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/score"
