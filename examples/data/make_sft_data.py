"""Write the letter-reversal data of the SFT and RL examples (run from the repository root).

python examples/data/make_sft_data.py
"""

import json
from pathlib import Path

from raylign.tasks.strings import make_string_rows

HERE = Path(__file__).parent


def write(rows: list[dict], name: str) -> None:
    (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    rows = make_string_rows("reverse", 700, seed=0, alphabet="abcdefgh", min_len=3, max_len=4)
    write(rows[:500], "sft_reverse_train.jsonl")
    write(rows[500:600], "sft_reverse_eval.jsonl")
    write([{"prompt": r["prompt"], "label": r["completion"]} for r in rows[600:]], "rl_reverse_prompts.jsonl")
