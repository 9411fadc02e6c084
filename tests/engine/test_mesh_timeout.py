"""fsdp2's device mesh keeps ``engine.dist_timeout_s`` in the groups it makes beside the default one
(tensor parallel, HSDP's shard groups): a rank whose partner never joins a collective fails after that
long, not after torch's default 30 minutes. So do the groups DeepSpeed makes for AutoTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.spawned_ranks import import_worker, spawn_and_join

worker = import_worker(__file__, "mesh_timeout_worker")


@pytest.fixture(scope="module")
def mesh_waits(tmp_path_factory) -> Path:
    """One start of the ranks for both layouts: rank 0 waits in each layout's group in turn."""
    out = tmp_path_factory.mktemp("mesh_timeout")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))  # the spawned ranks import the worker by name
        # Without the engine's timeout rank 0 would wait 30 minutes, and the ranks be killed here first.
        spawn_and_join(worker.run_rank, (str(out),), worker.WORLD_SIZE, 120, "mesh ranks")
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_a_collective_of_a_mesh_group_times_out_after_the_engines_timeout(mesh_waits, layout):
    result = json.loads((mesh_waits / f"rank0_{layout}.json").read_text())
    assert "Timed out" in result["error"]
    assert worker.TIMEOUT_S <= result["waited_s"] < 3 * worker.TIMEOUT_S


deepspeed_worker = import_worker(__file__, "deepspeed_timeout_worker")


@pytest.mark.distributed
def test_a_collective_of_deepspeeds_tensor_parallel_group_times_out_after_the_engines_timeout(tmp_path):
    """DeepSpeed makes its AutoTP and data-parallel groups itself, with torch's default timeout."""
    from raylign.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", num_heads=2, num_kv_heads=2)
    out = tmp_path / "rank0.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        spawn_and_join(
            deepspeed_worker.run_rank, (str(out), str(model_dir)), deepspeed_worker.WORLD_SIZE, 120, "deepspeed ranks"
        )
    result = json.loads(out.read_text())
    assert "Timed out" in result["error"]
    assert deepspeed_worker.TIMEOUT_S <= result["waited_s"] < 3 * deepspeed_worker.TIMEOUT_S
