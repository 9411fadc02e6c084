"""Where one policy-training step's time goes: the policy worker's own update, phase by phase.

One GRPO step's samples (16: prompts of 48-80 tokens, responses of 32-96 tokens and one in four at
256) packed as the controller packs them (one row per micro-batch of at most 4,096 tokens), through
:meth:`raylign.rl.worker.ModelWorker.train_policy` on the ``local`` engine, on SmolLM2-135M-Instruct in
bf16 with the defaults of ``raylign rl`` (fp32 master weights and torch's fused AdamW; on-policy; the
KL to the reference as a loss term; the entropy measured without a graph). The worker's own calls are
timed where they are made, nothing else is changed:

* forward: the model up to and including its output layer (at the response tokens only);
* logprobs: the rest of :func:`raylign.rl.worker.response_logprobs` (log-softmax, gather, entropy);
* loss: the rest of the loss (policy-gradient surrogate, KL, aggregation, metrics);
* backward: ``engine.backward`` (autograd and the gradients' move into the fp32 masters);
* step: ``engine.step`` (clipping, AdamW on the masters, the bf16 weights written back).

Before each update the same micro-batches go through :meth:`ModelWorker.compute_logprobs` (a forward
without a graph, as the experience phase's behaviour and reference passes), timed on its own. Printed:
the median seconds of each over ``--repeats`` steps after one warm-up step, beside the floor of the
matrix products (a forward ``2 x (trunk weights x tokens + output layer x response tokens)`` FLOP, the
backward twice that) at the matmul GFLOP/s measured in the run on the same threads; the CPU, its
instruction set, the load average, the peak resident memory. A second table per side puts the same
work against the rates this model's own products reach (:func:`child_runs.model_matmul_gflops`: its
narrow projections run slower than a square product) with attention's products counted too
(:func:`attention_flop`), which the first floor leaves out. ``--profile`` adds torch.profiler's top
operators by self CPU time over one more update (its per-call overhead inflates the many small ones).

Each side runs in a child process with a policy actor's environment (one OpenMP thread at start,
raylign's allocator setting). ``--baseline DIR`` (repeatable) adds a side that imports raylign from
another checkout's ``DIR/raylign``; the sides then take turns step by step, so that a change in the
machine's load falls on all of them. About 2-4 minutes on 2 cores.

    python benchmarks/train_step_profile.py --profile
    mkdir /tmp/base && git archive HEAD raylign | tar -x -C /tmp/base
    python benchmarks/train_step_profile.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from child_runs import ALL_CORE_SIZES, CHILD_ENV, MATMUL_SIZES, model_matmul_gflops

PHASES = ("forward", "logprobs", "loss", "backward", "step")


def long_tailed_samples(count: int, vocab: int, seed: int) -> list:
    """GRPO-shaped samples: prompts of 48-80 tokens, responses mostly short with one in four at 256."""
    from raylign.rl.experience import Sample

    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        prompt, response = rng.randrange(48, 81), rng.choice([32, 40, 48, 64, 80, 96, 256, 256])
        ids = [rng.randrange(3, vocab) for _ in range(prompt + response)]
        logprobs = [-rng.uniform(0.0, 3.0) for _ in range(response)]
        samples.append(Sample(ids[:prompt], ids[prompt:], logprobs, "", "", None, "bench", "stop"))
    return samples


def micro_batches(samples: list, max_tokens: int, seed: int) -> list:
    """The step's micro-batches as the controller packs them: token-balanced, one row each, with group
    advantages, the engine's log-probs and reference log-probs."""
    from raylign.models.packed_attention import ONE_ROW
    from raylign.rl.experience import micro_batches_for_ranks, pack_samples, response_tensor

    generator = torch.Generator().manual_seed(seed)
    rollout = response_tensor([s.rollout_logprobs for s in samples])
    per_token = {
        "advantages": torch.randn(rollout.shape[0], 1, generator=generator).expand_as(rollout).contiguous(),
        "rollout_logprobs": rollout,
        "ref_logprobs": rollout + 0.05 * torch.randn(rollout.shape, generator=generator),
    }
    plan = micro_batches_for_ranks(samples, 1, max_tokens)[0]
    return [
        pack_samples(
            [samples[i] for i in micro],
            {name: t[micro] for name, t in per_token.items()},
            row_tokens=ONE_ROW,
            behaviour="this_policy",
        )
        for micro in plan
    ]


