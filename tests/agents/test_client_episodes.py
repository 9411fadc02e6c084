"""Turning an endpoint session's recorded turns into one episode (``episode_from_turns``), at the token limit."""

from __future__ import annotations

import pytest

from raylign.agents.client import episode_from_turns
from raylign.agents.endpoint import Turn
from raylign.agents.episode import EnvironmentFailed, EpisodeLimits


def turn(prompt: list[int], response: list[int]) -> Turn:
    logprobs = [-0.01 * (i + 1) for i in range(len(response))]
    return Turn(prompt, response, logprobs, [0] * len(response), 0, "stop", "text")


def test_a_first_turn_longer_than_the_limit_keeps_its_first_tokens_as_sampled():
    # 20 prompt tokens and 200 sampled under max_total_tokens 128: the first 108 are the episode.
    first = turn(list(range(20)), list(range(100, 300)))
    ep = episode_from_turns([first], 1.0, EpisodeLimits(max_total_tokens=128))
    assert ep.token_ids == list(range(100, 208))
    assert ep.logprobs == first.response_logprobs[:108]
    assert ep.from_policy == [True] * 108
    assert (ep.end_reason, ep.finish_reason, ep.turns) == ("max_tokens", "length", 1)
    assert ep.turn_rewards == [(107, 1.0)]


def test_a_later_turn_over_the_limit_ends_the_episode_after_the_turns_before_it():
    first = turn([1, 2, 3], [4, 5])
    second = turn([1, 2, 3, 4, 5, 6, 7], list(range(10, 30)))  # 7 so far + 20 > 16
    ep = episode_from_turns([first, second], 0.5, EpisodeLimits(max_total_tokens=16))
    assert (ep.token_ids, ep.end_reason, ep.turns, ep.turn_rewards) == ([4, 5], "max_tokens", 1, [(1, 0.5)])


def test_a_prompt_that_alone_fills_the_limit_names_both_sizes():
    with pytest.raises(EnvironmentFailed, match=r"prompt alone \(16 tokens\) fills agent.max_total_tokens \(16\)"):
        episode_from_turns([turn(list(range(16)), [1])], 1.0, EpisodeLimits(max_total_tokens=16))


def test_a_stop_string_the_client_never_saw_is_dropped_and_the_next_turn_continues():
    # Turn 1 sampled [4, 5, 6, 7], where 6 and 7 spell the stop string that the returned text leaves
    # out; the client sends the conversation back, so turn 2's prompt goes on from [.., 4, 5].
    first = turn([1, 2, 3], [4, 5, 6, 7])
    second = turn([1, 2, 3, 4, 5, 9, 10], [11, 12])
    ep = episode_from_turns([first, second], 1.0, EpisodeLimits(max_total_tokens=64))
    assert ep.token_ids == [4, 5, 9, 10, 11, 12]
    assert ep.from_policy == [True, True, False, False, True, True]
    assert ep.logprobs == [-0.01, -0.02, 0.0, 0.0, -0.01, -0.02]
    assert (ep.drift_turns, ep.turns, ep.turn_rewards) == (0, 2, [(5, 1.0)])


def test_a_prompt_that_rewrites_earlier_turns_is_still_drift():
    first = turn([1, 2, 3], [4, 5, 6, 7])
    second = turn([1, 2, 8, 4, 5, 9], [11])  # the history itself changed, not only the last turn's tail
    ep = episode_from_turns([first, second], 1.0, EpisodeLimits(max_total_tokens=64))
    assert (ep.token_ids, ep.drift_turns, ep.turns) == ([4, 5, 6, 7], 1, 1)
