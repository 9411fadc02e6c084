"""The documentation's figures: what their renderers draw from a run's records, and that the
images in docs/img and the pages that show them match.

The records are written by the trainers' own ``MetricsLogger`` and read back with
``read_metrics``, as ``scripts/docs_plots.py`` reads a run's ``metrics.jsonl``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from datetime import date
from pathlib import Path

import matplotlib.image
import pytest

from raylign.config.train import LoggingConfig
from raylign.trainers.metrics import MetricsLogger, read_metrics
from raylign.trainers.plots import (
    machine_caption,
    metric_points,
    plot_async_throughput,
    plot_math_example,
    plot_quickstart_reward,
)
from tests.clean_run import REPO

DOCS = REPO / "docs"
IMAGES = DOCS / "img"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")


def logged(tmp_path: Path, steps: list[tuple[int, dict[str, float]]]) -> list[dict[str, float]]:
    """``steps`` logged in this order by the trainers' metrics logger, read back from metrics.jsonl."""
    logger = MetricsLogger(tmp_path / "run", LoggingConfig(tensorboard=False, progress_bar=False), {})
    for step, metrics in steps:
        logger.log(metrics, step)
    logger.close()
    return read_metrics(tmp_path / "run")


def read_png(path: Path) -> tuple[int, int]:
    """(height, width) of a PNG, after checking its signature."""
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    return matplotlib.image.imread(path).shape[:2]


def test_quickstart_figure_draws_each_steps_reward_and_the_held_out_evaluations(tmp_path):
    # As the RL trainer logs: the first evaluation before step 1, evaluations as their own records.
    records = logged(
        tmp_path,
        [
            (0, {"eval/all/reward_mean": 0.3, "eval/all/pass@1": 0.0}),
            (1, {"reward/mean": 0.25, "response_length/mean": 6.0}),
            (2, {"reward/mean": 0.5, "response_length/mean": 5.0}),
            (2, {"eval/all/reward_mean": 0.6, "eval/all/pass@1": 0.5}),
            (3, {"reward/mean": 0.5, "response_length/mean": 5.0}),
            (4, {"reward/mean": 0.75, "response_length/mean": 4.0}),
            (4, {"eval/all/reward_mean": 0.9, "eval/all/pass@1": 0.8}),
        ],
    )
    png = tmp_path / "quickstart.png"
    drawn = plot_quickstart_reward(records, png, "a machine, 2026-01-02\nraylign quickstart")
    assert drawn == {
        "reward/mean": [(1, 0.25), (2, 0.5), (3, 0.5), (4, 0.75)],
        "eval/all/reward_mean": [(0, 0.3), (2, 0.6), (4, 0.9)],
        "eval/all/pass@1": [(0, 0.0), (2, 0.5), (4, 0.8)],
    }
    assert read_png(png) == (390, 640)  # 6.4 x 3.9 inches at 100 dpi


def test_math_figure_draws_reward_length_and_pass_at_1_of_each_eval_source_but_not_all(tmp_path):
    def evaluation(arithmetic: float, gsm: float) -> dict[str, float]:
        return {
            "eval/arithmetic/pass@1": arithmetic,
            "eval/arithmetic/reward_mean": arithmetic,
            "eval/gsm_symbolic/pass@1": gsm,
            "eval/all/pass@1": (64 * arithmetic + 50 * gsm) / 114,
        }

    records = logged(
        tmp_path,
        [
            (0, evaluation(7 / 64, 0.0)),
            (1, {"reward/mean": 0.19, "response_length/mean": 39.0}),
            (2, {"reward/mean": 0.28, "response_length/mean": 30.5}),
            (2, evaluation(16 / 64, 0.0)),
            (3, {"reward/mean": 0.03, "response_length/mean": 19.0}),
            (4, {"reward/mean": 0.53, "response_length/mean": 19.25}),
            (4, evaluation(19 / 64, 1 / 50)),
        ],
    )
    png = tmp_path / "math.png"
    drawn = plot_math_example(records, png, "a machine, 2026-01-02")
    assert drawn == {
        "reward/mean": [(1, 0.19), (2, 0.28), (3, 0.03), (4, 0.53)],
        "eval/arithmetic/pass@1": [(0, 0.109375), (2, 0.25), (4, 0.296875)],
        "eval/gsm_symbolic/pass@1": [(0, 0.0), (2, 0.0), (4, 0.02)],
        "response_length/mean": [(1, 39.0), (2, 30.5), (3, 19.0), (4, 19.25)],
    }
    assert read_png(png) == (360, 1100)


