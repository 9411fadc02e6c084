"""Code run inside the 2 spawned gloo ranks of ``test_preference_sequence_parallel.py``: the same DPO run
(live reference, evaluation), reward-model run (evaluation, score statistics at export) and process
reward-model run (soft step labels) with
``engine.sequence_parallel_size`` 1 (2 data-parallel ranks) and 2
(every micro-batch packed into one row split over both ranks), and the KTO run (reference point estimated
over mismatched pairs) with 2, one after the other in one process group. KTO's run with whole sequences is
the test's own, on one process: its reference point depends on which examples share a micro-batch, so it
is compared with one rank holding the same micro-batches, not with two data-parallel ranks."""

from __future__ import annotations

from pathlib import Path

from tests.spawned_ranks import as_gloo_rank

WORLD_SIZE = 2
STEPS = 3

# A large AdamW epsilon keeps each update proportional to its gradient (see sft_sequence_parallel_worker).
OPTIM = {"lr": 3e-3, "warmup_steps": 1, "weight_decay": 0.0, "eps": 1e-3}


def _train(out: Path, batch: int) -> dict:
    return {
        "output_dir": str(out),
        "max_steps": STEPS,
        "global_batch_size": batch,
        "micro_batch_size": batch // 2,
        "seed": 0,
        "logging": {"progress_bar": False, "tensorboard": False},
    }


def _engine(size: int) -> dict:
    return {"backend": "fsdp2", "sequence_parallel_size": size, "dist_timeout_s": 120}


def dpo_config(model_dir: str, pairs: str, out: Path, size: int):
    from raylign.config.base import parse_config
    from raylign.config.dpo import DPOConfig

    data = {"train": [pairs], "eval": [pairs], "format": "chat", "max_length": 64}
    model = {"path": model_dir, "dtype": "float32"}
    return parse_config(
        DPOConfig,
        {"model": model, "data": data, "engine": _engine(size), "optim": OPTIM, "train": _train(out, 4)},
    )


def rm_config(model_dir: str, pairs: str, out: Path, size: int):
    from raylign.config.base import parse_config
    from raylign.config.rm import RMConfig

    data = {"train": [pairs], "eval": [pairs], "format": "chat", "max_length": 64}
    model = {"path": model_dir, "dtype": "float32"}
    return parse_config(
        RMConfig,
        {"model": model, "data": data, "engine": _engine(size), "optim": OPTIM, "train": _train(out, 4)},
    )


def prm_config(model_dir: str, chains: str, out: Path, size: int, separator: str):
    from raylign.config.base import parse_config
    from raylign.config.prm import PRMConfig

    data = {"train": [chains], "format": "plain", "max_length": 64}
    model = {"path": model_dir, "dtype": "float32"}
    return parse_config(
        PRMConfig,
        {
            "model": model,
            "data": data,
            "prm": {"step_separator": separator, "label_type": "soft"},
            "engine": _engine(size),
            "optim": OPTIM,
            # Every chain has the same length: three to a micro-batch puts the cut inside the second.
            "train": _train(out, 6),
        },
    )


def kto_config(model_dir: str, rows: str, out: Path, size: int):
    """With ``size`` 1: whole sequences on the one process that runs it (the local backend)."""
    from raylign.config.base import parse_config
    from raylign.config.kto import KTOConfig

    data = {"train": [rows], "max_length": 64}
    model = {"path": model_dir, "dtype": "float32"}
    return parse_config(
        KTOConfig,
        {
            "model": model,
            "data": data,
            "kto": {"beta": 0.1},
            "engine": _engine(size) if size > 1 else {"backend": "local"},
            "optim": OPTIM,
            "train": _train(out, 8),
        },
    )


def run_rank(
    rank: int, port: int, model_dir: str, pairs: str, kto_rows: str, chains: str, separator: str, out_dir: str
) -> None:
    from raylign.trainers.dpo import DPOTrainer
    from raylign.trainers.kto import KTOTrainer
    from raylign.trainers.prm import PRMTrainer
    from raylign.trainers.rm import RMTrainer

    as_gloo_rank(rank, WORLD_SIZE, port)
    for size in (1, 2):
        DPOTrainer(dpo_config(model_dir, pairs, Path(out_dir) / f"dpo_sp{size}", size)).run()
        RMTrainer(rm_config(model_dir, pairs, Path(out_dir) / f"rm_sp{size}", size)).run()
        PRMTrainer(prm_config(model_dir, chains, Path(out_dir) / f"prm_sp{size}", size, separator)).run()
    KTOTrainer(kto_config(model_dir, kto_rows, Path(out_dir) / "kto_sp2", 2)).run()
