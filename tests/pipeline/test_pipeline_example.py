"""The example pipeline of examples/pipeline end to end through the console entry point:
generate -> score -> select -> sft, on a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from raylign.cli.main import main

from .helpers import read_jsonl

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "pipeline"
NUM_PROMPTS = len(read_jsonl(EXAMPLES / "prompts.jsonl"))


@pytest.mark.slow
def test_example_pipeline_runs_from_prompts_to_a_fine_tuned_model(tmp_path, model_dir, ray_session, monkeypatch):
    monkeypatch.chdir(REPO)  # the example configs use paths relative to the repository root
    out = tmp_path / "pipeline"
    steps = [
        [
            "generate",
            "--config",
            str(EXAMPLES / "generate.yaml"),
            "--model.path",
            str(model_dir),
            "--output_path",
            str(out / "generations.jsonl"),
            "--progress_bar",
            "false",
        ],
        [
            "score",
            "--config",
            str(EXAMPLES / "score.yaml"),
            "--input_path",
            str(out / "generations.jsonl"),
            "--output_path",
            str(out / "scored.jsonl"),
            "--progress_bar",
            "false",
        ],
        [
            "select",
            "--config",
            str(EXAMPLES / "select.yaml"),
            "--input_path",
            str(out / "scored.jsonl"),
            "--best_of_n.output_path",
            str(out / "best_of_n.jsonl"),
            "--pairs.output_path",
            str(out / "pairs.jsonl"),
        ],
        [
            "sft",
            "--config",
            str(EXAMPLES / "sft.yaml"),
            "--model.path",
            str(model_dir),
            "--data.train",
            str(out / "best_of_n.jsonl"),
            "--train.output_dir",
            str(out / "sft"),
            "--train.max_steps",
            "2",
            "--train.logging.progress_bar",
            "false",
            "--train.logging.tensorboard",
            "false",
        ],
    ]
    for argv in steps:
        assert main(argv) == 0, argv[0]

    generations = read_jsonl(out / "generations.jsonl")
    assert len(generations) == NUM_PROMPTS
    assert all(len(row["responses"]) == 4 and row["task"] in ("reverse", "copy") for row in generations)
    scored = read_jsonl(out / "scored.jsonl")
    assert [len(row["rewards"]) for row in scored] == [4] * NUM_PROMPTS
    assert set(scored[0]["reward_metrics"]) == {"letters", "exact_match"}
    # Every prompt with a non-blank response that ended before max_new_tokens gives one SFT row, carrying its
    # task (keep_keys).
    finished = sum(
        any(text.strip() and reason != "length" for text, reason in zip(row["responses"], row["finish_reasons"]))
        for row in scored
    )
    best = read_jsonl(out / "best_of_n.jsonl")
    assert 0 < len(best) == finished and all(row["task"] in ("reverse", "copy") for row in best)
    assert (out / "scored.metrics.json").is_file()
    assert (out / "sft" / "final" / "config.json").is_file()


def test_example_dpo_config_reads_the_selected_pairs_with_its_default_keys(capsys):
    assert main(["dpo", "--config", str(EXAMPLES / "dpo.yaml"), "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "outputs/pipeline/pairs.jsonl" in printed
    assert "chosen_key: chosen" in printed and "rejected_key: rejected" in printed
