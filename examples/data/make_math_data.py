"""Write the math prompts of the SmolLM2 GRPO example (examples/rl_grpo_smollm2_math.yaml).

Both sources come from reasoning-gym and end with the same instruction to box the answer:

* ``arithmetic`` (train and eval): two-term sums and differences of 1-2 digit numbers
  (``basic_arithmetic``). SmolLM2-135M-Instruct gets 10-30% of them right and about half of
  its 4-sample groups mix right and wrong answers, so GRPO has a signal to learn from.
* ``gsm_symbolic`` (eval only): templated GSM8K word problems with fresh numbers. The 135M
  model solves about 1% of them, so groups of a few samples are nearly always all wrong and
  give GRPO nothing to learn from; they are reported as a separate eval source.

The files are committed, so running the example needs no extra package.

    pip install reasoning-gym && python examples/data/make_math_data.py
"""

import json
from pathlib import Path

import reasoning_gym

HERE = Path(__file__).parent
INSTRUCTION = "Put the final answer in \\boxed{}."
ARITHMETIC = dict(
    min_terms=2,
    max_terms=2,
    min_digits=1,
    max_digits=2,
    operators=("+", "-"),
    allow_parentheses=False,
    allow_negation=False,
)


def rows(generator: str, source: str, size: int, seed: int, **settings) -> list[dict]:
    """``size`` prompt rows of a reasoning-gym generator, each with its answer as the label."""
    data = reasoning_gym.create_dataset(generator, size=size, seed=seed, **settings)
    return [
        {"prompt": f"{item['question']} {INSTRUCTION}", "label": str(item["answer"]), "data_source": source}
        for item in data
    ]


def without(items: list[dict], seen: list[dict]) -> list[dict]:
    """``items`` less the prompts that are also in ``seen``: eval problems the policy never trained on."""
    prompts = {r["prompt"] for r in seen}
    return [r for r in items if r["prompt"] not in prompts]


def write(name: str, items: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in items))
    print(f"wrote {len(items)} rows to {HERE / name}")


if __name__ == "__main__":
    # reasoning-gym seeds item i with seed + i, so the eval seeds lie far from the train seed's range.
    train = rows("basic_arithmetic", "arithmetic", 400, seed=1, **ARITHMETIC)
    write("arith_train.jsonl", train)
    candidates = rows("basic_arithmetic", "arithmetic", 100, seed=100_000, **ARITHMETIC)
    write("arith_eval.jsonl", without(candidates, train)[:64])
    write("gsm_eval.jsonl", rows("gsm_symbolic", "gsm_symbolic", 50, seed=100_000))
