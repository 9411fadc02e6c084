"""The threads a rollout engine computes with: in a synchronous run training waits while the engines
generate, so they share the node's cores; otherwise what they reserve, training taking the rest.

The torch threads a training worker computes with follow the phases: the phases on the training
workers take turns, so each phase's ranks share the cores of their node that nothing else keeps busy
meanwhile (the rollout engines, when they generate beside training), unless
``placement.threads_per_worker`` pins a number. The expected counts are worked out by hand."""

from __future__ import annotations

import os
import re

import pytest

from raylign.config.base import ConfigError
from raylign.config.rollout import RolloutConfig
from raylign.rl.placement import engine_threads, phase_threads, probes_at_once, threads_per_worker
from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import resolve, rl_config_data, set_dotted


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


@pytest.mark.parametrize(
    ("setting", "staleness", "engines", "slots", "cores", "gpus", "expected"),
    [
        ("auto", 0, 1, 1.0, 2, False, 2),  # synchronous, one engine on 2 cores: both
        ("auto", 0, 3, 1.0, 16, False, 5),  # 16 cores among 3 engines, rounded down
        ("auto", 0, 4, 1.0, 2, False, 1),  # more engines than cores: still 1
        ("auto", 1, 1, 1.0, 16, False, 1),  # streaming: training computes beside it on the rest
        ("auto", 2, 1, 3.5, 16, False, 3),  # streaming with 3.5 CPU slots reserved
        ("auto", 0, 1, 2.0, 64, True, 2),  # on GPUs: the slots reserved
        (6, 1, 2, 1.0, 4, False, 6),  # pinned, whatever runs
    ],
)
def test_engines_share_the_cores_while_training_waits(setting, staleness, engines, slots, cores, gpus, expected):
    r = RolloutConfig(
        threads_per_engine=setting, max_staleness=staleness, num_engines=engines, num_cpus_per_engine=slots
    )
    assert engine_threads(r, cores, gpus) == expected


def test_reference_passes_beside_the_engines_keep_their_cores():
    # train.early_reference: true on 8 cores, 2 reference ranks of one thread each: 6 left for 2 engines
    r = RolloutConfig(num_engines=2)
    assert engine_threads(r, 8, False, busy_cores=2) == 3


@pytest.mark.parametrize(
    ("setting", "gpus", "staleness", "engine_setting", "expected"),
    [
        ("auto", False, 0, "auto", False),  # synchronous engines on every core: none left for it
        ("auto", False, 0, 1, True),  # engines pinned to a thread: the other cores are free
        ("auto", False, 1, "auto", True),  # streaming: engines keep their slots, the rest is training's
        ("auto", True, 0, "auto", True),  # on GPUs the reference has its own device
        (True, False, 0, "auto", True),  # asked for (the engines then leave it a core per rank)
        (False, True, 0, "auto", False),
    ],
)
def test_early_reference_auto_is_off_only_where_the_engines_take_every_core(
    base, tmp_path, setting, gpus, staleness, engine_setting, expected
):
    base["train"]["early_reference"] = setting
    base["rollout"].update(max_staleness=staleness, threads_per_engine=engine_setting)
    assert resolve(tmp_path, base).reference_early(gpus) is expected


@pytest.mark.parametrize(
    ("gpus", "engine", "engines", "policy", "cores", "expected"),
    [
        (False, 2, 1, 2, 2, False),  # both would take the 2 cores: one after the other
        (False, 1, 1, 1, 2, True),  # a core each
        (False, 3, 2, 2, 8, True),  # 6 + 2 threads on 8 cores
        (False, 3, 2, 3, 8, False),  # 6 + 3 on 8
        (True, 8, 4, 8, 2, True),  # GPUs: each on its own device
    ],
)
def test_the_probe_is_scored_at_once_only_where_the_scorers_fit_the_cores(
    gpus, engine, engines, policy, cores, expected
):
    assert probes_at_once(gpus, engine, engines, policy, cores) is expected


