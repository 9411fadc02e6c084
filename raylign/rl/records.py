"""What an RL run writes beside its metrics, and the random state its checkpoints carry.

``samples.jsonl`` holds a few completions of every step, ``trajectories.jsonl`` a few whole agent
episodes; a resumed run first sets aside the lines of the steps after its checkpoint, since it is
about to write them again, and a run that starts over sets aside all of them
(:func:`set_aside_records_after`).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raylign.rl.experience import Sample
from raylign.trainers.metrics import set_aside_lines


def write_samples(path: Path, samples: list[Sample], step: int, count: int) -> None:
    """The first ``count`` samples of step ``step``: prompt, response, label, reward, why it ended."""
    if not count:
        return
    with open(path, "a") as f:
        for s in samples[:count]:
            record = {
                "step": step,
                "prompt": s.prompt_text,
                "response": s.response_text,
                "label": s.label,
                "reward": s.reward,
                "finish_reason": s.finish_reason,
            }
            f.write(json.dumps(record, default=str) + "\n")


def write_trajectories(path: Path, samples: list[Sample], step: int, count: int, tokenizer: Any) -> None:
    """The first ``count`` agent episodes of step ``step``, each turn's text marked with where its
    tokens came from."""
    if not count:
        return
    with open(path, "a") as f:
        for s in samples[:count]:
            ep = s.episode
            record = {
                "step": step,
                "label": s.label,
                "reward": s.reward,
                "turn_rewards": [r for _, r in ep.turn_rewards],
                "end_reason": ep.end_reason,
                "turns": ep.turns,
                "tool_calls": ep.tool_calls,
                "tool_failures": ep.tool_failures,
                "prompt": s.prompt_text,
                "segments": ep.segments(tokenizer),
            }
            f.write(json.dumps(record, default=str) + "\n")


def set_aside_records_after(path: Path, step: int) -> int:
    """Move the records of steps past ``step`` from the JSON-lines file ``path`` to
    ``<name>.superseded.jsonl`` beside it: the run stopped after writing them and is about to write
    them again (a line cut short by the kill goes too: it was written after the checkpoint). ``step``
    -1: every record, for a run that starts over where another one logged. ``path`` is replaced
    atomically; returns how many records moved."""

    def step_of(line: str) -> float:
        try:
            return float(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            return math.inf

    return set_aside_lines(path, lambda line: step_of(line) > step)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
