"""ResumableSampler: epoch orders, exact resumption, and splitting a batch over ranks."""

from __future__ import annotations

import numpy as np
import pytest

from raylign.data import ResumableSampler, rank_micro_batches, shard_for_rank, split_micro_batches


def _take(sampler: ResumableSampler, num_batches: int) -> list[list[int]]:
    """The next ``num_batches`` batches, crossing epochs, consumed the way a trainer does."""
    batches: list[list[int]] = []
    while len(batches) < num_batches:
        for batch in sampler:
            batches.append(batch)
            if len(batches) == num_batches:
                break
    return batches


def test_each_epoch_is_the_seeded_permutation_cut_into_batches():
    sampler = ResumableSampler(10, batch_size=3, seed=5)
    for epoch in range(2):
        order = np.random.default_rng(5 + epoch).permutation(10).tolist()
        assert list(sampler) == [order[0:3], order[3:6], order[6:9]]  # drop_last leaves order[9] out


def test_without_shuffle_and_drop_last_batches_are_in_order_with_a_short_tail():
    sampler = ResumableSampler(7, batch_size=3, shuffle=False, drop_last=False)
    assert list(sampler) == [[0, 1, 2], [3, 4, 5], [6]]
    assert len(sampler) == 3


def test_epochs_are_reshuffled():
    sampler = ResumableSampler(50, batch_size=10, seed=0)
    first, second = list(sampler), list(sampler)
    assert first != second
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(50))


@pytest.mark.parametrize("stop_after", [1, 3, 4, 5, 9])
def test_resumed_sampler_yields_exactly_the_remaining_batches(stop_after):
    # 4 batches per epoch: stopping after 3 is mid-epoch, 4 the epoch's end, 5 and 9 in later epochs
    reference = _take(ResumableSampler(17, batch_size=4, seed=11), 12)

    interrupted = ResumableSampler(17, batch_size=4, seed=11)
    before = _take(interrupted, stop_after)
    state = interrupted.state_dict()

    resumed = ResumableSampler(17, batch_size=4, seed=11)
    resumed.load_state_dict(state)
    after = _take(resumed, 12 - stop_after)
    assert before + after == reference


def test_state_after_a_whole_epoch_points_at_the_next_epoch_start():
    sampler = ResumableSampler(8, batch_size=4)
    _take(sampler, 2)
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["batches_done"] == 0


def test_loading_state_from_a_different_dataset_size_fails():
    state = ResumableSampler(20, batch_size=4).state_dict()
    with pytest.raises(ValueError, match="saved with num_samples=20, this sampler has num_samples=21"):
        ResumableSampler(21, batch_size=4).load_state_dict(state)


@pytest.mark.parametrize("changed", [{"seed": 1}, {"shuffle": False}])
def test_loading_state_saved_with_another_order_fails_naming_the_setting(changed):
    # Another seed or no shuffling orders the epoch differently: the rest of it would repeat some
    # samples and skip others.
    state = ResumableSampler(20, batch_size=4, shuffle=True, seed=0).state_dict()
    (key,) = changed
    with pytest.raises(ValueError, match=f"saved with {key}="):
        ResumableSampler(20, batch_size=4, **{"shuffle": True, "seed": 0, **changed}).load_state_dict(state)


def test_state_saved_before_order_settings_were_recorded_still_loads():
    state = {"epoch": 0, "batches_done": 2, "num_samples": 20, "batch_size": 4}
    sampler = ResumableSampler(20, batch_size=4, seed=5)
    sampler.load_state_dict(state)
    assert sampler.state_dict()["batches_done"] == 2


def test_too_few_samples_for_one_batch_is_an_error():
    with pytest.raises(ValueError, match="3 samples make no batch of 4 with drop_last"):
        ResumableSampler(3, batch_size=4)


def test_shard_for_rank_splits_contiguously_with_lower_ranks_larger():
    batch = list(range(10, 20))
    shards = [shard_for_rank(batch, rank, 3) for rank in range(3)]
    assert shards == [[10, 11, 12, 13], [14, 15, 16], [17, 18, 19]]


def test_rank_micro_batches_cuts_the_rank_share():
    batch = list(range(12))
    assert rank_micro_batches(batch, rank=1, world_size=2, micro_batch_size=4) == [[6, 7, 8, 9], [10, 11]]
    assert split_micro_batches([1, 2, 3], 2) == [[1, 2], [3]]
