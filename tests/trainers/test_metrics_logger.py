"""The metrics log of a resumed run: each step once, nothing lost."""

from __future__ import annotations

import json

from raylign.config.train import LoggingConfig
from raylign.trainers.metrics import MetricsLogger, read_metrics


def test_resume_moves_records_past_the_checkpoint_aside(tmp_path):
    first = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), {})
    for step in range(8):
        first.log({"loss": float(step)}, step)
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "loss"')  # the last line, cut short by a kill

    resumed = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), {})
    assert resumed.resume_from(6) == 2
    resumed.log({"loss": 70.0}, 7)
    resumed.close()

    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(s, float(s)) for s in range(7)] + [(7, 70.0)]
    aside = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    assert json.loads(aside[0])["step"] == 7 and json.loads(aside[0])["loss"] == 7.0
    assert aside[1] == '{"step": 8, "loss"'


def test_resume_with_nothing_past_the_checkpoint_changes_nothing(tmp_path):
    first = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), {})
    for step in range(4):
        first.log({"loss": float(step)}, step)
    first.close()
    before = (tmp_path / "metrics.jsonl").read_text()
    resumed = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), {})
    assert resumed.resume_from(3) == 0
    resumed.close()
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert not (tmp_path / "metrics.superseded.jsonl").exists()


def test_a_run_that_starts_over_sets_every_earlier_record_aside(tmp_path):
    first = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), {})
    for step in range(3):  # step 0 too: a run's data or first-evaluation record
        first.log({"loss": float(step)}, step)
    first.close()

    again = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), {})
    assert again.start_over() == 3
    again.log({"loss": 10.0}, 0)
    again.close()

    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(0, 10.0)]
    aside = [json.loads(line) for line in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in aside] == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_a_resume_at_the_last_step_sets_that_steps_evaluation_aside_as_it_evaluates_again(tmp_path):
    first = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), {})
    first.log({"train/loss": 1.0}, 4)
    first.log({"eval/loss": 2.0}, 4)  # the final evaluation, logged after the last checkpoint
    first.close()

    again = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), {})
    assert again.resume_from(4, evaluates_again=True) == 1
    again.log({"eval/loss": 2.5}, 4)
    again.close()

    assert read_metrics(tmp_path)[0]["train/loss"] == 1.0
    assert [r.get("eval/loss") for r in read_metrics(tmp_path)] == [None, 2.5]
    aside = [json.loads(line) for line in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval/loss"]) for r in aside] == [(4, 2.0)]


def test_closing_waits_a_bounded_time_for_a_wandb_run_that_never_finishes(tmp_path, monkeypatch, caplog):
    """wandb's finish() sets no limit (it can wait for a network for ever); closing the metrics, which
    every run's end and every run's error go through, waits WANDB_FINISH_TIMEOUT_S and says so."""
    import threading
    import time

    from raylign.trainers import metrics

    release = threading.Event()

    class UploadThatNeverEnds:  # wandb is not a dependency of the tests: what its run does on a dead network
        def finish(self):
            release.wait(3600)

    monkeypatch.setattr(metrics, "WANDB_FINISH_TIMEOUT_S", 0.3)
    logger = MetricsLogger(tmp_path, LoggingConfig(), {})
    logger._wandb = UploadThatNeverEnds()
    start = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="raylign"):
            logger.close()
        assert time.monotonic() - start < 5
    finally:
        release.set()
    assert "wandb: the run did not finish its uploads within 0.3 s" in caplog.text
    logger.close()  # closing twice does nothing
