"""Train a tiny model with engine backends; the engine tests launch this file.

Run alone (``--runs local``) or under ``python -m torch.distributed.run --nproc_per_node 2``
(``--runs fsdp2,zero2,zero3``: the runs share one process group, one after the other, each in
its own folder ``<out>/<run>``, so that process start-up is paid once). Every rank sees the same
global batches and takes its own slice of each, scaling its micro-batch losses so that the
ranks' average equals the single-process loss.

Modes:
  crash   per run: train ``--crash-after`` steps with a checkpoint after each, train one more
          step and write that step's checkpoint files into the temp folder without committing
          it. Then the process exits hard with ``os._exit``: on disk every run looks exactly
          like a crash in the middle of saving, and nothing survives in memory.
  resume  per run: (1) train all ``--steps`` uninterrupted from scratch (the reference),
          checkpointing every step with keep_last=2, then save its weights and export it;
          (2) build a fresh model and engine, resume from the newest complete checkpoint of the
          crashed run and train to the end. Writes ``result.json`` and the weights of both.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from raylign.config.engine import EngineConfig
from raylign.config.optim import OptimConfig
from raylign.engine import create_engine
from raylign.engine.checkpoint import resume_latest, save_step_checkpoint, step_directory, temp_directory
from raylign.engine.distributed import (
    all_reduce_scalars,
    barrier,
    exit_process,
    get_rank,
    get_world_size,
    init_distributed,
)

GLOBAL_BATCH = 4  # sequences per micro-batch, split evenly across ranks
SEQ_LEN = 16
MICRO_BATCHES = 2
CRASH_EXIT_CODE = 17

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2, scheduler="cosine", min_lr_ratio=0.1, max_grad_norm=0.5)


# run name -> engine config fields
RUNS = {
    "local": {"backend": "local"},
    "fsdp2": {"backend": "fsdp2"},
    "zero2": {"backend": "deepspeed", "zero_stage": 2},
    "zero3": {"backend": "deepspeed", "zero_stage": 3},
    "fsdp2_offload": {"backend": "fsdp2", "offload_params": True, "offload_optimizer": True},
    # DeepSpeedCPUAdam: prebuilt by scripts/install.sh, else JIT-compiled on first use (cached under
    # TORCH_EXTENSIONS_DIR, which tests/conftest.py sets to raylign's default folder).
    "zero3_offload": {"backend": "deepspeed", "zero_stage": 3, "offload_params": True, "offload_optimizer": True},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True, help=f"comma-separated, from {sorted(RUNS)}")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", required=True, choices=["crash", "resume"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--crash-after", type=int, default=2)
    return parser.parse_args()


def build_engine(args: argparse.Namespace, run: str):
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    engine_cfg = EngineConfig(**RUNS[run], dist_timeout_s=600)
    return create_engine(model, engine_cfg, OPTIM, total_steps=args.steps)


def micro_batch(step: int, micro: int, vocab_size: int) -> torch.Tensor:
    """This rank's slice of global micro-batch ``(step, micro)``; identical data on every backend."""
    generator = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=generator)
    per_rank = GLOBAL_BATCH // get_world_size()
    return tokens[get_rank() * per_rank : (get_rank() + 1) * per_rank]


def train_step(engine, step: int, vocab_size: int) -> dict[str, float]:
    engine.train()
    rank_loss = 0.0
    for micro in range(MICRO_BATCHES):
        ids = micro_batch(step, micro, vocab_size).to(engine.device)
        loss = engine.module(input_ids=ids, labels=ids).loss / MICRO_BATCHES
        engine.backward(loss)
        rank_loss += loss.item()
    metrics = engine.step()
    (loss_mean,) = all_reduce_scalars([rank_loss], op="mean")
    # Draws from every global generator: equal draws after a resume prove the RNG states came back.
    probes = [random.random(), float(np.random.rand()), float(torch.rand(()))]
    return {"step": step, "loss": loss_mean, "grad_norm": metrics["grad_norm"], "lr": metrics["lr"], "rng": probes}


