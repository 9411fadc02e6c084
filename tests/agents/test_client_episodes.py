"""Turning an endpoint session's recorded turns into one episode (``episode_from_turns``), at the token
limit; and whole client episodes: an agent function talking to the endpoint in front of the real ``hf``
engine (the tiny tied Qwen2 of ``tests/conftest.py``), and the text the endpoint returns."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from transformers import AutoTokenizer

from raylign.agents.client import ClientEpisodeRunner, episode_from_turns
from raylign.agents.endpoint import EndpointServer, EpisodeRecorder, Turn, build_app
from raylign.agents.episode import EnvironmentFailed, EpisodeLimits
from raylign.agents.response_text import SpecialTokens, client_text, hidden_tail
from raylign.config.rollout import RolloutConfig
from raylign.rollout.base import Completion
from raylign.rollout.hf_engine import HFEngine


def turn(prompt: list[int], response: list[int], hidden_tail: int = 0) -> Turn:
    logprobs = [-0.01 * (i + 1) for i in range(len(response))]
    return Turn(prompt, response, logprobs, [0] * len(response), 0, "stop", "text", hidden_tail)


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
    first = turn([1, 2, 3], [4, 5, 6, 7], hidden_tail=2)
    second = turn([1, 2, 3, 4, 5, 9, 10], [11, 12])
    ep = episode_from_turns([first, second], 1.0, EpisodeLimits(max_total_tokens=64))
    assert ep.token_ids == [4, 5, 9, 10, 11, 12]
    assert ep.from_policy == [True, True, False, False, True, True]
    assert ep.logprobs == [-0.01, -0.02, 0.0, 0.0, -0.01, -0.02]
    assert (ep.drift_turns, ep.turns, ep.turn_rewards) == (0, 2, [(5, 1.0)])


def test_a_prompt_that_leaves_out_more_of_the_last_turn_than_the_client_was_not_shown_is_drift():
    # Only 7 (a one-token stop string) was left out of the text returned; a prompt that goes on from
    # before 6 changed what the client saw, so the episode is trained up to turn 1, whole.
    first = turn([1, 2, 3], [4, 5, 6, 7], hidden_tail=1)
    second = turn([1, 2, 3, 4, 5, 9, 10], [11, 12])
    ep = episode_from_turns([first, second], 1.0, EpisodeLimits(max_total_tokens=64))
    assert (ep.token_ids, ep.drift_turns, ep.turns) == ([4, 5, 6, 7], 1, 1)


def test_a_prompt_that_rewrites_earlier_turns_is_still_drift():
    first = turn([1, 2, 3], [4, 5, 6, 7], hidden_tail=2)
    second = turn([1, 2, 8, 4, 5, 9], [11])  # the history itself changed, not only the last turn's tail
    ep = episode_from_turns([first, second], 1.0, EpisodeLimits(max_total_tokens=64))
    assert (ep.token_ids, ep.drift_turns, ep.turns) == ([4, 5, 6, 7], 1, 1)


# ---- client episodes through the endpoint ------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tied_model_dir):
    return AutoTokenizer.from_pretrained(str(tied_model_dir))


@pytest.fixture(scope="module")
def recorder():
    return EpisodeRecorder()


@pytest.fixture(scope="module")
def server(tied_model_dir, tokenizer, recorder):
    engine = HFEngine(str(tied_model_dir), RolloutConfig(engine="hf", dtype="float32").model_dump())

    async def generate(prompt_token_ids, sampling):
        (completion,) = await engine.generate_group(prompt_token_ids, sampling, 0)
        return completion

    with EndpointServer(build_app(generate, tokenizer, recorder)) as server:
        yield server


def play_client(agent_fn, server, recorder):
    runner = ClientEpisodeRunner(agent_fn, recorder, server.url, "unused", EpisodeLimits(max_total_tokens=400))
    return asyncio.run(runner.run("hi", None, {}))


def two_turns(seed: int, received: list, stop: list[str] | None = None):
    """An agent that asks twice, sending back the conversation as it received it; ``received`` gets the choices."""

    def run(ctx):
        client = ctx.openai_client(max_retries=0)
        messages = [{"role": "user", "content": ctx.prompt}]
        for _ in range(2):
            reply = client.chat.completions.create(
                model="policy", messages=messages, max_tokens=6, seed=seed, stop=stop
            )
            received.append(reply.choices[0])
            answer = reply.choices[0].message.content
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
        return 1.0

    return run


def test_special_tokens_the_model_samples_come_back_in_the_text_and_the_turn_is_trained_whole(
    server, recorder, tokenizer
):
    # The random model samples <|im_start|> first in its first turn with seed 3, and <|pad|> fifth with
    # seed 4 (the hf engine); neither is an end of turn. The text sent back must render to those tokens.
    specials = ["<|im_start|>", "<|pad|>"]
    special_ids = set(tokenizer.convert_tokens_to_ids(specials))
    with_special = 0
    for seed in range(6):
        received: list = []
        ep = play_client(two_turns(seed, received), server, recorder)
        sampled = [choice.model_extra["token_ids"] for choice in received]
        if special_ids & set(sampled[0]):
            with_special += 1
            names = tokenizer.convert_ids_to_tokens(sampled[0])
            assert [received[0].message.content.count(s) for s in specials] == [names.count(s) for s in specials]
        policy = [t for t, p in zip(ep.token_ids, ep.from_policy) if p]
        assert (ep.drift_turns, ep.turns, policy) == (0, 2, sampled[0] + sampled[1]), seed
    assert with_special >= 2


def sent_back_as_sampled(tokenizer, ids: list[int]) -> bool:
    """Whether text of ``ids`` tokenises to them again, without what chat templates trim."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return text == text.strip() and tokenizer(text, add_special_tokens=False).input_ids == ids


