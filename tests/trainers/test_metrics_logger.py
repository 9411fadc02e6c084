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
