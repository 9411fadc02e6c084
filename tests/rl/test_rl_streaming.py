"""Streaming asynchronous rollout: prompt groups flow through real engine actors, and a group enters
a training step only within ``rollout.max_staleness`` weight updates of the policy it trains.

The feed (:class:`raylign.rl.stream.RolloutFeed`) is driven here the way the controller drives
it: take a step's groups, "train" (every engine receives new weights, which bumps its version),
start the next groups. The engines are real: the hf engine, one that holds back one chosen group
until the engines have moved on (so that it arrives too old by construction), and vLLM's
asynchronous engine with partial rollouts (a weight update while sequences are in flight).
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import math
import sys
import time

import pytest
import ray
import torch

from raylign.config.rollout import RolloutConfig, SamplingConfig
from raylign.data.errors import RowRef
from raylign.rl.prompts import Prompt
from raylign.rl.stream import RolloutFeed
from raylign.rl.trainer import RLTrainer
from raylign.rollout.hf_engine import HFEngine
from raylign.rollout.pool import GroupStream, RolloutPool, launch_engines, stop_engines

from .rl_helpers import fp32_model, resolve, response_logprobs, rl_config_data, state_dict_of

pytestmark = pytest.mark.slow
HAS_VLLM = importlib.util.find_spec("vllm") is not None
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
PER_STEP = 3


class HoldingEngine(HFEngine):
    """The hf engine, except that the group started ``held_seq``-th is returned only once the
    engine's weights are ``hold_until`` versions on: its samples then come from old weights."""

    def __init__(self, model_path, config, held_seq: int, hold_until: int):
        super().__init__(model_path, config)
        self.held_seq, self.hold_until = held_seq, hold_until

    async def generate_group(self, prompt_token_ids, sampling, prompt_index=0):
        completions = await super().generate_group(prompt_token_ids, sampling, prompt_index)
        if prompt_index == self.held_seq:  # the feed passes each group's start order as its index
            while self.weight_version < self.hold_until:
                await asyncio.sleep(0.01)
        return completions


def _prompts(n: int = 8) -> list[Prompt]:
    return [Prompt(f"p{i}", [5 + i, 6, 7 + 2 * i, 8], None, "test", RowRef("test", i)) for i in range(n)]


def _feed(
    engines, max_staleness: int, stale: str = "drop", max_new_tokens: int = 6, max_groups: int | None = None
) -> RolloutFeed:
    return RolloutFeed(
        GroupStream(RolloutPool(engines), timeout_s=120),
        _prompts(),
        itertools.cycle(range(8)),
        SamplingConfig(n=2, temperature=1.0, max_new_tokens=max_new_tokens, seed=11),
        PER_STEP,
        max_staleness,
        stale,
        RLTrainer._group_samples,
        score=lambda samples: None,
        max_groups=max_groups,
    )


def _run_steps(feed: RolloutFeed, engines, steps: int, weights, start_version: int = 0, partial: bool = False):
    """``steps`` steps of the controller's loop with a new weight version after each; the steps' groups."""
    version, taken = start_version, []
    feed.top_up(version)
    for _ in range(steps):
        step = feed.take_step(version)
        taken.append((version, step))
        ray.get([e.update_weights.remote(weights, partial) for e in engines], timeout=120)
        version += 1
        feed.top_up(version)
    return taken


@pytest.fixture(scope="module")
def weights(rl_model_dir):
    return list(state_dict_of(rl_model_dir).items())


@pytest.fixture(scope="module")
def hf_engines(ray_session, rl_model_dir):
    engines = launch_engines(
        rl_model_dir, RolloutConfig(engine="hf", dtype="float32", num_engines=2, num_cpus_per_engine=0), env_vars=ENV
    )
    yield engines
    stop_engines(engines)


def test_no_group_is_started_past_the_runs_last_step(hf_engines, weights):
    """A run of 2 steps with max_staleness 2 would keep 3 steps' groups going; it starts exactly the
    2 x PER_STEP its steps take, and nothing is left generating when it ends."""
    version = ray.get(hf_engines[0].weight_version_now.remote())
    feed = _feed(hf_engines, 2, max_groups=2 * PER_STEP)
    taken = _run_steps(feed, hf_engines, 2, weights, start_version=version)
    assert [len(step.groups) for _, step in taken] == [PER_STEP, PER_STEP]
    assert feed.started == 2 * PER_STEP and len(feed.stream) == 0


