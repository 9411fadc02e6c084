"""Write the synthetic preference pairs of the rm and dpo examples: pairs_train.jsonl and pairs_eval.jsonl.

Every prompt asks for a reply to a few letters; the chosen reply is that many 'a' letters, the
rejected one repeats the prompt's letters. A reward model learns to prefer replies made of 'a',
and DPO moves a model's replies toward them. Run from the repository root:

    python examples/data/make_pairs_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

LETTERS = "bcdefgh"


def make_pairs(num_rows: int, seed: int, exclude: set[str] = frozenset()) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows, seen = [], set(exclude)
    while len(rows) < num_rows:
        letters = [rng.choice(LETTERS) for _ in range(rng.randint(2, 4))]
        prompt = "reply to: " + " ".join(letters)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "chosen": " ".join("a" * len(letters)), "rejected": " ".join(letters)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    here = Path(__file__).parent
    eval_rows = make_pairs(40, seed=1)
    train_rows = make_pairs(200, seed=0, exclude={r["prompt"] for r in eval_rows})
    write_jsonl(here / "pairs_train.jsonl", train_rows)
    write_jsonl(here / "pairs_eval.jsonl", eval_rows)
    print(f"wrote {len(train_rows)} train and {len(eval_rows)} eval pairs to {here}")
