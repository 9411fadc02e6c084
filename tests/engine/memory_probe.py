"""Run alone: two AdamW steps of the local engine on one random micro-batch; prints, as JSON, the peak
resident memory of the second step above the process's resident memory before the model was loaded.

    python tests/engine/memory_probe.py MODEL_DIR TOKENS [--checkpointing]

The peak is Linux's VmHWM, reset after the first step (``/proc/self/clear_refs``), so loading the
model does not count; the second step runs with the optimizer's moments already in place.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch


def resident(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("tokens", type=int)
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from raylign.config.engine import EngineConfig
    from raylign.config.optim import OptimConfig
    from raylign.engine import create_engine

    gc.collect()
    before = resident("VmRSS:")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).train()
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = create_engine(model, EngineConfig(backend="local"), OptimConfig(lr=1e-4), 2)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        engine.backward(engine.module(input_ids=ids, labels=ids).loss)
        engine.step()

    step()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident size
    step()
    print(json.dumps({"peak_bytes": resident("VmHWM:") - before}))


if __name__ == "__main__":
    main()
