"""The checks every offline command's config runs (sft, rm, prm, dpo, kto, kd), before anything starts."""

from __future__ import annotations

from typing import Any

from raylign.config.data import refuse_keys_the_command_ignores
from raylign.config.engine import refuse_master_weights_off, refuse_unsupported_layouts


def refuse_what_the_command_cannot_use(cfg: Any, command: str) -> None:
    """A layout the command cannot train, settings the engine would not honour, dataset keys the
    command does not read, and evaluation settings without anything to evaluate on."""
    refuse_unsupported_layouts(cfg.engine, cfg.model, command, packing=cfg.data.packing)
    refuse_master_weights_off(cfg.engine, cfg.optim)
    refuse_keys_the_command_ignores(cfg.data, command)
    if cfg.train.eval_every > 0 and not cfg.data.eval and cfg.data.eval_fraction == 0:
        raise ValueError(
            f"train.eval_every {cfg.train.eval_every}: there is nothing to evaluate on; give data.eval (eval "
            "datasets) or data.eval_fraction (rows held out of train), or leave eval_every 0"
        )