def test_math_figure_refuses_a_run_without_evaluations(tmp_path):
    records = logged(tmp_path, [(1, {"reward/mean": 0.2, "response_length/mean": 30.0})])
    with pytest.raises(ValueError, match="evaluated nothing"):
        plot_math_example(records, tmp_path / "math.png", "a machine")


def test_an_evaluation_logged_after_later_steps_is_drawn_at_its_own_step(tmp_path):
    # An asynchronous run logs the evaluation of step 2 once it finishes, after step 3's record.
    records = logged(
        tmp_path,
        [
            (2, {"reward/mean": 0.1}),
            (3, {"reward/mean": 0.2}),
            (2, {"eval/all/pass@1": 0.4}),
            (4, {"eval/all/pass@1": 0.6}),
        ],
    )
    assert metric_points(records, "eval/all/pass@1") == [(2, 0.4), (4, 0.6)]
    assert metric_points(records, "reward/mean") == [(2, 0.1), (3, 0.2)]


def test_async_figure_draws_seconds_per_step_tokens_per_second_and_length_of_each_setting(tmp_path):
    # Rows as benchmarks/async_rl.py writes them to --json (other columns left out).
    report = {
        "tiny": [
            {"setting": "sync", "step_s": 0.41, "generate": 0.17, "tokens_per_s": 228.0, "len_mean": 5.1},
            {"setting": "k=1", "step_s": 0.48, "generate": 0.0, "tokens_per_s": 350.0, "len_mean": 5.4},
            {"setting": "k=2+partial", "step_s": 0.56, "generate": 0.0, "tokens_per_s": 328.0, "len_mean": 11.1},
        ]
    }
    (tmp_path / "results.json").write_text(json.dumps(report))
    rows = json.loads((tmp_path / "results.json").read_text())["tiny"]
    png = tmp_path / "async.png"
    drawn = plot_async_throughput(rows, png, "a machine, 2026-01-02", title="sync against async")
    assert drawn == {
        "step_s": {"sync": 0.41, "k=1": 0.48, "k=2+partial": 0.56},
        "tokens_per_s": {"sync": 228.0, "k=1": 350.0, "k=2+partial": 328.0},
        "len_mean": {"sync": 5.1, "k=1": 5.4, "k=2+partial": 11.1},
    }
    assert read_png(png) == (380, 1200)


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads /proc/cpuinfo")
def test_the_caption_names_the_cpu_its_cores_its_vector_and_bf16_flags_and_the_day():
    fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    caption = machine_caption(date(2026, 1, 2))
    if "model name" in fields:
        assert caption.startswith(fields["model name"] + ",")
    assert f"{os.cpu_count()} cores" in caption
    for flag in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"):
        assert (flag in caption) == (flag in flags), flag
    assert caption.endswith("2026-01-02")


def image_links() -> dict[Path, list[str]]:
    """Every page under docs/ -> the images it shows (Markdown ``![alt](path)``), as written."""
    return {page: IMAGE_LINK.findall(page.read_text()) for page in sorted(DOCS.rglob("*.md"))}


def test_every_image_in_docs_img_is_shown_by_a_page_and_every_image_shown_exists():
    shown = set()
    for page, links in image_links().items():
        for link in links:
            path = (page.parent / link).resolve()
            assert path.is_file(), f"{page.relative_to(REPO)} shows {link}, which does not exist"
            shown.add(path)
    in_img = {path.resolve() for path in IMAGES.iterdir()}
    assert sorted(p.name for p in in_img - shown) == [], "images in docs/img that no page shows"


def test_each_docs_figure_is_in_docs_img_small_and_named_with_the_command_that_remakes_it():
    spec = importlib.util.spec_from_file_location("docs_plots", REPO / "scripts" / "docs_plots.py")
    assert spec is not None and spec.loader is not None
    docs_plots = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = docs_plots  # its dataclass looks its module up there
    spec.loader.exec_module(docs_plots)
    pages = "\n".join(page.read_text() for page in image_links())
    for name, target in docs_plots.TARGETS.items():
        png = IMAGES / target.png
        assert png.read_bytes()[:8] == PNG_SIGNATURE, png
        assert png.stat().st_size < 150 * 1024, f"{png} is {png.stat().st_size} bytes"
        assert f"python scripts/docs_plots.py --only {name}`" in pages, name
