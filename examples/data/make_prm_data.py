"""Write the synthetic step-labelled arithmetic chains of examples/prm_tiny.yaml.

Each row is a chain of single-digit steps such as "3+4=7", "7-2=5"; a step's label says
whether its own arithmetic is right. Some chains contain wrong steps (a result off by one or
two); the next step continues from the written (wrong) result. Run from the repository root:

    python examples/data/make_prm_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def make_step(value: int, wrong: bool, rng: random.Random) -> tuple[str, int]:
    """One step from ``value`` (0-9): '+b' or '-b' with a result in 0-9, shown wrong when ``wrong``."""
    op = rng.choice([op for op in "+-" if (value < 9 if op == "+" else value > 0)])
    operand = rng.randint(1, 9 - value if op == "+" else value)
    result = value + operand if op == "+" else value - operand
    if wrong:
        result = rng.choice([r for r in range(result - 2, result + 3) if r != result and 0 <= r <= 9])
    return f"{value}{op}{operand}={result}", result


def make_chain(num_steps: int, rng: random.Random) -> dict:
    value = rng.randint(0, 9)
    first_wrong = rng.randint(0, num_steps)  # num_steps: no wrong step
    steps, labels = [], []
    for k in range(num_steps):
        wrong = k == first_wrong or (k > first_wrong and rng.random() < 0.3)
        step, value = make_step(value, wrong, rng)
        steps.append(step)
        labels.append(not wrong)
    return {"prompt": "check each step", "steps": steps, "labels": labels}


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    rng = random.Random(0)
    write(HERE / "prm_train.jsonl", [make_chain(4, rng) for _ in range(300)])
    write(HERE / "prm_eval.jsonl", [make_chain(4, rng) for _ in range(50)])
