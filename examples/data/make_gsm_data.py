"""Write GSM8K-style math problems with numeric answers for the SmolLM2 GRPO example.

Problems come from reasoning-gym's `gsm_symbolic` generator (templated GSM8K problems with
fresh numbers); the files are committed, so running the example needs no extra package.

    pip install reasoning-gym && python examples/data/make_gsm_data.py
"""

import json
from pathlib import Path

import reasoning_gym

HERE = Path(__file__).parent
INSTRUCTION = "Solve the problem step by step, then give the final number as \\boxed{answer}."


def rows(size: int, seed: int) -> list[dict]:
    data = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    return [{"prompt": f"{item['question']}\n{INSTRUCTION}", "label": str(item["answer"]), "data_source": "gsm_symbolic"}
            for item in data]


if __name__ == "__main__":
    for name, size, seed in (("gsm_train.jsonl", 400, 1), ("gsm_eval.jsonl", 50, 2)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows(size, seed)))
        print(f"wrote {HERE / name}")
