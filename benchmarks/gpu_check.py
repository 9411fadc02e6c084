"""One-GPU check of raylign's GPU path: what runs, and how far each figure is from the device's limit.

Meant for a machine with one GPU and only what such a machine may carry (torch, transformers,
peft, accelerate; often no Ray, vLLM or DeepSpeed, and no network). Each check prints its figure
or why it was skipped, and the whole run stays under 8 minutes on a current GPU:

1. ``peak``: the device's bf16 matmul rate (square 8192 products, and the model's own layer shapes at
   the training batch) and copy bandwidth, measured here (the floors below);
2. ``sft``: raylign's ``local`` training engine, SFT steps of a Qwen2-0.5B-shaped model in bf16 on
   packed rows: tokens/s and model FLOP utilisation (6 x parameters x tokens against ``peak``);
3. ``fsdp2``: the same SFT step on raylign's ``fsdp2`` engine in a one-rank process group (nccl on
   the GPU), the model built on the meta device and read from its safetensors shard by shard; then
   its state offloaded and onloaded as a colocated run moves it, and one more step;
4. ``rl``: an RL update of the same model (reference pass, response-only log-probs, PPO-clip loss,
   backward, step): tokens/s and utilisation;
5. ``hf_rollout``: the ``hf`` rollout engine generating on the device: tokens/s against the
   bandwidth floor of decoding (every step reads every weight once);
6. ``ipc_handover``: the full bf16 weights handed to a second process on the same device through
   CUDA IPC (torch.multiprocessing), in size-bounded buckets: seconds per sync against bytes / copy
   bandwidth;
7. ``colocated``: trainer and rollout engine in one process, in ``raylign rl``'s colocated order
   (offload the optimizer, wake the engine's weights, sync, offload the weights, generate, put the
   engine to sleep, onload, train): peak and still-allocated device memory and seconds per phase,
   and the engine's log-probs of its samples against the trainer's on the same tokens;
8. ``raylign_rl``: where Ray and vLLM import, the quickstart's RL run on the vLLM engine.

    python benchmarks/gpu_check.py                              # on the GPU machine
    python benchmarks/gpu_check.py --device cpu --size tiny     # the same checks on a CPU, seconds
    python benchmarks/gpu_check.py --json results.json          # also write the figures

raylign's configs need pydantic; where a machine lacks it, carry its wheels (pure Python but for
``pydantic-core``): ``pip download --no-deps --only-binary=:all: --python-version 3.12
--platform manylinux2014_x86_64 -d wheels pydantic pydantic-core annotated-types typing-inspection``
and ``pip install --no-deps wheels/*.whl`` there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Qwen2-0.5B's body (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864) with the small local
# tokenizer's vocabulary instead of 151,936 tokens: no tokenizer can be downloaded here.
SIZES = {
    "0.5b": {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864},
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 256},
}
TRAIN_ROWS = {"0.5b": (4, 2048), "tiny": (2, 128)}  # packed rows x tokens per row of the training checks
BUCKET_BYTES = 256 * 2**20


class Skip(Exception):
    """A check that cannot run here; the message says why."""


def timed(device: torch.device, fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs, synchronised on GPUs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def sig(x: float) -> float:
    """``x`` to three significant digits."""
    return float(f"{x:.3g}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def peak_memory(device: torch.device, into: dict[str, Any], name: str) -> Iterator[None]:
    """Peak allocated device memory (GiB) of the block, under ``into[name]``; not measured on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        into[name] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


# ---------------------------------------------------------------- the checks