def test_a_turn_ended_by_a_stop_string_is_trained_up_to_it_and_the_next_turn_follows(server, recorder, tokenizer):
    # With the vowels as stop strings, most random turns end on one, which the returned text leaves out;
    # the client sends that text back, so the next prompt goes on from before the stop string's tokens.
    # The random model samples tokens its tokenizer would not produce from their text ("10" where it
    # splits digits, part of a character's bytes): such turns cannot come back as sampled whatever the
    # stop strings, and are left out.
    stop = list("aeiou")
    stopped = 0
    for seed in range(30):  # 4 of them end turn 1 on a stop string and can be sent back
        received: list = []
        ep = play_client(two_turns(seed, received, stop), server, recorder)
        first, second = (choice.model_extra["token_ids"] for choice in received)
        if not all(sent_back_as_sampled(tokenizer, ids) for ids in (first, second)):
            continue
        shown = received[0].message.content
        policy = [t for t, p in zip(ep.token_ids, ep.from_policy) if p]
        trained_first = policy[: len(policy) - len(second)]
        assert (ep.drift_turns, ep.turns, policy[len(trained_first) :]) == (0, 2, second), seed
        assert trained_first == first[: len(trained_first)], seed
        assert shown.startswith(tokenizer.decode(trained_first, skip_special_tokens=True)), seed
        if len(tokenizer.decode(first, skip_special_tokens=True)) > len(shown):  # a stop string was left out
            stopped += 1
            assert len(trained_first) < len(first), seed
    assert stopped >= 3


def answer_once(ctx, value):
    ctx.openai_client(max_retries=0).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": ctx.prompt}], max_tokens=2, seed=0
    )
    return value


@pytest.mark.parametrize(("returned", "reward"), [(np.float32(0.25), 0.25), (np.int64(2), 2.0), (np.bool_(True), 1.0)])
def test_an_agent_function_may_return_a_numpy_reward(returned, reward, server, recorder):
    def numpy_agent(ctx):
        return answer_once(ctx, returned)

    ep = play_client(numpy_agent, server, recorder)
    assert (ep.reward, type(ep.reward)) == (reward, float)


def test_an_agent_function_returning_no_number_is_a_type_error_naming_it(server, recorder):
    def reward_as_text(ctx):
        return answer_once(ctx, "1.5")

    message = r"the agent function .*reward_as_text returned '1\.5'; it must be a number .*not str"
    with pytest.raises(TypeError, match=message):
        play_client(reward_as_text, server, recorder)


# ---- the text the endpoint returns -------------------------------------------------------------


def completion(tokenizer, pieces: list[str], finish_reason: str, engine_text: str) -> Completion:
    """A completion of the tokens of ``pieces`` (special tokens by name, text tokenised), with the text the
    engines give it: without special tokens."""
    ids = [i for piece in pieces for i in tokenizer(piece, add_special_tokens=False).input_ids]
    return Completion(0, 0, [1], ids, [-1.0] * len(ids), finish_reason, engine_text)


@pytest.mark.parametrize(
    ("pieces", "finish_reason", "engine_text", "stop", "expected"),
    [
        (["ab", "<|pad|>", "cd", "<|im_end|>"], "stop", "abcd", [], "ab<|pad|>cd"),  # the end token is left out
        (["<|im_start|>", "ab", "<|pad|>"], "length", "ab", [], "<|im_start|>ab<|pad|>"),  # cut: all kept
        (["x", "<|pad|>", "END"], "stop", "xEND", ["END"], "x<|pad|>"),  # the stop string is left out
        (["ab", "cd", "<|im_end|>"], "stop", "abcd", [], "abcd"),
    ],
)
def test_the_returned_text_keeps_sampled_special_tokens_but_not_the_end(
    tokenizer, pieces, finish_reason, engine_text, stop, expected
):
    sampled = completion(tokenizer, pieces, finish_reason, engine_text)
    assert client_text(tokenizer, SpecialTokens.of(tokenizer), sampled, stop) == expected


@pytest.mark.parametrize(
    ("pieces", "finish_reason", "engine_text", "stop", "hidden_pieces"),
    [
        (["ab", "<|pad|>", "END"], "stop", "abEND", ["END"], ["END"]),  # the stop string's tokens
        (["ab", "cd", "<|im_end|>"], "stop", "abcd", [], ["<|im_end|>"]),  # the end token
        (["ab", "END"], "length", "abEND", ["END"], []),  # cut at the token limit: the client saw it all
        (["ab", "cd"], "stop", "abcd", ["zz"], []),  # no stop string ends the text: nothing hidden
        (["ab", "cd"], "stop", "abc", ["c"], ["cd"]),  # a stop string inside a token: that token on
    ],
)
def test_the_recorded_turn_counts_the_tokens_the_returned_text_leaves_out(
    tokenizer, pieces, finish_reason, engine_text, stop, hidden_pieces
):
    sampled = completion(tokenizer, pieces, finish_reason, engine_text)
    expected = sum(len(tokenizer(piece, add_special_tokens=False).input_ids) for piece in hidden_pieces)
    assert hidden_tail(tokenizer, SpecialTokens.of(tokenizer), sampled, stop) == expected


def test_the_returned_text_is_the_engines_when_the_tokens_do_not_spell_it(tokenizer):
    # An engine text that the tokens do not spell (another detokenizer): returned as it is, stop string cut.
    sampled = completion(tokenizer, ["ab", "<|pad|>", "END"], "stop", "a b END")
    assert client_text(tokenizer, SpecialTokens.of(tokenizer), sampled, ["END"]) == "a b "