def crash_while_saving(args: argparse.Namespace, run: str, out: Path, vocab_size: int) -> None:
    engine = build_engine(args, run)
    root = out / "crash_ckpt"
    for step in range(1, args.crash_after + 1):
        train_step(engine, step, vocab_size)
        save_step_checkpoint(engine, root, step, {"step": step})
    crashed_step = args.crash_after + 1
    train_step(engine, crashed_step, vocab_size)
    temp = temp_directory(step_directory(root, crashed_step))
    if get_rank() == 0:
        temp.mkdir()
    barrier()
    # Every file of the checkpoint is written, but the commit (marker + rename) never happens.
    engine._write_checkpoint_files(temp, {"step": crashed_step})
    barrier()


def save_weights(engine, path: Path) -> None:
    state = engine.full_state_dict()
    if get_rank() == 0:
        torch.save(state, path)


def _kept(stream) -> dict:
    """A weight stream's names in order, its tensors (copied), and the most of them it kept alive at
    once: each yielded tensor is dropped here at once, so a stream that holds one tensor at a time shows 1."""
    import weakref

    names, tensors, refs, held = [], {}, [], 0
    for name, tensor in stream:
        held = max(held, 1 + sum(ref() is not None for ref in refs))
        names.append(name)
        tensors[name] = tensor.clone()
        refs.append(weakref.ref(tensor))
        del tensor
    return {"names": names, "tensors": tensors, "held_at_once": held}


def save_streamed(engine, path: Path) -> None:
    """What a weight sync sends (``iter_full_state``) as rank 0 sees it; and on the last rank what
    colocated engines load (``every_rank``), from the backend's stream and from the default whole-model
    gather broadcast from rank 0."""
    from raylign.engine.base import TrainEngine

    sent = _kept(engine.iter_full_state())
    if get_rank() == 0:
        torch.save(sent, path)
    every_rank = _kept(engine.iter_full_state(every_rank=True))
    broadcast = _kept(TrainEngine.iter_full_state(engine, every_rank=True))
    if get_rank() == get_world_size() - 1:
        torch.save({"stream": every_rank, "broadcast": broadcast}, path.with_name("every_rank_" + path.name))


def reference_then_resume(args: argparse.Namespace, run: str, out: Path, vocab_size: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    reference = build_engine(args, run)
    reference_log = []
    for step in range(1, args.steps + 1):
        reference_log.append(train_step(reference, step, vocab_size))
        save_step_checkpoint(reference, out / "reference_ckpt", step, {"step": step}, keep_last=2)
    save_weights(reference, out / "reference_weights.pt")
    save_streamed(reference, out / "streamed_weights.pt")
    reference.export_hf(out / "export", tokenizer)
    del reference

    resumed = build_engine(args, run)
    client_state = resume_latest(resumed, out / "crash_ckpt")
    assert client_state is not None, "no complete checkpoint to resume from"
    resumed_log = [train_step(resumed, step, vocab_size) for step in range(client_state["step"] + 1, args.steps + 1)]
    save_weights(resumed, out / "resumed_weights.pt")
    if get_rank() == 0:
        result = {
            "world_size": get_world_size(),
            "reference": reference_log,
            "resumed_from_step": client_state["step"],
            "resumed": resumed_log,
            "reference_checkpoints": sorted(p.name for p in (out / "reference_ckpt").iterdir()),
        }
        (out / "result.json").write_text(json.dumps(result, indent=1))
    barrier()


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def main() -> None:
    args = parse_args()
    init_distributed(timeout_s=600)
    vocab_size = AutoConfig.from_pretrained(args.model_dir).vocab_size
    for run in args.runs.split(","):
        out = Path(args.out) / run
        out.mkdir(parents=True, exist_ok=True)
        seed_everything(0)  # each run starts from the same generator states in both modes
        if args.mode == "crash":
            crash_while_saving(args, run, out, vocab_size)
        else:
            reference_then_resume(args, run, out, vocab_size)
    exit_process(CRASH_EXIT_CODE if args.mode == "crash" else 0)


if __name__ == "__main__":
    main()
