"""engine.reshard_after_forward: where FSDP2 keeps a layer's gathered weights between its forward and
its backward, and that the setting changes memory only, never the update."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import torch
from torch.distributed.tensor import DTensor
from raylign.config.engine import EngineConfig
from raylign.config.optim import OptimConfig
from raylign.engine import create_engine
from tests.engine.engine_testing import token_batch, tiny_model

results = {}
for reshard in (True, False):
    engine = create_engine(
        tiny_model(seed=0), EngineConfig(backend="fsdp2", reshard_after_forward=reshard), OptimConfig(lr=1e-2), 2
    )
    q_proj = engine.module.model.layers[0].self_attn.q_proj
    ids = token_batch(5)
    loss = engine.module(input_ids=ids, labels=ids).loss
    # FSDP2 registers a layer's gathered weights as plain tensors while they are whole, its shards as DTensors.
    between = isinstance(q_proj.weight, DTensor)
    engine.backward(loss)
    after_backward = isinstance(q_proj.weight, DTensor)
    engine.step()
    results[reshard] = (between, after_backward, loss.item(), engine.full_state_dict())
(sharded_between, sharded_after, loss_true, state_true) = results[True]
(whole_between, whole_after, loss_false, state_false) = results[False]
assert sharded_between and not whole_between, (sharded_between, whole_between)
assert sharded_after and whole_after
assert loss_true == loss_false
assert state_true.keys() == state_false.keys()
assert all(torch.equal(state_true[k], state_false[k]) for k in state_true)
print("OK")
"""


def test_layers_stay_whole_from_forward_to_backward_only_when_asked_and_the_update_is_the_same():
    """In its own process (FSDP2 creates a one-rank process group)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
