"""Synthetic string tasks with known answers: copy and reverse short letter sequences.

Used by the quickstart, the tests and the RL examples: a tiny model can learn them in
minutes on a CPU, and the answer is checked exactly.
"""

from __future__ import annotations

import random
from typing import Literal

Task = Literal["copy", "reverse"]


def make_string_rows(
    task: Task,
    num_rows: int,
    seed: int = 0,
    alphabet: str = "abcdefgh",
    min_len: int = 3,
    max_len: int = 5,
    exclude: set[str] | None = None,
) -> list[dict[str, str]]:
    """Rows ``{"prompt": "reverse: a b c", "completion": "c b a"}``; letters are space-separated
    so each letter is its own token. ``exclude`` holds inputs to leave out (a held-out set)."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    seen = set(exclude or ())
    attempts = 0
    while len(rows) < num_rows:
        attempts += 1
        if attempts > 100 * num_rows:
            raise ValueError(f"cannot draw {num_rows} distinct {task} rows from alphabet {alphabet!r}")
        letters = [rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len))]
        prompt = f"{task}: {' '.join(letters)}"
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = letters if task == "copy" else letters[::-1]
        rows.append({"prompt": prompt, "completion": " ".join(answer)})
    return rows


def exact_match(response: str, answer: str) -> bool:
    """True when the response, stripped of surrounding whitespace, equals the answer."""
    return response.strip() == answer.strip()


def letter_match_reward(prompts, responses, labels, **metadata) -> list[float]:
    """Reward for the letter tasks: the fraction of answer letters in the right place.

    Partial credit gives a dense signal (a tiny model rarely gets a whole answer right at
    first); an exact answer scores 1.0 and extra letters lower the score.
    """
    rewards = []
    for response, label in zip(responses, labels):
        got, want = response.split(), str(label).split()
        hits = sum(a == b for a, b in zip(got, want))
        rewards.append(hits / max(len(want), len(got), 1))
    return rewards
