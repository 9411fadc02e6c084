"""Code run inside the 2 spawned gloo ranks of ``test_sft_sequence_parallel.py``: the same SFT run, the
same SFT run of LoRA adapters, and the same KD run (a student distilled from a teacher on the SFT data),
with ``engine.sequence_parallel_size``
1 (2 data-parallel ranks) and 2 (one row split over both ranks), one after the other in one process group;
and the SFT run split over both ranks with gradient checkpointing, with DeepSpeed ZeRO-3, and with Ulysses
attention (``engine.sequence_parallel_mode: ulysses``) in place of the ring."""

from __future__ import annotations

from pathlib import Path

from tests.spawned_ranks import as_gloo_rank

WORLD_SIZE = 2
STEPS = 3


def sft_config(
    model_dir: str,
    train_file: str,
    out: Path,
    sequence_parallel_size: int,
    lora_rank: int = 0,
    gradient_checkpointing: bool = False,
    **engine,
):
    from raylign.config.base import parse_config
    from raylign.config.commands import SFTConfig

    return parse_config(
        SFTConfig,
        {
            "model": {
                "path": model_dir,
                "dtype": "float32",
                "lora": {"rank": lora_rank, "alpha": 8},
                "gradient_checkpointing": gradient_checkpointing,
            },
            "data": {"train": [train_file], "format": "chat", "max_length": 64},
            "engine": {
                "backend": "fsdp2",
                "sequence_parallel_size": sequence_parallel_size,
                "dist_timeout_s": 120,
                **engine,
            },
            # A large AdamW epsilon keeps each update proportional to its gradient: with the default 1e-8 an
            # element whose gradient is near zero moves by a full step of whichever sign its rounding gives,
            # so weights of equal-to-1e-7 gradients could not be compared at 1e-5.
            "optim": {"lr": 3e-3, "warmup_steps": 1, "weight_decay": 0.0, "eps": 1e-3},
            "train": {
                "output_dir": str(out),
                "max_steps": STEPS,
                "global_batch_size": 4,
                "micro_batch_size": 2,
                "seed": 0,
                "logging": {"progress_bar": False, "tensorboard": False},
            },
        },
    )


def kd_config(student_dir: str, teacher_dir: str, train_file: str, out: Path, sequence_parallel_size: int):
    from raylign.config.base import parse_config
    from raylign.config.kd import KDConfig

    sft = sft_config(student_dir, train_file, out, sequence_parallel_size).model_dump(mode="json")
    teacher = {"path": teacher_dir, "dtype": "float32"}
    return parse_config(KDConfig, {**sft, "teacher": teacher, "kd": {"loss": "forward_kl", "nll_coef": 0.5}})


def run_rank(rank: int, port: int, model_dir: str, student_dir: str, train_file: str, out_dir: str) -> None:
    from raylign.trainers.kd import KDTrainer
    from raylign.trainers.sft import SFTTrainer

    as_gloo_rank(rank, WORLD_SIZE, port)
    for size in (1, 2):
        SFTTrainer(sft_config(model_dir, train_file, Path(out_dir) / f"sp{size}", size)).run()
        SFTTrainer(sft_config(model_dir, train_file, Path(out_dir) / f"lora_sp{size}", size, lora_rank=4)).run()
        KDTrainer(kd_config(student_dir, model_dir, train_file, Path(out_dir) / f"kd_sp{size}", size)).run()
    checkpointed = sft_config(model_dir, train_file, Path(out_dir) / "checkpointed_sp2", 2, gradient_checkpointing=True)
    SFTTrainer(checkpointed).run()
    zero3 = sft_config(model_dir, train_file, Path(out_dir) / "zero3_sp2", 2, backend="deepspeed", zero_stage=3)
    SFTTrainer(zero3).run()
    ulysses = sft_config(model_dir, train_file, Path(out_dir) / "ulysses_sp2", 2, sequence_parallel_mode="ulysses")
    SFTTrainer(ulysses).run()
