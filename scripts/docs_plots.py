"""Regenerate the figures in docs/img from runs of the commands they show.

Each target runs its command as a user would, from the repository root, then draws its figure
from what that run logged (the trainers' metrics.jsonl, the benchmark's JSON results):

  quickstart  raylign quickstart                                        -> docs/img/quickstart_reward.png
  math        raylign rl --config examples/rl_grpo_smollm2_math.yaml    -> docs/img/math_example.png
  async       python benchmarks/async_rl.py --steps 6 --prompts-per-step 8 -> docs/img/async_throughput.png

The targets run one after the other: each uses every core. On 2 CPU cores the quickstart takes
about 4 minutes, the math example 11-15 and the benchmark about 10, longer while other work shares
the cores. Under each figure a caption line names the machine (CPU model, cores, AMX / AVX-512 /
AVX2 flags, a GPU if any), the day the run ended and the command.

    python scripts/docs_plots.py                      # all three
    python scripts/docs_plots.py --only quickstart
    python scripts/docs_plots.py --render-only        # redraw from the runs already in --work
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from raylign.trainers.metrics import read_metrics  # noqa: E402 - after the repository is on the path
from raylign.trainers.plots import (  # noqa: E402
    machine_caption,
    plot_async_throughput,
    plot_math_example,
    plot_quickstart_reward,
)

BIN = Path(sys.executable).parent  # raylign's console script sits beside the interpreter running this


@dataclass(frozen=True)
class Target:
    command: str  # as a user types it; the run's own folder is added by output_args
    output_args: Callable[[Path], list[str]]
    result: str  # the file the figure is drawn from, under the run's folder
    png: str  # under --out
    timeout_min: float
    render: Callable[[Path, Path, str], object]  # (result file, PNG, caption)


ASYNC_COMMAND = "python benchmarks/async_rl.py --steps 6 --prompts-per-step 8"

TARGETS = {
    "quickstart": Target(
        command="raylign quickstart",
        output_args=lambda run: ["--output_dir", str(run)],
        result="rl/metrics.jsonl",
        png="quickstart_reward.png",
        timeout_min=30,
        render=lambda result, png, caption: plot_quickstart_reward(read_metrics(result.parent), png, caption),
    ),
    "math": Target(
        command="raylign rl --config examples/rl_grpo_smollm2_math.yaml",
        output_args=lambda run: ["--train.output_dir", str(run)],
        result="metrics.jsonl",
        png="math_example.png",
        timeout_min=60,
        render=lambda result, png, caption: plot_math_example(read_metrics(result.parent), png, caption),
    ),
    "async": Target(
        command=ASYNC_COMMAND,
        output_args=lambda run: ["--workdir", str(run), "--json", str(run / "results.json")],
        result="results.json",
        png="async_throughput.png",
        timeout_min=90,
        render=lambda result, png, caption: plot_async_throughput(
            json.loads(result.read_text())["tiny"],
            png,
            caption,
            title="Synchronous against asynchronous GRPO: tiny model, vLLM, 8 prompts x 4 samples a step",
        ),
    ),
}


def argv_of(target: Target, run: Path) -> list[str]:
    """The command's words, its program taken from this environment (``python`` is this interpreter)."""
    program, *rest = shlex.split(target.command)
    executable = sys.executable if program == "python" else str(BIN / program)
    return [executable, *rest, *target.output_args(run)]


def run_target(name: str, target: Target, run: Path, timeout_min: float) -> float:
    """Runs ``target`` into a fresh ``run`` folder, its output in ``<run>.log``; returns the seconds it took."""
    if run.exists():
        shutil.rmtree(run)  # a run left there would be resumed, not repeated
    run.parent.mkdir(parents=True, exist_ok=True)
    log_path = run.with_suffix(".log")
    print(f"[{name}] {target.command}  (output: {run}, log: {log_path})", flush=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv_of(target, run), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_min * 60)
        except subprocess.TimeoutExpired:
            stop(proc)
            raise SystemExit(
                f"[{name}] `{target.command}` did not finish within {timeout_min:g} min (--timeout-minutes); "
                f"it was stopped; its output is in {log_path}"
            ) from None
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"[{name}] `{target.command}` exited with code {code}:\n{tail}\n(all of it: {log_path})")
    seconds = time.monotonic() - start
    print(f"[{name}] finished in {seconds / 60:.1f} min", flush=True)
    return seconds


def stop(proc: subprocess.Popen) -> None:
    """Ends the command and what it started in its session: SIGTERM, then SIGKILL after 30 s."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
    print(f"process group {proc.pid} did not end after SIGKILL", file=sys.stderr)


def render(name: str, target: Target, run: Path, out: Path) -> Path:
    result = run / target.result
    if not result.is_file():
        raise SystemExit(f"[{name}] {result} is missing: run the target first (without --render-only)")
    day = date.fromtimestamp(result.stat().st_mtime)
    png = out / target.png
    target.render(result, png, f"{machine_caption(day)}\n{target.command}")
    print(f"[{name}] wrote {png} ({png.stat().st_size / 1024:.0f} KiB)", flush=True)
    return png


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", default=",".join(TARGETS), help=f"comma-separated targets to make, of: {', '.join(TARGETS)}"
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=REPO / "outputs" / "docs-plots",
        help="where the runs go, one folder and one log per target; a target's folder is replaced when it runs",
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img", help="where the PNGs go")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: redraw from the runs already in --work (the caption names this machine)",
    )
    parser.add_argument(
        "--timeout-minutes",
        type=float,
        default=None,
        help="limit of each run (default: " + ", ".join(f"{n} {t.timeout_min:g}" for n, t in TARGETS.items()) + ")",
    )
    args = parser.parse_args()
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in TARGETS]
    if unknown or not names:
        parser.error(f"--only: unknown target(s) {unknown}; choose from {', '.join(TARGETS)}")
    work = args.work.resolve()
    for name in names:
        target, run = TARGETS[name], work / name
        if not args.render_only:
            run_target(name, target, run, args.timeout_minutes or target.timeout_min)
        render(name, target, run, args.out)


if __name__ == "__main__":
    main()
