"""The pool balances prompts across engines by token load and returns completions in order."""

from __future__ import annotations

import pytest
import torch

from raylign.config.rollout import RolloutConfig, SamplingConfig
from raylign.rollout.base import Completion
from raylign.rollout.pool import RolloutPool, launch_engines, order_completions, split_by_token_load, stop_engines
from raylign.rollout.weight_sync import retired_groups

from .rollout_helpers import load_fp32, perturb_, reference_logprobs

# prompt lengths 10, 2, 7, 3, 6 with 4 new tokens: loads 14, 6, 11, 7, 10.
# Heaviest first to the lighter engine: p0->e0 (14), p2->e1 (11), p4->e1 (21), p3->e0 (21), p1->e0 (27; tie -> e0).
LENGTHS = [10, 2, 7, 3, 6]
EXPECTED_SHARDS = [[0, 1, 3], [2, 4]]


def test_split_by_token_load_matches_the_hand_computed_assignment():
    assert split_by_token_load(LENGTHS, num_engines=2, max_new_tokens=4) == EXPECTED_SHARDS


def test_split_gives_every_prompt_to_exactly_one_engine():
    shards = split_by_token_load([3] * 7, num_engines=3, max_new_tokens=1)
    assert sorted(p for shard in shards for p in shard) == list(range(7))
    assert sorted(len(s) for s in shards) == [2, 2, 3]


def test_order_completions_reports_missing_samples():
    def c(p, s):
        return Completion(p, s, [1], [2], [0.0], "length", "")

    assert [
        (x.prompt_index, x.sample_index) for x in order_completions([c(1, 0), c(0, 1), c(0, 0), c(1, 1)], [0, 1], 2)
    ] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(RuntimeError, match="missing"):
        order_completions([c(0, 0)], [0], 2)


def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Argmax decoding by repeated full forwards."""
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([prompt + tokens])).logits[0, -1].argmax())
            tokens.append(token)
            if token == eos:
                break
    return tokens


def _fail_after(named_tensors, count):
    for i, item in enumerate(named_tensors):
        if i == count:
            raise ValueError("trainer failed while gathering weights")
        yield item


@pytest.mark.slow
def test_pool_of_two_engines_splits_by_load_and_returns_in_order(ray_session, tied_model_dir):
    config = RolloutConfig(engine="hf", dtype="float32", num_engines=2, num_cpus_per_engine=1)
    engines = launch_engines(tied_model_dir, config, env_vars={"OMP_NUM_THREADS": "1"})
    try:
        ray_session.get(engines[1].update_weights.remote([]))  # tag engine 1: its completions carry version 1
        pool = RolloutPool(engines)
        prompts = [[(5 * p + i) % 400 + 4 for i in range(n)] for p, n in enumerate(LENGTHS)]
        out = pool.generate_blocking(prompts, SamplingConfig(n=2, temperature=0.0, max_new_tokens=4))

        assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(5) for s in range(2)]
        served_by = {c.prompt_index: c.weight_version for c in out}
        assert [p for p in range(5) if served_by[p] == 0] == EXPECTED_SHARDS[0]
        assert [p for p in range(5) if served_by[p] == 1] == EXPECTED_SHARDS[1]
        model = load_fp32(tied_model_dir)
        eos = model.generation_config.eos_token_id
        for c in out:
            assert c.prompt_token_ids == prompts[c.prompt_index]
            assert c.response_token_ids == greedy_reference(model, prompts[c.prompt_index], 4, eos)

        # Weight sync to both engines (one gloo group each), then both match the trainer.
        perturb_(model)
        pool.connect_weight_sync(bucket_mb=0.05, timeout_s=60)
        with pytest.raises(ValueError, match="trainer failed"):  # a failing trainer aborts the engines' receive
            pool.sync_weights(_fail_after(model.named_parameters(), 3))
        stats = pool.sync_weights(model.named_parameters())  # and the groups stay usable
        retired = retired_groups()
        pool.close_weight_sync()
        assert retired_groups() == retired + 2  # both groups stay referenced: dropping one can hang the process
        assert stats.num_tensors == len(list(model.named_parameters()))
        after = pool.generate_blocking(prompts, SamplingConfig(temperature=0.0, max_new_tokens=4))
        assert {c.weight_version for c in after} == {1, 2}
        for c in after:
            expected = reference_logprobs(model, c.prompt_token_ids, c.response_token_ids)
            assert c.response_logprobs == pytest.approx(expected, abs=1e-4)
    finally:
        for engine in engines:
            stop_engines([engine])
