"""Write the unpaired desirable / undesirable rows of examples/kto_tiny.yaml.

Prompts ask to copy a few letters; a desirable completion copies them, an undesirable one
gives them reversed. Each prompt appears once, with one completion: the data is unpaired.
Run from the repository root:

    python examples/data/make_kto_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def make_row(rng: random.Random) -> dict:
    letters = rng.sample("abcdefgh", rng.randint(3, 5))
    desirable = rng.random() < 0.5
    answer = letters if desirable else letters[::-1]
    return {"prompt": f"copy: {' '.join(letters)}", "completion": " ".join(answer), "label": desirable}


if __name__ == "__main__":
    rng = random.Random(0)
    rows = [make_row(rng) for _ in range(240)]
    (HERE / "kto_train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
