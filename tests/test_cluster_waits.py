"""``get_within``, the wait behind every remote call of a run, with real Ray actors: a call that fails
because a peer died reports the death, not the survivor's error; a failure with no death behind it
is raised as it is, after at most the grace period; a call past the limit is named."""

from __future__ import annotations

import os
import time

import pytest

from raylign.cluster import PEER_DEATH_GRACE_S, ActorDied, get_within


class Rank:
    """Plays one rank of a collective call."""

    def fail_after(self, seconds: float) -> None:  # what a survivor's collective raises when its peer is gone
        time.sleep(seconds)
        raise ConnectionError("Connection reset by peer")

    def die_after(self, seconds: float) -> None:
        time.sleep(seconds)
        os._exit(1)

    def answer_after(self, seconds: float, value: str) -> str:
        time.sleep(seconds)
        return value


@pytest.fixture
def ranks(ray_session):
    actors = [ray_session.remote(Rank).options(num_cpus=0).remote() for _ in range(2)]
    yield actors
    for actor in actors:
        ray_session.kill(actor)


NAMES = ["rank 0 of 2", "rank 1 of 2"]


def test_a_peer_that_dies_after_the_survivors_error_is_the_cause_reported(ranks):
    # Rank 0's error reaches the caller about a second before rank 1's death does.
    refs = [ranks[0].fail_after.remote(0.2), ranks[1].die_after.remote(1.5)]
    start = time.monotonic()
    with pytest.raises(ActorDied) as err:
        get_within(refs, 60, "policy workers' train_policy", "train.step_timeout_s", NAMES)
    assert (err.value.name, err.value.index) == ("rank 1 of 2", 1)
    assert str(err.value).startswith("policy workers' train_policy: rank 1 of 2 died while computing it")
    assert "Connection reset by peer" in str(err.value.__cause__)  # the survivor's error stays attached
    assert time.monotonic() - start < 1.5 + PEER_DEATH_GRACE_S


def test_a_failure_without_a_death_is_raised_as_it_is_after_the_grace_period(ranks, ray_session):
    refs = [ranks[0].fail_after.remote(0.2), ranks[1].answer_after.remote(30, "late")]
    start = time.monotonic()
    with pytest.raises(ray_session.exceptions.RayTaskError, match="Connection reset by peer"):
        get_within(refs, 60, "policy workers' train_policy", "train.step_timeout_s", NAMES)
    waited = time.monotonic() - start
    assert PEER_DEATH_GRACE_S <= waited < PEER_DEATH_GRACE_S + 10


def test_answers_come_in_call_order_and_a_call_past_the_limit_is_named(ranks):
    refs = [ranks[0].answer_after.remote(0.5, "first"), ranks[1].answer_after.remote(0.1, "second")]
    assert get_within(refs, 60, "calls", "the limit", NAMES) == ["first", "second"]
    refs = [ranks[0].answer_after.remote(0.1, "quick"), ranks[1].answer_after.remote(30, "slow")]
    with pytest.raises(TimeoutError, match=r"^calls: no answer within 2 s from rank 1 of 2; raise the limit"):
        get_within(refs, 2, "calls", "the limit", NAMES)
