"""Code run inside the 2 spawned gloo ranks of ``test_offline_tensor_parallel.py``: each offline
command's tiny example (rm, prm, dpo, kto, kd) for a few steps with every attention and MLP matrix
split over the 2 ranks (``engine.tensor_parallel_size`` 2, fsdp2), one after the other in one
process group, then dpo on the deepspeed backend (AutoTP 2 beside ZeRO-1); each rank records the
shape of its block of one ``q_proj``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.spawned_ranks import as_gloo_rank

WORLD_SIZE = 2
STEPS = 3
REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("rm", "prm", "dpo", "kto", "kd")


# With LoRA as well: DPO (its reference is the policy with its adapters off) and RM (its score head
# trains whole beside the adapters).
LORA_COMMANDS = ("dpo", "rm")


def command_config(command: str, model_dir: str, out: Path, engine: dict[str, Any], lora_rank: int = 0):
    """The command's shipped tiny example, on ``model_dir`` (the KD teacher: ``<model_dir>-teacher``),
    for STEPS steps."""
    from raylign.cli.main import COMMANDS as CLI
    from raylign.config.base import resolve_config

    overrides: dict[str, Any] = {
        "model.path": model_dir,
        "train.output_dir": str(out),
        "train.max_steps": STEPS,
        "train.save_every": 0,
        "train.eval_every": 0,
        "train.logging.progress_bar": False,
        "train.logging.tensorboard": False,
        "optim.max_grad_norm": 0.5,  # clipping in play: the norm over every block of the mesh matters
        **{f"engine.{k}": v for k, v in engine.items()},
        "model.lora.rank": lora_rank,
    }
    if command == "kd":
        overrides["teacher.path"] = f"{model_dir}-teacher"
    return resolve_config(CLI[command].config_cls(), REPO / "examples" / f"{command}_tiny.yaml", overrides)


def trainer_class(command: str):
    from raylign.trainers.dpo import DPOTrainer
    from raylign.trainers.kd import KDTrainer
    from raylign.trainers.kto import KTOTrainer
    from raylign.trainers.prm import PRMTrainer
    from raylign.trainers.rm import RMTrainer

    return {"rm": RMTrainer, "prm": PRMTrainer, "dpo": DPOTrainer, "kto": KTOTrainer, "kd": KDTrainer}[command]


def run_rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    os.chdir(REPO)  # the examples name their data files relative to the repository
    engine = {"backend": "fsdp2", "num_processes": WORLD_SIZE, "tensor_parallel_size": 2, "dist_timeout_s": 120}
    shapes = {}
    as_gloo_rank(rank, WORLD_SIZE, port)
    for command in COMMANDS:
        trainer = trainer_class(command)(command_config(command, model_dir, Path(out_dir) / command, engine))
        trainer.run()
        q_proj = next(m for name, m in trainer.engine.module.named_modules() if name.endswith("q_proj"))
        shapes[command] = list(q_proj.weight.to_local().shape)
    autotp = {**engine, "backend": "deepspeed", "zero_stage": 1}
    trainer_class("dpo")(command_config("dpo", model_dir, Path(out_dir) / "dpo_deepspeed", autotp)).run()
    for command in LORA_COMMANDS:  # adapters split with their matrices; DPO's reference: adapters off
        trainer_class(command)(command_config(command, model_dir, Path(out_dir) / f"{command}_lora", engine, 4)).run()
    (Path(out_dir) / f"shapes_rank{rank}.json").write_text(json.dumps(shapes))
