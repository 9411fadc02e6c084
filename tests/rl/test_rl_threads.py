"""The torch threads a training worker computes with follow the phases: the phases on the training
workers take turns, so each phase's ranks share the cores of their node that nothing else keeps busy
meanwhile (the rollout engines, when they generate beside training), unless
``placement.threads_per_worker`` pins a number. The expected counts are worked out by hand."""

from __future__ import annotations

import os

import pytest

from raylign.rl.placement import phase_threads, threads_per_worker
from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import resolve, rl_config_data


@pytest.mark.parametrize(
    ("cores", "busy", "workers", "expected"),
    [
        (2, 0, 1, 2),  # alone on a 2-core node: both cores
        (16, 4, 3, 4),  # 12 free cores, 3 ranks
        (16, 3, 2, 6),  # 13 free cores: 6.5 each, rounded down
        (8, 1.5, 2, 3),  # fractional engine reservations: 6.5 free, 3.25 each
        (2, 1, 2, 1),  # less than a core each: still 1
        (4, 6, 1, 1),  # more cores busy than the node has: still 1
    ],
)
def test_each_worker_gets_an_equal_share_of_the_free_cores(cores, busy, workers, expected):
    assert threads_per_worker(cores, busy, workers) == expected


@pytest.fixture
def base(rl_model_dir, prompt_file, tmp_path):
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "run", "grpo")
    data["engine"] = {"backend": "fsdp2"}  # several data-parallel ranks
    data["placement"] = {"policy_workers": 3}
    data["train"]["prompts_per_step"] = 3  # 12 samples: 4 per rank
    return data


def test_synchronous_phases_share_each_node_among_their_ranks(base, tmp_path):
    cfg = resolve(tmp_path, base)
    # Node a (8 cores) holds ranks 0 and 1, node b (6 cores) rank 2; the engine idles while they compute.
    assert phase_threads(cfg, ["a", "a", "b"], {"a": 8, "b": 6}, ["a"], has_gpus=False) == [4, 4, 6]


def test_engines_generating_beside_training_keep_their_cores(base, tmp_path):
    base["rollout"].update(max_staleness=1, num_engines=3, num_cpus_per_engine=2)
    cfg = resolve(tmp_path, base)
    # Two engines on node a keep 4 of its 16 cores busy: 12 for ranks 0 and 1. One engine on node b
    # keeps 2 of its 8: 6 for rank 2.
    nodes, cores, engines = ["a", "a", "b"], {"a": 16, "b": 8}, ["a", "b", "a"]
    assert phase_threads(cfg, nodes, cores, engines, has_gpus=False) == [6, 6, 6]


def test_a_pinned_count_holds_whatever_runs(base, tmp_path):
    base["placement"]["threads_per_worker"] = 3
    base["rollout"].update(max_staleness=1, num_engines=2)
    cfg = resolve(tmp_path, base)
    assert phase_threads(cfg, ["a", "a", "a"], {"a": 64}, ["a", "a"], has_gpus=False) == [3, 3, 3]


def test_on_gpus_auto_gives_one_thread_per_reserved_cpu_slot(base, tmp_path):
    base["placement"]["cpus_per_worker"] = 2.5
    cfg = resolve(tmp_path, base)
    assert phase_threads(cfg, ["a", "a", "a"], {"a": 64}, ["a"], has_gpus=True) == [2, 2, 2]


def test_a_thread_count_below_one_is_refused(base, tmp_path):
    base["placement"]["threads_per_worker"] = 0
    with pytest.raises(ValueError, match="threads_per_worker"):
        resolve(tmp_path, base)


@pytest.mark.slow
def test_a_pinned_thread_count_is_what_each_phase_computes_with(ray_session, rl_model_dir, prompt_file, tmp_path):
    """The counterpart of the presets' end-to-end runs, which leave the default (auto): all cores."""
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "run", "grpo")  # a policy and a reference
    data["placement"] = {"threads_per_worker": 1}
    RLTrainer(resolve(tmp_path, data)).run()
    records = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    # GRPO is on-policy, so its experience phase has no pass left: the reference's ran during generation.
    assert [(r["threads/reference_early"], r["threads/train"]) for r in records] == [(1, 1), (1, 1)]
    assert all("threads/experience" not in r for r in records)
    # Each phase also reports its ranks' peak memory (on the CPU the worker process's resident peak:
    # at least torch and the model, at most the machine).
    total_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    for r in records:
        peaks = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("peak_memory_gb/")}
        assert set(peaks) == {"reference_early", "train"}
        assert all(0.1 < v < total_gb for v in peaks.values()), peaks