def check_peak(device: torch.device, size: str) -> dict[str, Any]:
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_s = timed(device, lambda: a @ b, repeats=10, warmup=3)
    x = torch.empty(2**28 if device.type == "cuda" else 2**24, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    copy_s = timed(device, lambda: y.copy_(x), repeats=10, warmup=2)
    host = {}
    if device.type == "cuda":  # device to host: into pageable memory (plain .to) and into pinned memory
        pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host["d2h_pageable_gb_s"] = sig(x.numel() / timed(device, lambda: x.to("cpu"), repeats=3) / 1e9)
        host["d2h_pinned_gb_s"] = sig(x.numel() / timed(device, lambda: pinned.copy_(x), repeats=3) / 1e9)
        host["h2d_pinned_gb_s"] = sig(x.numel() / timed(device, lambda: x.copy_(pinned), repeats=3) / 1e9)
    return {
        "bf16_tflops": sig(2 * n**3 / matmul_s / 1e12),
        "model_shapes_tflops": sig(model_shapes_rate(device, size)),
        "copy_gb_s": sig(2 * x.numel() / copy_s / 1e9),  # bytes read and written
        **host,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def model_shapes_rate(device: torch.device, size: str) -> float:
    """bf16 TFLOP/s of one layer's matrix products at the training checks' batch (every token of the step
    through q, k, v, o, gate, up and down): the rate the model's own shapes allow, a floor nearer to what
    a step can reach than the square product's."""
    shape = SIZES[size]
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    kv = hidden // shape["num_heads"] * shape["num_kv_heads"]
    tokens = TRAIN_ROWS[size][0] * TRAIN_ROWS[size][1]
    flop, seconds = 0.0, 0.0
    for inputs, outputs, count in ((hidden, hidden, 2), (hidden, kv, 2), (hidden, inner, 2), (inner, hidden, 1)):
        x = torch.randn(tokens, inputs, device=device, dtype=torch.bfloat16)
        w = torch.randn(outputs, inputs, device=device, dtype=torch.bfloat16)
        seconds += count * timed(device, lambda x=x, w=w: x @ w.T, repeats=5, warmup=2)
        flop += count * 2 * tokens * inputs * outputs
    return flop / seconds / 1e12


def build_model(workdir: Path, size: str) -> Path:
    from raylign.models.tiny import build_tiny_model

    folder = workdir / f"model-{size}"
    if not folder.exists():
        build_tiny_model(folder, arch="qwen2", tie_word_embeddings=True, dtype=torch.bfloat16, **SIZES[size])
    return folder


def load_model(folder: Path, device: torch.device) -> torch.nn.Module:
    """The model as raylign's training workers load it: packed samples attend only within themselves."""
    from raylign.config.model import ModelConfig
    from raylign.models import load_causal_lm

    return load_causal_lm(ModelConfig(path=str(folder), dtype="bfloat16"), device)


def packed_batch(vocab: int, rows: int, row_len: int, sample_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``rows`` packed rows of ``row_len`` tokens, each holding samples of ``sample_len`` tokens."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, row_len), generator=generator)
    positions = (torch.arange(row_len) % sample_len).expand(rows, row_len).contiguous()
    return {"input_ids": ids.to(device), "position_ids": positions.to(device)}


def train_engine(model: torch.nn.Module, steps: int, backend: str = "local", lr: float = 1e-6) -> Any:
    from raylign.config.engine import EngineConfig
    from raylign.config.optim import OptimConfig
    from raylign.engine import create_engine

    return create_engine(model, EngineConfig(backend=backend), OptimConfig(lr=lr, max_grad_norm=1.0), steps)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def check_sft(device: torch.device, folder: Path, size: str, peak: dict[str, Any]) -> dict[str, Any]:
    return sft_figures(train_engine(load_model(folder, device), steps=100), device, size, peak)


def check_fsdp2(device: torch.device, folder: Path, size: str, peak: dict[str, Any]) -> dict[str, Any]:
    """The same SFT step on raylign's ``fsdp2`` engine in a one-rank process group (nccl for the device's
    tensors on a GPU), the model built on the meta device and read from its safetensors shard by shard."""
    from raylign.config.engine import EngineConfig
    from raylign.config.model import ModelConfig
    from raylign.engine.distributed import ensure_process_group
    from raylign.models import load_causal_lm, loads_sharded

    ensure_process_group(timeout_s=300)
    model_cfg = ModelConfig(path=str(folder), dtype="bfloat16")
    empty = loads_sharded(model_cfg, EngineConfig(backend="fsdp2"))  # as the training workers decide it
    figures: dict[str, Any] = {"loaded": "shard by shard" if empty else "whole"}
    with peak_memory(device, figures, "load_gib"):
        engine = train_engine(load_causal_lm(model_cfg, empty=empty), steps=100, backend="fsdp2")
    if engine.device.type != device.type:
        raise RuntimeError(f"the fsdp2 engine placed the model on {engine.device}, not on {device}")
    figures.update(sft_figures(engine, device, size, peak))
    # The colocated moves of the sharded state: everything out, then back, then another step trains.
    begin = time.perf_counter()
    engine.offload()
    sync(device)
    figures["offload_s"] = sig(time.perf_counter() - begin)
    if device.type == "cuda":
        figures["held_offloaded_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
    begin = time.perf_counter()
    engine.onload()
    sync(device)
    figures["onload_s"] = sig(time.perf_counter() - begin)
    figures["step_s_after_onload"] = sft_figures(engine, device, size, peak)["step_s"]
    return figures


def sft_step(engine: Any, size: str, device: torch.device) -> Callable[[], None]:
    """One SFT step of ``engine`` (forward, backward, optimizer step) on the size's packed training batch."""
    from raylign.models import token_logprobs

    rows, row_len = TRAIN_ROWS[size]
    batch = packed_batch(engine.module.config.vocab_size, rows, row_len, row_len // 4, device)
    valid = (batch["position_ids"] > 0).float()

    def step() -> None:
        logprobs = token_logprobs(engine.module, batch["input_ids"], position_ids=batch["position_ids"])
        engine.backward(-(logprobs * valid).sum() / valid.sum())
        engine.step()

    return step


def sft_figures(engine: Any, device: torch.device, size: str, peak: dict[str, Any]) -> dict[str, Any]:
    """Seconds, utilisation and tokens/s of an SFT step of ``engine`` on packed rows, and its peak memory."""
    figures: dict[str, Any] = {}
    with peak_memory(device, figures, "peak_gib"):
        seconds = timed(device, sft_step(engine, size, device), repeats=5, warmup=2)
    tokens = TRAIN_ROWS[size][0] * TRAIN_ROWS[size][1]
    return {
        **figures,
        **utilisation(6 * n_params(engine.module) * tokens, seconds, peak),
        "tokens_per_s": round(tokens / seconds),
    }


def check_rl(device: torch.device, folder: Path, size: str, peak: dict[str, Any]) -> dict[str, Any]:
    import raylign.algorithms as alg
    from raylign.models import selected_token_logprobs

    policy = load_model(folder, device)
    reference = load_model(folder, device).eval().requires_grad_(False)
    engine = train_engine(policy, steps=100)
    rows, row_len = TRAIN_ROWS[size]
    sample_len = row_len // 4
    batch = packed_batch(policy.config.vocab_size, rows, row_len, sample_len, device)
    # the second half of every sample is its response: [samples, response length] flat positions
    response = (batch["position_ids"] >= sample_len // 2).flatten().nonzero().view(rows * 4, -1)
    advantages = torch.randn(rows * 4, generator=torch.Generator().manual_seed(1)).to(device)
    ppo = alg.POLICY_LOSSES.get("ppo")

    def step() -> None:
        with torch.no_grad():
            ref = selected_token_logprobs(reference, batch["input_ids"], response, position_ids=batch["position_ids"])
        logprobs = selected_token_logprobs(
            engine.module, batch["input_ids"], response, position_ids=batch["position_ids"]
        )
        assert isinstance(ref, torch.Tensor) and isinstance(logprobs, torch.Tensor)
        mask = torch.ones_like(logprobs)
        loss, _ = ppo(logprobs, logprobs.detach(), advantages, mask)
        kl = ((logprobs - ref) * mask).mean()
        engine.backward(loss + 0.01 * kl)
        engine.step()

    figures: dict[str, Any] = {}
    with peak_memory(device, figures, "peak_gib"):
        seconds = timed(device, step, repeats=5, warmup=2)
    tokens = rows * row_len
    flop = 8 * n_params(policy) * tokens  # policy forward + backward (6N) and the reference forward (2N)
    return {**figures, **utilisation(flop, seconds, peak), "tokens_per_s": round(tokens / seconds)}


def utilisation(flop: float, seconds: float, peak: dict[str, Any]) -> dict[str, Any]:
    achieved = flop / seconds / 1e12
    return {
        "step_s": sig(seconds),
        "tflops": sig(achieved),
        "mfu": sig(achieved / peak["bf16_tflops"]),
        "of_model_shapes": sig(achieved / peak["model_shapes_tflops"]),
    }


def rollout_engine(folder: Path, sleep: bool = False) -> Any:
    from raylign.config.rollout import RolloutConfig
    from raylign.rollout.hf_engine import HFEngine

    return HFEngine(str(folder), RolloutConfig(engine="hf", dtype="bfloat16", enable_sleep_mode=sleep))


def generate(engine: Any, prompts: int, n: int, new_tokens: int) -> tuple[int, float]:
    """Tokens generated and seconds taken for ``prompts`` prompts of 64 tokens x ``n`` samples."""
    start = time.perf_counter()
    completions = completions_of(engine, prompts, n, new_tokens)
    seconds = time.perf_counter() - start
    return sum(len(c.response_token_ids) for c in completions), seconds


def completions_of(engine: Any, prompts: int, n: int, new_tokens: int) -> list[Any]:
    from raylign.config.rollout import SamplingConfig

    # Unseeded: the hf engine runs all prompts as one left-padded generate call, as in an RL step.
    sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=new_tokens)
    prompt_ids = [[(7 * i + j) % 200 + 10 for j in range(64)] for i in range(prompts)]
    return asyncio.run(engine.generate(prompt_ids, sampling))


def check_hf_rollout(device: torch.device, folder: Path, size: str, peak: dict[str, Any]) -> dict[str, Any]:
    engine = rollout_engine(folder)
    prompts, n, new_tokens = (32, 4, 128) if size == "0.5b" else (4, 2, 16)
    generate(engine, 2, 1, 4)  # warm-up
    tokens, seconds = generate(engine, prompts, n, new_tokens)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    # Decoding reads every weight once per step for the whole batch: the bandwidth floor per step.
    steps = new_tokens
    floor_s = steps * weight_bytes / (peak["copy_gb_s"] / 2 * 1e9)
    return {
        "tokens_per_s": round(tokens / seconds),
        "seconds": round(seconds, 2),
        "floor_s": sig(floor_s),
        "floor_ratio": sig(floor_s / seconds),
    }


def _receiver(requests: Any, replies: Any, total_bytes: int, device_index: int | None) -> None:
    """The second process: copies each bucket it is handed into its own weight buffer."""
    device = torch.device("cuda", device_index) if device_index is not None else torch.device("cpu")
    weights = torch.empty(total_bytes, dtype=torch.uint8, device=device)
    while True:
        item = requests.get(timeout=120)
        if item is None:
            return
        offset, bucket = item
        weights[offset : offset + bucket.numel()].copy_(bucket)
        sync(device)
        del bucket
        replies.put(offset)


def check_ipc_handover(device: torch.device, folder: Path, size: str, peak: dict[str, Any]) -> dict[str, Any]:
    import torch.multiprocessing as mp

    model = load_model(folder, device)
    flat = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()])
    buckets = list(torch.split(flat, BUCKET_BYTES))
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    index = device.index if device.type == "cuda" else None
    receiver = ctx.Process(target=_receiver, args=(requests, replies, flat.numel(), index), daemon=True)
    receiver.start()
    try:

        def handover() -> None:
            offset = 0
            for bucket in buckets:  # one bucket in flight: the sender's buffer stays alive until it is copied
                requests.put((offset, bucket))
                if replies.get(timeout=120) != offset:
                    raise RuntimeError("the receiving process answered for another bucket")
                offset += bucket.numel()

        seconds = timed(device, handover, repeats=3, warmup=1)
    finally:
        requests.put(None)
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()
    floor_s = flat.numel() / (peak["copy_gb_s"] / 2 * 1e9)
    return {
        "bytes": flat.numel(),
        "buckets": len(buckets),
        "sync_s": sig(seconds),
        "floor_s": sig(floor_s),
        "floor_ratio": sig(floor_s / seconds),
    }


def check_colocated(device: torch.device, folder: Path, size: str, peak: dict[str, Any]) -> dict[str, Any]:
    """Trainer and hf engine on one device in the colocated order of ``raylign rl``: offload the optimizer,
    wake the engine's weights, sync, offload the trainer's weights, generate, put the engine to sleep,
    onload, train; two such steps, the second reported (the first also pins the host buffers the
    offloads reuse: its offload seconds are given apart). Per phase: the peak device memory of the phase,
    what stays allocated after it (GiB) and its seconds. Then the engine's log-probs of what it generated
    against the trainer's on the same tokens, packed into one row as the trainer's log-prob passes pack
    them: the drift a sync or the kernels would cause."""
    trainer = train_engine(load_model(folder, device), steps=100, lr=1e-3)  # each step moves the weights
    engine = rollout_engine(folder, sleep=True)
    train = sft_step(trainer, size, device)
    peaks: dict[str, Any] = {}
    held: dict[str, float] = {}
    took: dict[str, float] = {}

    def phase(name: str, work: Callable[[], Any]) -> Any:
        begin = time.perf_counter()
        with peak_memory(device, peaks, name):
            out = work()
        took[name] = sig(time.perf_counter() - begin)
        if device.type == "cuda":
            held[name] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
        return out

    train()  # the optimizer state exists from here on, as in a run
    asyncio.run(engine.sleep(1))
    first_offload_s = 0.0
    for step in range(2):
        for figures in (peaks, held, took):
            figures.clear()
        phase("offload_optimizer", lambda: trainer.offload(keep_weights=True))
        phase("wake_weights", lambda: asyncio.run(engine.wake_up(["weights"])))
        sync_s = phase("sync", lambda: asyncio.run(engine.update_weights(trainer.module.named_parameters())))
        phase("offload_weights", trainer.offload)
        phase("wake_kv_cache", lambda: asyncio.run(engine.wake_up(["kv_cache"])))
        completions = phase("generate", lambda: completions_of(engine, 8 if size == "0.5b" else 2, 4, 64))
        phase("sleep_engine", lambda: asyncio.run(engine.sleep(1)))
        phase("onload", trainer.onload)
        drift = logprob_drift(trainer.module, completions, device)  # the trainer still holds the synced weights
        phase("train", train)
        offload_s = took["offload_optimizer"] + took["offload_weights"] + took["sleep_engine"]
        if step == 0:
            first_offload_s = sig(offload_s)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return {
        "engine_weights_gib": round(weights / 2**30, 2),
        "peak_gib": peaks,
        "held_gib": held,
        "phase_s": took,
        "sync_s": sig(sync_s),
        "step_s": round(sum(took.values()), 2),
        "first_step_offload_s": first_offload_s,
        "pinned_host_gib": round((trainer.stash.nbytes + engine.stash.nbytes) / 2**30, 2),
        "offload_gb_s": sig(offloaded_bytes(trainer, engine) / 1e9 / offload_s),
        **drift,
    }


def offloaded_bytes(trainer: Any, engine: Any) -> int:
    """Bytes an offload moves to the host: the trainer's weights, fp32 masters and optimizer state, and
    the engine's weights."""
    tensors = list(trainer.module.parameters()) + list(engine.model.parameters())
    if trainer.master is not None:
        tensors += trainer.master.masters
    tensors += [v for state in trainer.optimizer.state.values() for k, v in state.items() if k != "step"]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def logprob_drift(model: torch.nn.Module, completions: list[Any], device: torch.device) -> dict[str, Any]:
    """Max and mean |engine - trainer| log-prob over the completions' tokens, the trainer's computed on
    the completions packed into one row (each sample attends only within itself)."""
    from raylign.models import selected_token_logprobs

    ids: list[int] = []
    positions: list[int] = []
    index: list[int] = []
    engine_logprobs: list[float] = []
    for c in completions:
        tokens = c.prompt_token_ids + c.response_token_ids
        index += [len(ids) + len(c.prompt_token_ids) + j for j in range(len(c.response_token_ids))]
        ids += tokens
        positions += range(len(tokens))
        engine_logprobs += c.response_logprobs
    with torch.no_grad():
        trainer_logprobs = selected_token_logprobs(
            model,
            torch.tensor([ids], device=device),
            torch.tensor(index, device=device),
            position_ids=torch.tensor([positions], device=device),
        )
    assert isinstance(trainer_logprobs, torch.Tensor)
    diff = (trainer_logprobs.float().cpu() - torch.tensor(engine_logprobs)).abs()
    return {
        "tokens_scored": len(index),
        "logprob_max_abs": sig(diff.max().item()),
        "logprob_mean_abs": sig(diff.mean().item()),
    }


def check_raylign_rl(device: torch.device, folder: Path, size: str, peak: dict[str, Any]) -> dict[str, Any]:
    missing = [name for name in ("ray", "vllm") if importlib.util.find_spec(name) is None]
    if missing:
        raise Skip(f"{' and '.join(missing)} not importable here")
    if device.type != "cuda":
        raise Skip("the CPU path of raylign rl is covered by the test suite")
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "raylign.cli.main", "quickstart", "--engine", "vllm", "--rl_steps", "10"]
        command += ["--output_dir", out]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"raylign quickstart on vLLM failed:\n{done.stderr[-3000:]}")
        summary = json.loads((Path(out) / "summary.json").read_text())
    return {"seconds": round(time.perf_counter() - start, 1), "summary": summary}


CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "sft": check_sft,
    "fsdp2": check_fsdp2,
    "rl": check_rl,
    "hf_rollout": check_hf_rollout,
    "ipc_handover": check_ipc_handover,
    "colocated": check_colocated,
    "raylign_rl": check_raylign_rl,
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b", help="model shape (tiny: a smoke run)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of: {', '.join(CHECKS)}")
    parser.add_argument("--workdir", default=None, help="where the model is built (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results: dict[str, Any] = {"size": args.size, "peak": check_peak(device, args.size)}
    print(f"peak: {results['peak']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(args.workdir or tmp), args.size)
        for name in args.checks.split(","):
            start = time.perf_counter()
            try:
                results[name] = CHECKS[name](device, folder, args.size, results["peak"])
                print(f"{name}: {results[name]} ({time.perf_counter() - start:.1f} s)", flush=True)
            except Skip as why:
                results[name] = {"skipped": str(why)}
                print(f"{name}: skipped, {why}", flush=True)
            except Exception as error:  # one failing check must not hide the others' figures
                results[name] = {"failed": f"{type(error).__name__}: {error}"}
                print(f"{name}: FAILED, {type(error).__name__}: {error}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    from raylign.engine.distributed import exit_process

    main()
    exit_process(0)  # the fsdp2 check's process group stays alive: no interpreter shutdown under it
