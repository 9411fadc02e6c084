"""Colocated placement (the hybrid engine): each policy worker generates with an engine in its own
process, and a weight sync hands that engine the trained weights in memory.

Driven like :mod:`tests.rl.test_rl_weight_sync`: a policy ``WorkerGroup`` with
``placement.colocate``, ``start_local_engine``, one ``train_policy`` step, ``sync_weights``;
then every rank's engine must report the log-probs the trainer computes for its own greedy
completions. A full ``raylign rl`` run with colocation checks the controller's side.
"""

from __future__ import annotations

import os

import psutil
import pytest
import ray
import torch

from raylign.config.rollout import SamplingConfig
from raylign.rl.group import WorkerGroup
from raylign.rl.trainer import RLTrainer
from raylign.rollout.pool import RolloutPool
from raylign.trainers.metrics import read_metrics

from .rl_helpers import resolve, rl_config_data, shard_for_ranks, worker_config
from .test_rl_weight_sync import LOGPROB_TOL, PROMPTS, STALE_GAP, _gap, _trainer_logprobs, _training_batch

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
VLLM_ROLLOUT = {"engine": "vllm", "dtype": "float32", "kv_cache_memory_bytes": 32 << 20, "max_model_len": 256}


def _greedy_per_rank(group: WorkerGroup) -> list[list]:
    sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=6)
    return group.call("generate", PROMPTS, sampling)


@pytest.mark.parametrize(
    ("engine", "backend", "workers", "lora"),
    [
        # One case per way weights reach an engine (each vLLM case costs a minute): fsdp2's all-gathered
        # ones streamed into every rank's own engine (hf, vllm). The local backend's own weights reach its
        # hf engine in test_colocated_grpo_run_end_to_end below, whose step 2 is checked against the trainer.
        pytest.param("hf", "fsdp2", 2, False, id="hf-fsdp2-2"),
        pytest.param("vllm", "fsdp2", 2, False, id="vllm-fsdp2-2"),
        # A LoRA policy: its rank gathers the adapter alone and its engine serves it as a vLLM adapter (one
        # rank: the adapter is gathered whole before vLLM loads it, and every rank's gather of it is
        # tests/engine/test_engine_adapter.py's).
        pytest.param("vllm", "fsdp2", 1, True, id="vllm-fsdp2-1-lora-adapter"),
    ],
)
def test_colocated_engines_follow_the_trained_policy(
    engine, backend, workers, lora, ray_session, rl_model_dir, prompt_file, tmp_path
):
    lr = 5e-2 if lora else 1e-2  # lora_B starts at zero: a larger step moves the policy as far
    cfg = worker_config(rl_model_dir, prompt_file, tmp_path / "run", backend, workers, optim={"lr": lr})
    cfg["placement"]["colocate"] = True
    if lora:
        cfg["model"]["lora"] = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}
    cfg["rollout"].update(VLLM_ROLLOUT if engine == "vllm" else {"engine": "hf", "dtype": "float32"})
    group = WorkerGroup("policy", cfg, workers, 1, None, env=ENV)
    try:
        group.call("start_local_engine", str(rl_model_dir))
        initial = _greedy_per_rank(group)
        for completions in initial:  # engines load the initial weights from the model folder
            assert _gap(completions, _trainer_logprobs(group, completions)) <= LOGPROB_TOL

        samples, per_token = _training_batch(rl_model_dir)
        group.call_sharded("train_policy", shard_for_ranks(samples, per_token, workers, max_tokens=16))
        assert _gap(initial[0], _trainer_logprobs(group, initial[0])) > STALE_GAP  # the check below can fail

        sync = group.call("sync_weights")
        assert sync[0]["sync/total_s"] > 0 and all(s == {} for s in sync[1:])
        if lora:  # the engines hold the adapter of the sync, version 1, and nothing else
            assert group.call("local_engine_adapters") == [[1]] * workers
        for completions in _greedy_per_rank(group):  # every rank's engine
            assert _gap(completions, _trainer_logprobs(group, completions)) <= LOGPROB_TOL

        # The controller's pool spreads one request over the ranks' engines and keeps prompt order.
        pool = RolloutPool(group.workers)
        completions = pool.generate_blocking(PROMPTS + PROMPTS, SamplingConfig(n=2, temperature=1.0, max_new_tokens=4))
        assert [(c.prompt_index, c.sample_index) for c in completions] == [(i, s) for i in range(6) for s in range(2)]
        assert [c.prompt_token_ids for c in completions[::2]] == PROMPTS + PROMPTS

        # Stopped before the workers are killed, the engines leave nothing behind: killed with them, vLLM's
        # engine-core process went too, but the adapters' folders (and the shared memory of vLLM's
        # multiprocessing executor, which GPU engines with tensor parallel use) stayed.
        left = _engine_processes_and_files(group)
        if engine == "vllm":
            assert all(len(processes) == 1 for processes, _ in left)  # the engine core, the worker inside it
            assert all(any("raylign-lora-" in name for name in files) for _, files in left) == lora
        group.stop_local_engines()
        assert [sorted(name for name in files if os.path.exists(name)) for _, files in left] == [[]] * workers
        assert [[p.pid for p in processes if _alive(p)] for processes, _ in left] == [[]] * workers
    finally:
        group.kill()


def _engine_processes_and_files(group: WorkerGroup) -> list[tuple[list[psutil.Process], set[str]]]:
    """Per rank: its colocated engine's processes (vLLM's, children of the worker), and the files outside
    the worker it keeps: the shared-memory files those processes map and the adapters' folder, if any."""
    ranks = []
    for worker in group.workers:
        pid, adapters = ray.get(
            worker.__ray_call__.remote(
                lambda self: (os.getpid(), str(getattr(self._local_engine, "_adapter_root", None) or ""))
            ),
            timeout=60,
        )
        files = {adapters} if adapters else set()
        processes = [p for p in psutil.Process(pid).children(recursive=True) if p.name().startswith("VLLM")]
        for process in processes:
            files |= {m.path for m in process.memory_maps() if m.path.startswith("/dev/shm/")}
        ranks.append((processes, files))
    return ranks


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_colocated_grpo_run_end_to_end(ray_session, rl_model_dir, prompt_file, tmp_path):
    """Two GRPO steps with the hybrid engine: no engine actors, finite metrics, a sync per step, and
    the engine-vs-trainer mismatch of step 2 (generated after the first sync) at fp32 rounding."""
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "run", "grpo")
    data["placement"] = {"colocate": True}
    trainer = RLTrainer(resolve(tmp_path, data))
    trainer.run()
    assert trainer.engines == []
    # One placement group, one bundle per policy rank with room for a worker of each role.
    roles = trainer.cfg.worker_roles
    (group,) = trainer.placement_groups
    assert ray.util.placement_group_table(group)["bundles"] == {0: {"CPU": float(len(roles))}}
    assert set(trainer.groups) == set(roles)
    records = read_metrics(trainer.out)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert all(torch.isfinite(torch.tensor(v)) for k, v in record.items() if isinstance(v, float))
        assert record["time/sync_s"] > 0
    assert records[1]["mismatch/logprob_max_abs_diff"] <= LOGPROB_TOL
    # Each sync was probed: the engine inside the policy worker scores the probe as the policy does.
    assert all(r["sync/probe_logprob_diff_max"] <= LOGPROB_TOL for r in records)
    assert (trainer.out / "final" / "config.json").exists()