@pytest.mark.parametrize("max_staleness", [1, 2, 4])
def test_no_admitted_token_is_older_than_the_bound_hf(hf_engines, weights, max_staleness):
    versions = ray.get([e.weight_version_now.remote() for e in hf_engines])
    assert len(set(versions)) == 1
    taken = _run_steps(_feed(hf_engines, max_staleness), hf_engines, 6, weights, start_version=versions[0])
    for version, step in taken:
        assert len(step.groups) == PER_STEP
        assert all(version - v <= max_staleness for g in step.groups for s in g.samples for v in s.token_versions)
    # Each group is trained on once; within a step the groups are in the order they were started.
    seqs = [g.seq for _, step in taken for g in step.groups]
    assert len(set(seqs)) == len(seqs)
    assert all([g.seq for g in step.groups] == sorted(g.seq for g in step.groups) for _, step in taken)
    # Above 0 the engines work ahead: some step took groups started under older weights.
    assert any(version - g.started_version >= 1 for version, step in taken for g in step.groups)


@pytest.mark.parametrize("stale", ["drop", "regenerate"])
def test_a_group_past_the_bound_is_dropped_or_generated_again(ray_session, rl_model_dir, weights, stale):
    """Group 1 comes back only when the engine holds weights 2 versions newer than those that
    sampled it; with max_staleness 1 exactly that group must not be trained on."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(HoldingEngine).options(num_cpus=0, runtime_env={"env_vars": ENV})
    engine = actor.remote(str(rl_model_dir), RolloutConfig(engine="hf", dtype="float32").model_dump(), 1, 2)
    try:
        feed = _feed([engine], max_staleness=1, stale=stale)
        taken = _run_steps(feed, [engine], 5, weights)
        held = [g for _, step in taken for g in step.groups if g.seq == 1]
        assert held == []  # sampled at version 0, back at version 2 or later: never trained on
        dropped = sum(step.dropped_stale for _, step in taken)
        regenerated = sum(step.regenerated_stale for _, step in taken)
        assert (dropped, regenerated) == ((1, 0) if stale == "drop" else (0, 1))
        for version, step in taken:
            assert all(version - v <= 1 for g in step.groups for s in g.samples for v in s.token_versions)
        if stale == "regenerate":  # its prompt (position 1) was started again and trained on
            again = [g for _, step in taken for g in step.groups if g.prompt_position == 1 and g.seq > 1]
            assert again and again[0].started_version >= 2
    finally:
        stop_engines([engine])


def test_an_endpoint_request_the_engine_never_answers_ends_in_a_timeout_naming_the_setting(ray_session, rl_model_dir):
    from raylign.rl.episodes import EpisodeStream

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(HoldingEngine).options(num_cpus=0, runtime_env={"env_vars": ENV})
    # Endpoint requests are numbered from 2,000,000: the engine holds that one until a weight version
    # that never comes.
    engine = actor.remote(str(rl_model_dir), RolloutConfig(engine="hf", dtype="float32").model_dump(), 2_000_000, 1)
    stream = EpisodeStream(RolloutPool([engine]), None, timeout_s=2)
    try:
        start = time.perf_counter()
        with pytest.raises(TimeoutError, match="did not answer an endpoint request within 2 s; raise rollout.generate"):
            asyncio.run(stream.complete([5, 6, 7], SamplingConfig(max_new_tokens=2)))
        assert time.perf_counter() - start < 30
    finally:
        stream.close()
        stop_engines([engine])


# ---- vLLM's asynchronous engine: partial rollouts ----------------------------------------------


@pytest.fixture(scope="module")
def vllm_engine(ray_session, rl_model_dir):
    if not HAS_VLLM:
        pytest.skip("vllm is not installed")
    config = RolloutConfig(engine="vllm", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    (engine,) = launch_engines(rl_model_dir, config, env_vars=ENV)
    yield engine
    stop_engines([engine])


@pytest.mark.parametrize(
    ("max_staleness", "partial"),
    # The feed's bound at every staleness is the hf test's; here what vLLM adds: the tightest bound with
    # whole groups and with sequences paused across updates, and paused ones spanning several versions.
    [(1, False), (1, True), (4, True)],
    ids=["1-finish-first", "1-partial", "4-partial"],
)
def test_no_admitted_token_is_older_than_the_bound_vllm(vllm_engine, weights, max_staleness, partial):
    start = ray.get(vllm_engine.weight_version_now.remote())
    taken = _run_steps(
        _feed([vllm_engine], max_staleness, max_new_tokens=40),
        [vllm_engine],
        5,
        weights,
        start_version=start,
        partial=partial,
    )
    for version, step in taken:
        assert len(step.groups) == PER_STEP
        assert all(version - v <= max_staleness for g in step.groups for s in g.samples for v in s.token_versions)
        for g in step.groups:  # a group's tokens never get older along the sequence
            for s in g.samples:
                assert s.token_versions == sorted(s.token_versions)
                assert s.token_versions[0] >= g.started_version


def test_a_sequence_paused_by_a_weight_update_continues_under_the_new_weights(vllm_engine, rl_model_dir):
    """A long greedy sequence is in flight when new weights arrive with partial rollouts: its first
    tokens come from the old weights, the rest from the new, and every token's log-prob is that of
    a fresh fp32 forward of the weights that sampled it (the sequence is recomputed under the new
    weights when it resumes, so the new tokens see no stale keys and values)."""
    old_model = fp32_model(rl_model_dir)
    old_model.load_state_dict(state_dict_of(rl_model_dir))
    new_model = fp32_model(rl_model_dir)
    with torch.no_grad():
        torch.manual_seed(5)
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # Start from the old weights (earlier tests may have left others), at a known version.
    ray.get(vllm_engine.update_weights.remote(list(old_model.state_dict().items())), timeout=120)
    start = ray.get(vllm_engine.weight_version_now.remote())
    prompt = [5, 6, 7, 8, 9]
    sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=200)
    pending = vllm_engine.generate_group.remote(prompt, sampling, 0)
    # Update once a few tokens exist, well before 200 are done.
    deadline = time.monotonic() + 60
    while ray.get(vllm_engine.tokens_in_flight.remote(), timeout=60) < 5:
        ready, _ = ray.wait([pending], timeout=0.02)
        assert not ready, "the sequence finished before the update; make it longer"
        assert time.monotonic() < deadline, "the engine sampled fewer than 5 tokens in 60 s"
    ray.get(vllm_engine.update_weights.remote(list(new_model.state_dict().items()), True), timeout=120)
    (completion,) = ray.get(pending, timeout=120)
    versions, tokens = completion.token_versions, completion.response_token_ids
    assert set(versions) == {start, start + 1} and versions == sorted(versions)
    cut = versions.index(start + 1)
    assert 0 < cut < len(tokens)
    with torch.no_grad():
        expected_old = response_logprobs(old_model, prompt, tokens)[:cut]
        expected_new = response_logprobs(new_model, prompt, tokens)[cut:]
    got = torch.tensor(completion.response_logprobs)
    # fp32 on both sides; vLLM's CPU kernels and torch round differently by ~1e-7 per op (see
    # test_rl_vllm); the weights moved these log-probs by far more than the tolerance.
    assert torch.allclose(got[:cut], expected_old, atol=1e-4)
    assert torch.allclose(got[cut:], expected_new, atol=1e-4)
    with torch.no_grad():
        assert (response_logprobs(old_model, prompt, tokens)[cut:] - got[cut:]).abs().max() > 1e-2


# ---- max_staleness 0 is the synchronous loop ---------------------------------------------------


def test_generation_seconds_are_the_union_of_the_groups_generating_intervals():
    from raylign.rl.stream import Group, generation_seconds

    def group(start: float, end: float) -> Group:
        return Group(0, 0, [], 0, finished_at=end, submitted_at=start)

    # [0, 2] and [1, 3] overlap into [0, 3]; [5, 6] after a gap; [5.5, 5.8] inside it: 3 + 1 seconds.
    assert generation_seconds([group(5, 6), group(1, 3), group(0, 2), group(5.5, 5.8)]) == pytest.approx(4.0)
    assert generation_seconds([]) == 0.0


class BatchSyncTrainer(RLTrainer):
    """The plain synchronous loop, as a reference: each step generates its whole batch in one call
    (same prompts, same per-request seeds as the stream gives them), then trains."""

    def setup(self) -> None:
        super().setup()
        self.feed.top_up = lambda version: None  # nothing streams

    def rollout(self):
        from raylign.rl.experience import reward_metrics
        from raylign.rl.stream import sample_from

        per_step = self.cfg.train.prompts_per_step
        positions = [next(self.positions) for _ in range(per_step)]
        seqs = list(range(self.step * per_step, (self.step + 1) * per_step))
        completions = self.pool.generate_blocking(
            [self.train_prompts[p].token_ids for p in positions], self.cfg.sampling, prompt_indices=seqs
        )
        samples = [sample_from(c, self.train_prompts[positions[c.prompt_index - seqs[0]]]) for c in completions]
        self.score(samples)
        return samples, reward_metrics(samples)


def test_max_staleness_zero_is_the_synchronous_loop(ray_session, rl_model_dir, prompt_file, tmp_path):
    from raylign.trainers.metrics import read_metrics

    runs = {}
    for name, cls in (("stream", RLTrainer), ("batch", BatchSyncTrainer)):
        data = rl_config_data(rl_model_dir, prompt_file, tmp_path / name, "grpo")
        data["train"].update(max_steps=3, save_every=0)
        trainer = cls(resolve(tmp_path, data))
        trainer.run()
        runs[name] = [r for r in read_metrics(tmp_path / name) if "reward/mean" in r]
    keys = ["reward/mean", "response_length/mean", "policy/policy_loss", "policy/grad_norm", "kl/reference"]
    for stream_row, batch_row in zip(runs["stream"], runs["batch"], strict=True):
        for key in keys:
            assert stream_row[key] == pytest.approx(batch_row[key], abs=1e-6), key
        assert stream_row["staleness/token_lag_max"] == 0
    stream_weights = state_dict_of(tmp_path / "stream" / "final")
    batch_weights = state_dict_of(tmp_path / "batch" / "final")
    for name, tensor in stream_weights.items():
        assert torch.allclose(tensor, batch_weights[name], atol=1e-6), name


def _even_prompts_uniform_feed(engines, max_staleness: int, max_uniform_per_step: int, **more) -> RolloutFeed:
    """A feed with dynamic sampling whose even prompt positions are uniform by construction (every
    sample scores 1) and whose odd ones are not."""
    from raylign.rl.stream import uniform_rewards

    def score(samples):
        for i, s in enumerate(samples):
            s.reward = 1.0 if s.prompt_text in {"p0", "p2", "p4", "p6"} else float(i % 2)

    return RolloutFeed(
        GroupStream(RolloutPool(engines), timeout_s=120),
        _prompts(),
        itertools.cycle(range(8)),
        SamplingConfig(n=2, temperature=1.0, max_new_tokens=4, seed=3),
        PER_STEP,
        max_staleness,
        "drop",
        RLTrainer._group_samples,
        score,
        uniform=uniform_rewards,
        max_uniform_per_step=max_uniform_per_step,
        **more,
    )


def test_dynamic_sampling_drops_uniform_groups_as_they_arrive(hf_engines, weights):
    """Groups whose rewards are all equal carry no group advantage: they are dropped as they come
    back and more are generated until the step has its quota."""
    start = ray.get(hf_engines[0].weight_version_now.remote())
    feed = _even_prompts_uniform_feed(hf_engines, 1, 30)
    taken = _run_steps(feed, hf_engines, 4, weights, start_version=start)
    admitted = [g for _, step in taken for g in step.groups]
    assert len(admitted) == 4 * PER_STEP
    assert all(g.prompt_position % 2 == 1 for g in admitted)
    # Every even group that came back before the last step was complete was dropped, and counted.
    dropped = sum(step.dropped_uniform for _, step in taken)
    assert dropped + sum(step.dropped_stale for _, step in taken) == feed.discarded
    assert dropped >= 4 * PER_STEP - 3  # the last few even groups may still be in flight
    assert all(step.padded_uniform == 0 for _, step in taken)


def test_without_refill_rounds_uniform_groups_fill_their_step_and_none_is_replaced(hf_engines, weights):
    """``algorithm.max_refill_rounds: 0``: no group is generated again, so a uniform group counts towards
    its step (``padded_uniform``) and the step still waits for all of its groups. Positions cycle 0..7
    and the even ones are uniform: the steps hold positions 0-2, 3-5, 6,7,0 and 1-3 whatever order
    they come back in, with 2, 1, 2 and 1 of them uniform."""
    start = ray.get(hf_engines[0].weight_version_now.remote())
    feed = _even_prompts_uniform_feed(hf_engines, 0, 0, max_groups=4 * PER_STEP)
    taken = _run_steps(feed, hf_engines, 4, weights, start_version=start)
    assert [[g.prompt_position for g in step.groups] for _, step in taken] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 0],
        [1, 2, 3],
    ]
    assert [step.padded_uniform for _, step in taken] == [2, 1, 2, 1]
    assert [step.dropped_uniform for _, step in taken] == [0, 0, 0, 0]
    assert feed.started == 4 * PER_STEP and feed.discarded == 0


class DelayingEngine(HFEngine):
    """The hf engine, except that the group started ``delayed_seq``-th comes back ``delay_s`` seconds late."""

    def __init__(self, model_path, config, delayed_seq: int, delay_s: float):
        super().__init__(model_path, config)
        self.delayed_seq, self.delay_s = delayed_seq, delay_s

    async def generate_group(self, prompt_token_ids, sampling, prompt_index=0):
        completions = await super().generate_group(prompt_token_ids, sampling, prompt_index)
        if prompt_index == self.delayed_seq:
            await asyncio.sleep(self.delay_s)
        return completions


def test_a_spent_refill_budget_leaves_no_group_in_flight_across_a_synchronous_weight_update(
    ray_session, rl_model_dir, weights
):
    """max_staleness 0 with dynamic sampling, one refill round (3 groups) and every group uniform: a
    synchronous step generates groups 0-2, drops them, refills with 3-5, drops those too, and then
    fills itself with the first three dropped (0, 1, 2). The refill group 5 comes back late; the step
    must still wait for it, so that nothing generates across the weight update and no group of the
    next step is too old. Each step: 3 padded, 3 dropped, none stale, none in flight."""
    from raylign.rl.stream import uniform_rewards

    def score(samples):
        for s in samples:
            s.reward = 1.0

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(DelayingEngine).options(num_cpus=0, runtime_env={"env_vars": ENV})
    engine = actor.remote(str(rl_model_dir), RolloutConfig(engine="hf", dtype="float32").model_dump(), 5, 3.0)
    try:
        feed = RolloutFeed(
            GroupStream(RolloutPool([engine]), timeout_s=120),
            _prompts(),
            itertools.cycle(range(8)),
            SamplingConfig(n=2, temperature=1.0, max_new_tokens=4, seed=3),
            PER_STEP,
            0,
            "drop",
            RLTrainer._group_samples,
            score,
            uniform=uniform_rewards,
            max_uniform_per_step=PER_STEP,
            max_groups=2 * PER_STEP,
        )
        taken = _run_steps(feed, [engine], 2, weights)
        assert [[g.seq for g in step.groups] for _, step in taken] == [[0, 1, 2], [6, 7, 8]]
        assert [step.in_flight for _, step in taken] == [0, 0]
        assert [step.dropped_stale for _, step in taken] == [0, 0]
        assert [(step.padded_uniform, step.dropped_uniform) for _, step in taken] == [(3, 3), (3, 3)]
        assert (feed.started, feed.discarded, feed.trained, len(feed.stream)) == (12, 6, 6, 0)
    finally:
        stop_engines([engine])


def test_groups_with_non_finite_rewards_are_dropped_and_replaced(hf_engines, weights):
    """``reward.non_finite: drop``: a group holding a NaN or infinite reward never enters a step;
    it is counted and another group takes its place. Prompts p1 and p3 score NaN and inf here."""

    def score(samples):
        for i, s in enumerate(samples):
            s.reward = {"p1": math.nan, "p3": math.inf}.get(s.prompt_text, float(i % 2))

    start = ray.get(hf_engines[0].weight_version_now.remote())
    feed = RolloutFeed(
        GroupStream(RolloutPool(hf_engines), timeout_s=120),
        _prompts(),
        itertools.cycle(range(8)),
        SamplingConfig(n=2, temperature=1.0, max_new_tokens=4, seed=3),
        PER_STEP,
        0,
        "drop",
        RLTrainer._group_samples,
        score,
    )
    taken = _run_steps(feed, hf_engines, 4, weights, start_version=start)
    admitted = [g.prompt_position for _, step in taken for g in step.groups]
    # Positions cycle 0..7; 1 and 3 are dropped, so the 12 admitted are the others in order.
    assert admitted == [0, 2, 4, 5, 6, 7, 0, 2, 4, 5, 6, 7]
    # Synchronous: a step starts 3 groups and one more for each dropped; steps 1 and 3 meet 1 and 3.
    assert [step.dropped_non_finite for _, step in taken] == [2, 0, 2, 0]
    assert feed.discarded == 4


def test_a_reward_that_is_never_finite_stops_the_run_naming_a_prompt(hf_engines, weights):
    def score(samples):
        for s in samples:
            s.reward = math.nan

    feed = RolloutFeed(
        GroupStream(RolloutPool(hf_engines), timeout_s=120),
        _prompts(),
        itertools.cycle(range(8)),
        SamplingConfig(n=2, temperature=1.0, max_new_tokens=4, seed=3),
        PER_STEP,
        0,
        "drop",
        RLTrainer._group_samples,
        score,
    )
    feed.top_up(0)
    # The limit: 4 steps' worth (12 groups) dropped while gathering one step; the 13th stops the run.
    with pytest.raises(
        RuntimeError,
        match=r"13 prompt groups had a NaN or infinite reward while gathering one step of 3 .* training "
        r"prompt (\d), 'p\1'",
    ):
        feed.take_step(0)
    feed.drain(0)