def policy_worker(model: str, dtype: str, threads: int) -> Any:
    """A policy :class:`ModelWorker` on the ``local`` engine in this process (no Ray, no process group)."""
    from raylign.engine import create_engine
    from raylign.models import load_causal_lm
    from raylign.rl.worker import ModelWorker

    cfg = {
        "model": {"path": model, "dtype": dtype},
        "data": {"train": [{"path": "unused.jsonl"}]},
        "reward": {"sources": [{"kind": "exact_match"}]},
        "placement": {"threads_per_worker": threads},
    }
    worker = ModelWorker("policy", cfg, rank=0, world_size=1, total_steps=1000)
    worker.engine = create_engine(load_causal_lm(worker.cfg.model), worker.cfg.engine, worker.cfg.optim, 1000)
    worker.module, worker.device = worker.engine.module, worker.engine.device
    return worker


class PhaseClock:
    """Seconds spent in each phase of ``train_policy``, from wrappers around the worker's own calls."""

    def __init__(self, worker: Any) -> None:
        import raylign.rl.worker as worker_module

        self.seconds: dict[str, float] = defaultdict(float)
        self._head_done = 0.0
        head = worker.module.get_output_embeddings()
        head.register_forward_hook(lambda *_: setattr(self, "_head_done", time.perf_counter()))
        self._wrap(worker_module, "response_logprobs", self._forward_and_logprobs)
        self._wrap(worker, "_policy_loss", self._timed("loss"))
        self._wrap(worker.engine, "backward", self._timed("backward"))
        self._wrap(worker.engine, "step", self._timed("step"))

    @staticmethod
    def _wrap(owner: Any, name: str, make: Any) -> None:
        setattr(owner, name, make(getattr(owner, name)))

    def _timed(self, phase: str) -> Any:
        def make(call: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return call(*args, **kwargs)
                finally:
                    self.seconds[phase] += time.perf_counter() - start

            return timed

        return make

    def _forward_and_logprobs(self, call: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = call(*args, **kwargs)
            end = time.perf_counter()
            self.seconds["forward"] += self._head_done - start
            self.seconds["logprobs"] += end - self._head_done
            self.seconds["loss"] -= end - start  # counted inside _policy_loss too
            return result

        return timed

    def lap(self) -> dict[str, float]:
        laps, self.seconds = dict(self.seconds), defaultdict(float)
        return laps


def matmul_flop(model: torch.nn.Module, batches: list) -> tuple[float, float]:
    """FLOP of one forward's matrix products: ``2 x (trunk weights x tokens + output layer x response tokens)``;
    and of the backward, twice that."""
    head = model.get_output_embeddings().weight.numel()
    trunk = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    trunk -= 0 if model.config.tie_word_embeddings else head
    tokens = sum(b.input_ids.numel() for b in batches)
    responses = sum(int(b.mask.sum()) for b in batches)
    forward = 2.0 * (trunk * tokens + head * responses)
    return forward, 2 * forward


def attention_flop(model: torch.nn.Module, samples: list) -> float:
    """FLOP of one forward's attention products (``Q K^T`` and ``A V``, causal: half of each) over every
    sample, attending within itself: ``2 x length^2 x query width`` per layer. The backward is twice that."""
    c = model.config
    width = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return 2.0 * c.num_hidden_layers * width * sum((len(s.prompt_ids) + len(s.response_ids)) ** 2 for s in samples)


class Side:
    """One side of the comparison in this process: the worker, its batch and its phase clock."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(args.seed)
        self.worker = policy_worker(args.model, args.dtype, args.threads)
        torch.set_num_threads(args.threads)
        self.samples = long_tailed_samples(args.samples, self.worker.module.config.vocab_size, args.seed)
        self.batches = micro_batches(self.samples, args.micro_batch_tokens, args.seed)
        self.clock = PhaseClock(self.worker)
        self.top = args.top

    def describe(self, args: argparse.Namespace) -> dict[str, Any]:
        import raylign
        from raylign.hardware import matmul_gflops

        sizes = MATMUL_SIZES if args.threads == 1 else ALL_CORE_SIZES
        dtype = getattr(torch, args.dtype)
        from raylign.models import resolve_model_path

        forward, backward = matmul_flop(self.worker.module, self.batches)
        module = self.worker.module
        head = module.get_output_embeddings().weight.numel()
        responses = sum(int(b.mask.sum()) for b in self.batches)
        shapes = model_matmul_gflops(str(resolve_model_path(args.model)), args.dtype, args.threads)
        return {
            "shape_rates": shapes,
            "head_flop": 2.0 * head * responses,
            "attention_flop": attention_flop(module, self.samples),
            "raylign": str(Path(raylign.__file__).parent),
            "attn": self.worker.module.config._attn_implementation,
            "rate_gflops": max(matmul_gflops(dtype, size=n, repeats=5, threads=args.threads) for n in sizes),
            "flop": {"forward": forward, "backward": backward},
            "tokens": sum(b.input_ids.numel() for b in self.batches),
            "responses": sum(int(b.mask.sum()) for b in self.batches),
            "micro_batches": len(self.batches),
        }

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        self.worker.compute_logprobs(self.batches)
        experience = time.perf_counter() - start
        self.clock.lap()  # the clock saw that forward too
        start = time.perf_counter()
        metrics = self.worker.train_policy(self.batches)
        total = time.perf_counter() - start
        laps = self.clock.lap()
        laps.update(total=total, other=total - sum(laps.values()))
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the heap is never trimmed
        return {**laps, "experience": experience, "loss_value": metrics["policy_loss_total"].value, "peak_mb": peak_mb}

    def profile(self) -> dict[str, list[tuple[str, float, int]]]:
        return top_ops(self.worker, self.batches, self.top)


def serve(args: argparse.Namespace) -> None:
    """A child's loop: a JSON line on stdout (after a marker) for each request read from stdin."""
    side = Side(args)
    requests = {"describe": lambda: side.describe(args), "step": side.step, "profile": side.profile}
    for line in sys.stdin:
        answer = requests[line.strip()]()
        print(MARKER + json.dumps(answer), flush=True)


MARKER = "@@train_step_profile@@ "


class Child:
    """A :func:`serve` process with a policy actor's environment (one OpenMP thread at start, raylign's
    allocator setting), importing raylign from ``raylign_root`` (this tree when None)."""

    def __init__(self, args: argparse.Namespace, raylign_root: Path | None) -> None:
        from raylign.cluster import actor_env

        env = {**os.environ, **CHILD_ENV, **actor_env()}
        if raylign_root is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(raylign_root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        command = [sys.executable, __file__, "--serve", *sys.argv[1:]]
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - the child's stderr, closed in close()
        self.process = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )

    def ask(self, request: str) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(request + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith(MARKER):
                return json.loads(line.removeprefix(MARKER))
        self.log.seek(0)
        tail = self.log.read()[-3000:]
        status = self.process.wait()
        raise RuntimeError(f"the child ended (exit status {status}) without answering {request!r}:\n{tail}")

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


def top_ops(worker: Any, batches: list, count: int) -> dict[str, list[tuple[str, float, int]]]:
    """torch.profiler's operators by self CPU time over one step, in all (``"step"``: ``(name, seconds,
    calls)``, the first row the total) and within each phase (``"phase shapes"``: grouped by input shapes)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import raylign.rl.worker as worker_module

    def labelled(owner: Any, name: str, label: str) -> None:
        call = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return call(*args, **kwargs)

        setattr(owner, name, wrapped)

    labelled(worker_module, "response_logprobs", "phase forward+logprobs")
    labelled(worker, "_policy_loss", "phase loss")
    labelled(worker.engine, "backward", "phase backward")
    labelled(worker.engine, "step", "phase step")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        worker.train_policy(batches)
    per_phase: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for event in prof.events():
        if event.name.startswith("phase "):
            continue
        phase, parent = "other", event.cpu_parent
        while parent is not None and not parent.name.startswith("phase "):
            parent = parent.cpu_parent
        if parent is not None:
            phase = parent.name.removeprefix("phase ")
        shapes = str([list(s) for s in event.input_shapes if s])[:80] if event.input_shapes else ""
        for key in (("step", event.name), (phase, f"{event.name} {shapes}")):
            entry = per_phase[key[0]][key[1]]
            entry[0] += event.self_cpu_time_total / 1e6
            entry[1] += 1
    result = {}
    for phase, ops in per_phase.items():
        total = sum(seconds for seconds, _ in ops.values())
        ranked = sorted(ops.items(), key=lambda item: item[1][0], reverse=True)[:count]
        result[phase] = [("(all)", total, 0)] + [(name, seconds, int(calls)) for name, (seconds, calls) in ranked]
    return result


def median_phases(steps: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(s[key] for s in steps) for key in (*PHASES, "other", "total", "experience")}


def print_side(label: str, info: dict[str, Any], steps: list[dict[str, float]], rate: float) -> None:
    """The side's median seconds per phase beside the floors at ``rate`` GFLOP/s."""
    floors = {"forward": info["flop"]["forward"] / rate / 1e9, "backward": info["flop"]["backward"] / rate / 1e9}
    medians = median_phases(steps)
    print(
        f"\n{label}: raylign from {info['raylign']}, attention {info['attn']}, {info['micro_batches']} "
        f"micro-batch(es), {info['tokens']} tokens, {info['responses']} response tokens; median of {len(steps)} steps"
    )
    print(f"{'phase':10s} {'seconds':>8s} {'share':>6s} {'floor s':>8s} {'floor/measured':>15s}")
    for phase in (*PHASES, "other", "total"):
        floor = floors.get(phase, sum(floors.values()) if phase == "total" else None)
        ratio = f"{floor / medians[phase]:15.2f}" if floor is not None else f"{'':15s}"
        floor_s = f"{floor:8.2f}" if floor is not None else f"{'':8s}"
        print(f"{phase:10s} {medians[phase]:8.3f} {medians[phase] / medians['total']:6.1%} {floor_s} {ratio}")
    floor = floors["forward"]
    print(
        f"{'experience':10s} {medians['experience']:8.3f} {'':6s} {floor:8.2f} {floor / medians['experience']:15.2f}"
        "  (compute_logprobs: a forward without a graph)"
    )
    print("updates, s:", " ".join(f"{s['total']:.2f}" for s in steps), f"; peak resident {steps[-1]['peak_mb']:.0f} MB")
    print("losses:", " ".join(f"{s['loss_value']:.8f}" for s in steps))
    # The same work at the rates this model's own products reach, attention's products counted.
    r, head, attention = info["shape_rates"], info["head_flop"], info["attention_flop"]
    trunk = info["flop"]["forward"] - head
    shaped = {
        "forward": (trunk / r["trunk_forward"] + head / r["head_forward"] + attention / rate) / 1e9,
        "backward": (2 * trunk / r["trunk_train"] + 2 * head / r["head_train"] + 2 * attention / rate) / 1e9,
    }
    print(
        f"\n{label}, at this model's own products ({r['rows']} rows, GFLOP/s: trunk {r['trunk_forward']:.0f} forward, "
        f"{r['trunk_train']:.0f} with backward; output layer {r['head_forward']:.0f}, {r['head_train']:.0f}) "
        f"with attention's {attention / 1e9:.1f} GFLOP a forward counted at {rate:.0f}:"
    )
    for phase, seconds in (*((p, medians[p]) for p in shaped), ("total", medians["total"])):
        floor = shaped[phase] if phase in shaped else sum(shaped.values())
        print(f"{phase:10s} {seconds:8.3f} {'':6s} {floor:8.2f} {floor / seconds:15.2f}")
    print(
        f"{'experience':10s} {medians['experience']:8.3f} {'':6s} {shaped['forward']:8.2f} "
        f"{shaped['forward'] / medians['experience']:15.2f}"
    )


def print_profile(label: str, profile: dict[str, list[tuple[str, float, int]]]) -> None:
    for phase, rows in profile.items():
        total = rows[0][1]
        title = "all phases, by name" if phase == "step" else f"phase {phase}, by input shapes"
        print(f"\n{label}: top operators by self CPU time, {title} ({total:.2f} s in the profiled step):")
        for name, seconds, calls in rows[1:]:
            print(f"  {seconds:7.3f} s {seconds / total:6.1%} {calls:6d}x  {name}")


def machine_line(dtype: str) -> str:
    from raylign.hardware import cpu_flags, cpu_model

    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags())
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()}, {flags}), {dtype}, load average {load}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model folder or smollm2-135m-instruct")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--samples", type=int, default=16, help="samples in the step (4 prompts x 4)")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="torch.profiler's top operators over one more step")
    parser.add_argument("--top", type=int, default=15, help="operators listed with --profile")
    parser.add_argument(
        "--baseline",
        type=Path,
        action="append",
        default=[],
        help="a checkout whose raylign/ to run in turn with this tree's (repeatable)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a child's loop
    args = parser.parse_args()

    if args.serve:
        serve(args)
        return
    print(machine_line(args.dtype))
    roots: dict[str, Path | None] = {str(root): root.resolve() for root in args.baseline}
    roots["this tree"] = None
    children: dict[str, Child] = {}
    info: dict[str, dict[str, Any]] = {}
    try:
        for label, root in roots.items():  # one at a time: a child measures the matmul rate once loaded
            children[label] = Child(args, root)
            info[label] = children[label].ask("describe")
        steps: dict[str, list[dict[str, float]]] = {label: [] for label in children}
        loads = [os.getloadavg()[0]]
        for repeat in range(args.repeats + 1):  # the first step of each side is warm-up
            for label, child in children.items():
                result = child.ask("step")
                if repeat:
                    steps[label].append(result)
            loads.append(os.getloadavg()[0])
        profiles = {label: child.ask("profile") for label, child in children.items()} if args.profile else {}
    finally:
        for child in children.values():
            child.close()
    rate = max(i["rate_gflops"] for i in info.values())
    measured = ", ".join(f"{label} {i['rate_gflops']:.0f}" for label, i in info.items())
    print(f"matmul {rate:.0f} GFLOP/s at {args.dtype} on {args.threads} threads (the best of the sides': {measured})")
    for label in children:
        print_side(label, info[label], steps[label], rate)
    for root in map(str, args.baseline):
        ratios = [b["total"] / a["total"] for a, b in zip(steps["this tree"], steps[root])]
        print(f"\n{root} / this tree, update by update: {' '.join(f'{r:.2f}' for r in ratios)}")
    for label, profile in profiles.items():
        print_profile(label, profile)
    print(f"\n1-minute load average during the steps: {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main()
