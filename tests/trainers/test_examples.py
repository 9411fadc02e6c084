"""The SmolLM2 math example's config runs on the tiny model. (The tiny SFT and RL examples run as
their README section and guides give them, in a fresh clone: tests/cli/test_readme_commands.py and
the runnable blocks of docs/getting-started.md and docs/guides/rl.md, tests/docs/test_docs.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from raylign.cli.main import main
from raylign.trainers.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_math_example_config_runs_with_its_data_and_reward(tmp_path, tiny_model_dir, monkeypatch, ray_session):
    """The SmolLM2 math example's data files, math reward and per-source eval, on the tiny model (the
    real model takes ~11 minutes; examples/README.md has those numbers). Eval completions are cut
    at train.eval_max_new_tokens, training ones at sampling.max_new_tokens."""
    monkeypatch.chdir(ROOT)
    code = main(
        [
            "rl",
            "--config",
            "examples/rl_grpo_smollm2_math.yaml",
            "--model.path",
            str(tiny_model_dir),
            "--model.dtype",
            "float32",
            "--rollout.engine",
            "hf",
            "--rollout.dtype",
            "float32",
            "--train.output_dir",
            str(tmp_path / "rl"),
            "--train.max_steps",
            "1",
            "--train.prompts_per_step",
            "2",
            "--sampling.max_new_tokens",
            "6",
            "--data.max_prompt_length",
            "512",  # the tiny tokenizer needs more tokens than SmolLM2's
            "--train.eval_max_new_tokens",
            "3",
            "--train.eval_every",
            "0",
            "--train.export",
            "false",
            "--train.logging.progress_bar",
            "false",
        ]
    )
    assert code == 0
    records = read_metrics(tmp_path / "rl")
    evals = [r for r in records if "eval/all/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 1]  # before and after training
    for record in evals:
        assert 0 < record["eval/arithmetic/response_length"] <= 3
        assert 0 < record["eval/gsm_symbolic/response_length"] <= 3
        assert 0.0 <= record["eval/arithmetic/pass@1"] <= 1.0
    (train,) = [r for r in records if "reward/mean" in r]
    # A random model almost never ends early (end of sequence is 1 of 512 tokens): training samples
    # run past the eval limit, up to their own.
    assert 3 < train["response_length/max"] <= 6
