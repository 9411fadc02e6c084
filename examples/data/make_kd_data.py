"""Write the SFT-style prompt/completion rows of examples/kd_tiny.yaml (letter reversal).

Distillation trains the student on the teacher's next-token distributions at the completion
tokens of these rows. Run from the repository root:

    python examples/data/make_kd_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def make_row(rng: random.Random) -> dict:
    letters = [rng.choice("abcdefgh") for _ in range(rng.randint(3, 5))]
    return {"prompt": f"reverse: {' '.join(letters)}", "completion": " ".join(letters[::-1])}


if __name__ == "__main__":
    rng = random.Random(0)
    rows = [make_row(rng) for _ in range(240)]
    (HERE / "kd_train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