def test_an_engine_thread_count_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1 thread"):
        RolloutConfig(threads_per_engine=0)


@pytest.mark.slow
def test_the_engine_actor_computes_with_the_threads_decided(ray_session, rl_model_dir, prompt_file, tmp_path):
    ray = ray_session
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "run", "grpo")
    data["rollout"]["threads_per_engine"] = 2
    data["algorithm"] = {"kl_mode": "none", "kl_coef": 0.0}  # no reference: the policy and the engine start
    trainer = RLTrainer(resolve(tmp_path, data))
    try:
        trainer.setup()
        [engine] = trainer.engines
        seen = ray.get(
            engine.__ray_call__.remote(
                lambda self: (os.environ["OMP_NUM_THREADS"], __import__("torch").get_num_threads())
            ),
            timeout=60,
        )
    finally:
        trainer.shutdown()
    assert seen == ("2", 2)  # the training workers' environment says 1


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
    data["rollout"]["threads_per_engine"] = 1  # so the reference passes run beside generation (early_reference auto)
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
        # And how long they computed: the update inside the train phase; the reference passes between
        # their groups' end of generation and the experience phase that collected them.
        assert 0.0 < r["time/train_compute_s"] <= r["time/train_s"]
        window = r["time/generate_s"] + r["time/reward_s"] + r["time/experience_s"]
        assert 0.0 < r["time/reference_early_compute_s"] <= window
        assert "time/experience_compute_s" not in r


@pytest.mark.parametrize(
    ("changes", "gpus", "hosted"),
    [
        ({}, False, True),  # CPU, synchronous: the reference computes in the experience phase anyway
        ({}, True, False),  # on GPUs it computes early, on devices of its own
        ({"rollout.max_staleness": 1}, False, False),  # streaming: early, beside the engines
        ({"rollout.threads_per_engine": 1}, False, False),  # engines pinned: early, on the cores left
        ({"train.early_reference": False}, True, True),  # early turned off: nothing to gain apart
        ({"placement.reference_workers": 2}, False, False),  # asked for reference ranks of its own
        ({"placement.colocate": True}, False, False),  # each rank's reference beside its policy rank
        ({"engine.backend": "fsdp2", "engine.tensor_parallel_size": 2, "placement.policy_workers": 2}, False, False),
        ({"algorithm.kl_coef": 0.0}, False, False),  # no KL term: no reference at all
        ({"placement.reference_with_policy": False}, False, False),
    ],
)
def test_reference_with_policy_auto_hosts_it_where_it_would_compute_in_the_experience_phase(
    base, tmp_path, changes, gpus, hosted
):
    for dotted, value in changes.items():
        set_dotted(base, dotted, value)
    cfg = resolve(tmp_path, base)
    assert "reference" in cfg.worker_roles or not cfg.uses_reference  # auto is undecided until GPUs are known
    placed = cfg.with_reference_placed(gpus)
    assert placed.hosts_reference is hosted
    assert ("reference" in placed.worker_roles) is (placed.uses_reference and not hosted)


def test_a_lora_policy_is_its_own_reference_without_hosting_another(base, tmp_path):
    base["model"]["lora"] = {"rank": 4}
    placed = resolve(tmp_path, base).with_reference_placed(False)
    assert placed.reference_is_base and not placed.hosts_reference and placed.reference_in_policy


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"placement.colocate": True}, "placement.colocate"),
        ({"engine.backend": "fsdp2", "engine.sequence_parallel_size": 2, "placement.policy_workers": 2}, "above 1"),
        ({"train.early_reference": True}, "train.early_reference: true"),
    ],
)
def test_reference_with_policy_true_is_refused_where_the_policy_cannot_host_it(base, tmp_path, changes, named):
    set_dotted(base, "placement.reference_with_policy", True)
    for dotted, value in changes.items():
        set_dotted(base, dotted, value)
    with pytest.raises((ConfigError, ValueError), match=f"reference_with_policy: true cannot host.*{re.escape(named)}"):
        resolve(tmp_path, base)
