"""A colocated weight sync: seconds, and how far each policy rank's memory rises, beside the model's size.

With ``placement.colocate`` every policy rank runs a rollout engine in its own process, and a sync
hands that engine the trained weights. This script starts what an RL run starts for it (a policy
``WorkerGroup`` of ``--ranks`` FSDP2 ranks, each with its engine loaded by ``start_local_engine``)
and calls ``sync_weights`` ``--syncs`` times. Meanwhile a thread here reads every rank's resident
memory (``psutil``, every 2 ms) and keeps its highest rise above its value just before the first
sync: what the syncs held beside the sharded policy and the engine's own weights (freed memory
mostly stays with the process, so the high-water mark is the figure, not each sync's own rise).

Printed, per sync: rank 0's ``sync/total_s`` and ``sync/gather_s``, and each rank's high-water rise
so far in MB; then the medians of the syncs after the first (warm-up) and the rises, beside the
model's bytes and the machine's memory-copy and TCP-loopback rates measured at the start.

    python benchmarks/colocated_sync.py                          # SmolLM2-135M, 2 ranks, hf engines, bf16
    python benchmarks/colocated_sync.py --engine vllm --syncs 4
    python benchmarks/colocated_sync.py --model tiny --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from child_runs import machine
from weight_sync import model_folder


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="the policy model")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the engine in each policy rank")
    parser.add_argument("--ranks", type=int, default=2, help="policy ranks (FSDP2), each with its own engine")
    parser.add_argument("--syncs", type=int, default=4, help="syncs to time; the first is warm-up")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="model and engine dtype")
    parser.add_argument("--bucket-mb", type=float, default=32.0, help="as rollout.bucket_mb")
    parser.add_argument("--json", type=Path, help="also write every sync's figures to this file")
    return parser.parse_args()


def run_config(model_path: str, args: argparse.Namespace, scratch: Path) -> dict:
    """The config dump the controller hands its policy workers for a colocated GRPO run."""
    import yaml

    from raylign.config.base import resolve_config
    from raylign.config.rl import RLConfig

    prompts = scratch / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hello.", "label": "hello"}) + "\n")
    data = {
        "preset": "grpo",
        "model": {"path": model_path, "dtype": args.dtype},
        "reward": {"sources": [{"kind": "exact_match"}]},
        "rollout": {"engine": args.engine, "dtype": args.dtype, "max_model_len": 512, "bucket_mb": args.bucket_mb},
        "data": {"train": [{"path": str(prompts)}]},
        "engine": {"backend": "fsdp2"},
        "placement": {"colocate": True, "policy_workers": args.ranks},
        "algorithm": {"kl_mode": "none", "kl_coef": 0.0},
        "train": {"output_dir": str(scratch / "run"), "logging": {"progress_bar": False, "tensorboard": False}},
    }
    path = scratch / "run.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return resolve_config(RLConfig, path).model_dump(mode="json")


class PeakRise:
    """The highest resident size of each process above its size at the start, read every 2 ms
    until :meth:`stop`; :meth:`rises` reads it so far."""

    def __init__(self, pids: list[int]):
        import psutil

        self.processes = [psutil.Process(pid) for pid in pids]
        self.start = [p.memory_info().rss for p in self.processes]
        self.peak = list(self.start)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.is_set():
            for i, process in enumerate(self.processes):
                self.peak[i] = max(self.peak[i], process.memory_info().rss)
            time.sleep(0.002)

    def rises(self) -> list[int]:
        return [peak - start for peak, start in zip(self.peak, self.start)]

    def stop(self) -> list[int]:
        self.done.set()
        self.thread.join(timeout=10)
        return self.rises()


def main() -> None:
    args = parse_args()
    if args.syncs < 2:
        raise SystemExit("--syncs must be at least 2: the first sync is warm-up")
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from raylign.cluster import ray_session
    from raylign.engine.export import without_tied_output
    from raylign.rl.group import WorkerGroup

    hw = machine("float32")
    print(
        f"machine: {hw['cpu']} ({hw['capability']}, {' '.join(hw['flags'])}), {hw['cores']} cores; "
        f"memory copy {hw['copy_gb_s']:.1f} GB/s, TCP loopback {hw['loopback_gb_s']:.2f} GB/s (one thread each)"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="raylign-colocated-") as scratch, ray_session():
        path = model_folder(args.model, args.dtype, Path(scratch))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
        weights = without_tied_output(dict(model.state_dict()), model)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        del model, weights
        cfg = run_config(path, args, Path(scratch))
        group = WorkerGroup("policy", cfg, args.ranks, 1, None, env={"OMP_NUM_THREADS": "1"})
        try:
            group.call("start_local_engine", path)
            pids = ray.get([w.__ray_call__.remote(lambda self: os.getpid()) for w in group.workers], timeout=60)
            watch = PeakRise(pids)
            for sync in range(1, args.syncs + 1):
                stats = group.call("sync_weights", sync)[0]
                time.sleep(0.01)  # a last reading
                rises = watch.rises()
                rows.append({"total_s": stats["sync/total_s"], "gather_s": stats["sync/gather_s"], "rise": rises})
                print(
                    f"sync {sync}: {stats['sync/total_s']:.3f} s (gathering {stats['sync/gather_s']:.3f} s); "
                    f"highest memory rise per rank so far, MB: {', '.join(f'{r / 1e6:.0f}' for r in rises)}"
                )
            rises = watch.stop()
        finally:
            group.kill()

    timed = rows[1:]
    total_s = statistics.median(r["total_s"] for r in timed)
    gather_s = statistics.median(r["gather_s"] for r in timed)
    print(
        f"\ncolocated sync of {args.model} ({nbytes / 1e6:.1f} MB {args.dtype}) on {args.ranks} FSDP2 ranks, "
        f"{args.engine} engines; median of syncs 2..{args.syncs}: {total_s:.3f} s, of it gathering {gather_s:.3f} s; "
        f"highest memory rise per rank {', '.join(f'{r / 1e6:.0f}' for r in rises)} MB "
        f"({', '.join(f'{r / nbytes:.2f}' for r in rises)} x the model); the model at the copy rate: "
        f"{nbytes / (hw['copy_gb_s'] * 1e9):.3f} s, at the loopback rate: {nbytes / (hw['loopback_gb_s'] * 1e9):.3f} s"
    )
    if args.json:
        args.json.write_text(json.dumps({"machine": hw, "num_bytes": nbytes, "syncs": rows}, indent=1))


if __name__ == "__main__":
    main()
