"""Write the prompts of the pipeline example: prompts.jsonl (reverse / copy a few letters).

Each row is {"prompt": "reverse: c a b", "label": "b a c", "task": "reverse"}: the label is
the exact answer, which the reward sources of score.yaml compare the responses with, and
"task" is passed through every step. Run from the repository root:

    python examples/pipeline/make_prompts.py
"""

from __future__ import annotations

import json
from pathlib import Path

from raylign.tasks.strings import make_string_rows


def make_prompts(num_per_task: int, seed: int) -> list[dict[str, str]]:
    rows = []
    for offset, task in enumerate(("reverse", "copy")):
        for row in make_string_rows(task, num_per_task, seed=seed + offset, alphabet="abcdefgh", min_len=3, max_len=4):
            rows.append({"prompt": row["prompt"], "label": row["completion"], "task": task})
    return rows


if __name__ == "__main__":
    path = Path(__file__).parent / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in make_prompts(32, seed=0)))
    print(f"wrote {path}")
