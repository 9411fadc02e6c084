"""Where workers land on a GPU cluster, checked with Ray's logical GPUs on this CPU machine.

Ray schedules by declared resources: a local Ray started with ``num_gpus=N`` hands out GPU ids
exactly as on a machine with N GPUs (the processes still compute on the CPU, since torch finds no
CUDA device). Each scenario runs the real controller set-up in a child process with its own Ray
(the test session's Ray has no GPUs) and reports the GPU ids every worker was given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .rl_helpers import rl_config_data, write_yaml

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import json, sys
    import ray
    from raylign.config.base import resolve_config
    from raylign.config.rl import RLConfig
    from raylign.rl.trainer import RLTrainer

    def placement(path):
        trainer = RLTrainer(resolve_config(RLConfig, path))
        try:
            trainer.setup()
            return {role: group.call("placement_info") for role, group in trainer.groups.items()}
        except ValueError as err:
            return {"error": str(err)}
        finally:
            trainer.shutdown()

    if __name__ == "__main__":
        gpus, *paths = sys.argv[1:]
        from raylign.cluster import start_ray

        start_ray(num_cpus=8, num_gpus=int(gpus))
        print("RESULT " + json.dumps([placement(p) for p in paths]))
""")


def _placements(tmp_path: Path, gpus: int, configs: list[dict]) -> list[dict]:
    script = tmp_path / "placement.py"
    script.write_text(SCRIPT)
    paths = [str(write_yaml(tmp_path / f"run{i}.yaml", c)) for i, c in enumerate(configs)]
    out = subprocess.run(
        [sys.executable, str(script), str(gpus), *paths],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _config(model_dir, prompt_file, out: Path, placement: dict) -> dict:
    data = rl_config_data(model_dir, prompt_file, out, "grpo")  # grpo: a policy and a reference
    data["placement"] = placement
    data["engine"] = {"backend": "fsdp2"}  # several data-parallel ranks in some scenarios
    return data


@pytest.fixture(scope="module")
def placements(rl_model_dir, prompt_file, tmp_path_factory) -> dict[str, dict]:
    """Every scenario's placement on one Ray of 3 logical GPUs (one child process for all)."""
    tmp_path = tmp_path_factory.mktemp("gpu_placement")
    scenarios = {
        "colocated": {"colocate": True, "policy_workers": 2, "reference_workers": 2},
        # 1 policy + 1 reference + 1 engine = 3 GPUs; then 4 + 1 + 1 = 6 > 3
        "fits": {"policy_workers": 1},
        "too_big": {"policy_workers": 4},
    }
    configs = [_config(rl_model_dir, prompt_file, tmp_path / name, p) for name, p in scenarios.items()]
    return dict(zip(scenarios, _placements(tmp_path, 3, configs), strict=True))


def test_colocated_ranks_share_one_gpu_per_policy_rank(placements):
    info = placements["colocated"]
    policy, reference = ([w["gpus"] for w in info[role]] for role in ("policy", "reference"))
    assert all(len(g) == 1 for g in policy + reference)
    assert policy[0] != policy[1]  # data-parallel ranks on different GPUs
    assert reference == policy  # rank r of the reference beside policy rank r (and its engine)


def test_separate_placement_gives_each_worker_its_own_gpu_or_fails_before_starting(placements):
    fits, too_big = placements["fits"], placements["too_big"]
    assert "error" not in fits, fits
    gpus = [w["gpus"] for role in ("policy", "reference") for w in fits[role]]
    assert [len(g) for g in gpus] == [1, 1] and gpus[0] != gpus[1]
    assert "needs 6 GPUs" in too_big["error"] and "the Ray cluster has 3" in too_big["error"]
    assert "placement.policy_workers=4" in too_big["error"] and "rollout.num_engines=1" in too_big["error"]
