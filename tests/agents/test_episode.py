"""Episodes against a real tiny model: tokens in and out exactly, template drift, limits, metrics,
and the environment API (observations, step results, loading a class by name)."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from raylign.agents.env import StepResult, as_messages, as_step_result, load_environment
from raylign.agents.episode import (
    EnvironmentFailed,
    Episode,
    EpisodeLimits,
    EpisodeRunner,
    TemplateDriftError,
    episode_metrics,
)
from raylign.agents.tools import CalculatorEnv, ToolEnv, calculator
from raylign.config.rollout import RolloutConfig, SamplingConfig
from raylign.models.tiny import CHAT_TEMPLATE, build_tiny_model
from raylign.rollout.base import Completion
from raylign.rollout.hf_engine import HFEngine

SAMPLING = SamplingConfig(max_new_tokens=6, seed=1)
PROMPT = "What is 2*3?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=1
    )


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFEngine(str(model_dir), RolloutConfig(engine="hf", dtype="float32").model_dump())


@pytest.fixture
def completions():
    """Every completion the engine returned in this test, in order."""
    return []


@pytest.fixture
def generate(engine, completions):
    async def generate(ids, sampling, index):
        (completion,) = await engine.generate_group(ids, sampling, index)
        completions.append(completion)
        return completion

    return generate


class ScriptedEnv:
    """Observes ``OBS<k>`` after turn k, rewards turn k with k, ends after ``turns`` turns; records
    the actions it received and counts its close() calls."""

    def __init__(self, turns: int = 3):
        self.turns, self.actions, self.closed = turns, [], 0

    def reset(self, prompt, label, metadata):
        return [{"role": "user", "content": prompt}]

    def step(self, action_text, action_token_ids):
        self.actions.append(list(action_token_ids))
        k = len(self.actions)
        done = k >= self.turns
        return (None if done else f"OBS{k}"), float(k), done, {}

    def close(self):
        self.closed += 1


class EndlessEnv(ScriptedEnv):
    def step(self, action_text, action_token_ids):
        self.actions.append(list(action_token_ids))
        return "more", 0.0, False, {}


def play(env, tokenizer, generate, limits=None, sampling=SAMPLING):
    runner = EpisodeRunner(lambda: env, tokenizer, limits or EpisodeLimits(max_turns=8, max_total_tokens=400))
    return asyncio.run(runner.run(PROMPT, None, {}, generate, sampling))


def runs(episode, source):
    """The maximal runs of consecutive tokens from ``source`` (True: policy), as (start, ids)."""
    out, start = [], None
    for i, from_policy in enumerate(episode.from_policy + [not source]):
        if from_policy == source and start is None:
            start = i
        elif from_policy != source and start is not None:
            out.append((start, episode.token_ids[start:i]))
            start = None
    return out


# ---- token in, token out --------------------------------------------------------------------


def test_prompt_ids_are_the_template_render_of_the_first_messages(tokenizer, generate):
    ep = play(ScriptedEnv(turns=1), tokenizer, generate)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    assert text == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    assert ep.prompt_ids == tokenizer(text, add_special_tokens=False).input_ids


def test_policy_tokens_are_exactly_the_actions_the_environment_received(tokenizer, generate, completions):
    env = ScriptedEnv(turns=3)
    ep = play(env, tokenizer, generate)
    assert (ep.end_reason, ep.turns, len(env.actions)) == ("done", 3, 3)
    assert [ids for _, ids in runs(ep, True)] == env.actions
    assert env.actions == [c.response_token_ids for c in completions]
    policy_logprobs = [lp for lp, p in zip(ep.logprobs, ep.from_policy) if p]
    assert policy_logprobs == [lp for c in completions for lp in c.response_logprobs]


def test_environment_tokens_are_the_templates_text_for_each_observation(tokenizer, generate):
    ep = play(ScriptedEnv(turns=3), tokenizer, generate)
    policy_turns = [ids for _, ids in runs(ep, True)]
    env_turns = runs(ep, False)
    assert len(env_turns) == 2
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for k, (start, ids) in enumerate(env_turns, 1):
        # The template closes the assistant turn itself unless the model already did.
        close = "" if policy_turns[k - 1][-1] == im_end else "<|im_end|>"
        expected = close + f"\n<|im_start|>user\nOBS{k}<|im_end|>\n<|im_start|>assistant\n"
        assert tokenizer.decode(ids, skip_special_tokens=False) == expected
        assert ep.logprobs[start : start + len(ids)] == [0.0] * len(ids)
        assert ep.versions[start : start + len(ids)] == [ep.versions[start - 1]] * len(ids)
    assert ep.drift_turns == 0


def test_turn_rewards_sit_on_the_last_policy_token_of_each_turn(tokenizer, generate):
    ep = play(ScriptedEnv(turns=3), tokenizer, generate)
    last_policy = [
        i for i, p in enumerate(ep.from_policy) if p and (i + 1 == len(ep.from_policy) or not ep.from_policy[i + 1])
    ]
    assert ep.turn_rewards == [(last_policy[0], 1.0), (last_policy[1], 2.0), (last_policy[2], 3.0)]
    assert ep.reward == 6.0


# ---- template drift -------------------------------------------------------------------------

# Not append-only: the header counts the messages, so every longer conversation rewrites the start.
COUNTING_TEMPLATE = "{{ messages | length }} messages\n" + CHAT_TEMPLATE


@pytest.fixture(scope="module")
def drifting_tokenizer(tokenizer):
    drifting = copy.deepcopy(tokenizer)
    drifting.chat_template = COUNTING_TEMPLATE
    return drifting


def test_a_template_that_rewrites_the_start_drifts_at_every_environment_turn(drifting_tokenizer, generate):
    env = ScriptedEnv(turns=3)
    ep = play(env, drifting_tokenizer, generate, EpisodeLimits(max_total_tokens=400, drift="warn"))
    assert (ep.end_reason, ep.turns, ep.drift_turns, env.closed) == ("done", 3, 2, 1)


def test_after_drift_the_assistant_turn_is_still_closed(drifting_tokenizer, generate):
    ep = play(ScriptedEnv(turns=3), drifting_tokenizer, generate, EpisodeLimits(max_total_tokens=400))
    policy_turns = [ids for _, ids in runs(ep, True)]
    im_end = drifting_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for k, (_, ids) in enumerate(runs(ep, False), 1):
        close = "\n" if policy_turns[k - 1][-1] == im_end else "<|im_end|>\n"
        # The whole conversation's render is no prefix match: the observation is rendered alone.
        expected = close + f"1 messages\n<|im_start|>user\nOBS{k}<|im_end|>\n<|im_start|>assistant\n"
        assert drifting_tokenizer.decode(ids, skip_special_tokens=False) == expected


def test_drift_error_stops_the_episode(drifting_tokenizer, generate):
    env = ScriptedEnv(turns=3)
    with pytest.raises(TemplateDriftError, match="not append-only"):
        play(env, drifting_tokenizer, generate, EpisodeLimits(max_total_tokens=400, drift="error"))
    assert (len(env.actions), env.closed) == (1, 1)


def test_chatml_does_not_drift_even_with_drift_error(tokenizer, generate):
    ep = play(ScriptedEnv(turns=3), tokenizer, generate, EpisodeLimits(max_total_tokens=400, drift="error"))
    assert (ep.end_reason, ep.drift_turns) == ("done", 0)


def test_special_tokens_the_policy_samples_inside_a_turn_are_not_drift(tokenizer, generate):
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    episodes = [
        play(ScriptedEnv(turns=2), tokenizer, generate, sampling=SAMPLING.model_copy(update={"seed": seed}))
        for seed in range(48)
    ]
    # In some of these the random model writes <|im_start|> inside its first turn, the one the
    # environment turn after it checks (seed 39 with the hf engine's per-sample streams); in others
    # the turn, cut at its token limit, ends with a sampled <|pad|> (seed 16), which is its own
    # content, not an end-of-turn token the template writes.
    first_turns = [runs(ep, True)[0][1] for ep in episodes]
    assert any(im_start in ids[:-1] for ids in first_turns)
    pad = tokenizer.convert_tokens_to_ids("<|pad|>")
    assert any(len(ids) == SAMPLING.max_new_tokens and ids[-1] == pad for ids in first_turns)
    assert [ep.drift_turns for ep in episodes] == [0] * len(episodes)


def test_a_turn_that_stops_on_another_end_token_of_the_model_is_not_drift(model_dir, tokenizer, tmp_path):
    # A model with two end tokens (as Qwen2.5-Instruct: <|im_end|> and <|endoftext|>); here <|pad|> is
    # the second. A turn that stops on it is followed by the template's own <|im_end|>, and is no drift.
    import json
    import shutil

    folder = shutil.copytree(model_dir, tmp_path / "two-ends")
    pad, im_end = tokenizer.convert_tokens_to_ids("<|pad|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [im_end, pad]}))
    engine = HFEngine(str(folder), RolloutConfig(engine="hf", dtype="float32").model_dump())

    async def generate(ids, sampling, index):
        (completion,) = await engine.generate_group(ids, sampling, index)
        return completion

    limits = EpisodeLimits(max_total_tokens=400, drift="error")
    episodes = [
        play(ScriptedEnv(turns=2), tokenizer, generate, limits, sampling=SAMPLING.model_copy(update={"seed": seed}))
        for seed in range(48)
    ]
    first_turns = [runs(ep, True)[0][1] for ep in episodes]
    assert any(ids[-1] == pad and len(ids) < SAMPLING.max_new_tokens for ids in first_turns)  # stopped on <|pad|>
    assert [ep.drift_turns for ep in episodes] == [0] * len(episodes)


def scripted_turn(turn):
    """A ``generate`` that samples ``turn`` at every request, stopping (finish_reason "stop") on its last token."""

    async def generate(ids, sampling, index):
        return Completion(index, 0, list(ids), list(turn), [-1.0] * len(turn), "stop", "ab")

    return generate


def test_a_turn_that_stops_on_the_templates_end_token_outside_all_special_ids_ends_there(tokenizer):
    # A tokenizer whose named eos is <|endoftext|>: the template's <|im_end|> is an added special token
    # but not in all_special_ids (as an end token that only the generation config names). The turn that
    # stops on it is closed by it; the template's own <|im_end|> is not appended a second time.
    other_eos = copy.deepcopy(tokenizer)
    other_eos.eos_token = "<|endoftext|>"
    im_end = other_eos.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in other_eos.all_special_ids
    turn = other_eos("ab", add_special_tokens=False).input_ids + [im_end]

    ep = play(ScriptedEnv(turns=2), other_eos, scripted_turn(turn), EpisodeLimits(max_total_tokens=400, drift="error"))
    observation = other_eos("\n<|im_start|>user\nOBS1<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert ep.messages[1] == {"role": "assistant", "content": "ab"}
    assert ep.drift_turns == 0
    assert ep.token_ids == turn + observation.input_ids + turn


def test_a_turn_that_stops_on_another_special_token_outside_all_special_ids_is_not_drift(tokenizer):
    # <|endoftext|> is an added special token of the tiny tokenizer but not in its all_special_ids
    # (eos <|im_end|>, pad <|pad|>). A turn that stops on it is handled as one stopping on a second end
    # token of the model: the conversation leaves it out, and the template's <|im_end|> follows it.
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert endoftext not in tokenizer.all_special_ids
    turn = tokenizer("ab", add_special_tokens=False).input_ids + [endoftext]

    ep = play(ScriptedEnv(turns=2), tokenizer, scripted_turn(turn), EpisodeLimits(max_total_tokens=400, drift="error"))
    between = tokenizer(
        "<|im_end|>\n<|im_start|>user\nOBS1<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert ep.messages[1] == {"role": "assistant", "content": "ab"}
    assert ep.drift_turns == 0
    assert ep.token_ids == turn + between.input_ids + turn


class CountingTokenizer:
    """The real tokenizer, counting the reads of its ``added_tokens_decoder`` (a dict built at each read)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.special_id_reads = tokenizer, 0

    @property
    def added_tokens_decoder(self):
        self.special_id_reads += 1
        return self.tokenizer.added_tokens_decoder

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_the_runner_reads_the_special_token_ids_once_not_at_every_turn(drifting_tokenizer, generate):
    # Each drifting environment turn looks at the policy's trailing special tokens.
    counting = CountingTokenizer(drifting_tokenizer)
    ep = play(ScriptedEnv(turns=3), counting, generate, EpisodeLimits(max_total_tokens=400))
    assert (ep.turns, ep.drift_turns) == (3, 2)
    assert counting.special_id_reads == 1


# ---- limits ---------------------------------------------------------------------------------


def test_an_endless_environment_stops_after_max_turns(tokenizer, generate):
    env = EndlessEnv()
    ep = play(env, tokenizer, generate, EpisodeLimits(max_turns=3, max_total_tokens=400))
    assert (ep.end_reason, ep.turns, len(runs(ep, True)), len(env.actions), env.closed) == ("max_turns", 3, 3, 3, 1)


def test_max_total_tokens_bounds_prompt_and_turns(tokenizer, generate):
    env = EndlessEnv()
    prompt_len = len(tokenizer(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n").input_ids)
    limit = prompt_len + 40
    ep = play(env, tokenizer, generate, EpisodeLimits(max_turns=100, max_total_tokens=limit))
    assert ep.end_reason == "max_tokens"
    assert len(ep.prompt_ids) + len(ep.token_ids) <= limit
    assert env.closed == 1


def play_then_release(env, tokenizer, generate, release: threading.Event) -> tuple[Episode, float]:
    """One episode under a 0.5 s step limit, and its seconds; then ``release`` frees what the episode left
    blocking in a thread, so that asyncio.run can join it."""
    runner = EpisodeRunner(lambda: env, tokenizer, EpisodeLimits(step_timeout_s=0.5, max_total_tokens=400))

    async def timed():
        start = time.perf_counter()
        try:
            return await runner.run(PROMPT, None, {}, generate, SAMPLING), time.perf_counter() - start
        finally:
            release.set()

    return asyncio.run(timed())


def test_a_blocking_step_that_hangs_ends_with_step_timeout(tokenizer, generate):
    # Blocks "forever"; released after the episode, so that asyncio.run can join its thread.
    release = threading.Event()

    class HangingEnv(ScriptedEnv):
        def step(self, action_text, action_token_ids):
            release.wait(3600)
            return None, 0.0, True, {}

    env = HangingEnv()
    ep, seconds = play_then_release(env, tokenizer, generate, release)
    assert (ep.end_reason, ep.turns, env.closed) == ("step_timeout", 1, 1)
    assert seconds < 10


def test_a_tool_envs_grader_that_blocks_ends_the_turn_with_step_timeout(tokenizer, generate):
    """ToolEnv grades an answer with the user's answer_reward: one that blocks must not stop the event loop
    (every episode's), so agent.step_timeout_s still ends the turn. Released after 5 s, past the limit."""
    release = threading.Event()

    def blocking_grader(answer, label):
        release.wait(5)
        return 1.0

    env = ToolEnv([calculator], system_prompt="", answer_reward=blocking_grader, step_budget_s=0.2)
    ep, seconds = play_then_release(env, tokenizer, generate, release)
    assert (ep.end_reason, ep.turns) == ("step_timeout", 1)
    assert seconds < 4


def test_an_async_step_that_hangs_ends_with_step_timeout(tokenizer, generate):
    class HangingEnv(ScriptedEnv):
        async def step(self, action_text, action_token_ids):
            await asyncio.Event().wait()

    env = HangingEnv()
    start = time.perf_counter()
    ep = play(env, tokenizer, generate, EpisodeLimits(step_timeout_s=0.5, max_total_tokens=400))
    assert (ep.end_reason, ep.turns, env.closed) == ("step_timeout", 1, 1)
    assert time.perf_counter() - start < 10


def test_an_engine_that_returns_no_turn_ends_the_episode_with_an_error_naming_the_turn_and_the_setting(tokenizer):
    async def silent_engine(prompt_ids, sampling, request_index):
        await asyncio.Event().wait()

    env = ScriptedEnv()
    runner = EpisodeRunner(lambda: env, tokenizer, EpisodeLimits(max_total_tokens=400), generate_timeout_s=0.2)
    with pytest.raises(
        TimeoutError,
        match=r"^episode 3, turn 0: the rollout engine returned no completion within "
        r"rollout.generate_timeout_s=0.2 s$",
    ):
        asyncio.run(runner.run(PROMPT, None, {}, silent_engine, SAMPLING, where="episode 3"))
    assert env.closed == 1  # the environment is closed all the same


def test_episode_timeout_ends_a_slow_endless_episode(tokenizer, generate):
    class SlowEnv(EndlessEnv):
        async def step(self, action_text, action_token_ids):
            await asyncio.sleep(0.2)
            return "more", 0.0, False, {}

    env = SlowEnv()
    start = time.perf_counter()
    ep = play(env, tokenizer, generate, EpisodeLimits(max_turns=100, max_total_tokens=4000, episode_timeout_s=0.5))
    assert (ep.end_reason, env.closed) == ("timeout", 1)
    assert ep.turns < 100
    assert time.perf_counter() - start < 10


class SlowResetEnv(ScriptedEnv):
    """Spends 0.2 s in reset: more than the wall time the tests below give the whole episode."""

    def reset(self, prompt, label, metadata):
        time.sleep(0.2)
        return super().reset(prompt, label, metadata)


@pytest.mark.parametrize(("turns", "end_reason"), [(1, "done"), (3, "timeout")])
def test_the_turn_generated_when_the_wall_time_runs_out_is_graded_by_its_step(turns, end_reason, tokenizer, generate):
    # The wall time (0.1 s) is over before the first turn is generated; that turn is trained, so its step
    # grades it (reward 1.0 for turn 1), as the last turn of max_turns is, and the episode ends there.
    env = SlowResetEnv(turns=turns)
    ep = play(env, tokenizer, generate, EpisodeLimits(max_total_tokens=400, episode_timeout_s=0.1))
    assert (ep.end_reason, ep.turns, len(env.actions), env.closed) == (end_reason, 1, 1, 1)
    assert ep.from_policy == [True] * len(ep.token_ids)
    assert ep.turn_rewards == [(len(ep.token_ids) - 1, 1.0)]


def test_a_step_that_runs_past_the_wall_time_has_its_whole_step_timeout(tokenizer, generate):
    class SlowStepEnv(ScriptedEnv):
        async def step(self, action_text, action_token_ids):
            await asyncio.sleep(0.4)  # past the episode's 0.2 s, well within the step's 5 s
            return ScriptedEnv.step(self, action_text, action_token_ids)

    env = SlowStepEnv(turns=3)
    limits = EpisodeLimits(max_total_tokens=400, episode_timeout_s=0.2, step_timeout_s=5.0)
    ep = play(env, tokenizer, generate, limits)
    assert (ep.end_reason, ep.turns, len(env.actions)) == ("timeout", 1, 1)
    assert ep.turn_rewards == [(len(ep.token_ids) - 1, 1.0)]


def test_an_environment_whose_step_budget_does_not_fit_the_step_timeout_is_refused(tokenizer, generate):
    # Its tool calls may take 30 s in a turn; a step of 30 s would be cut off with the turn unrewarded.
    env = CalculatorEnv(system_prompt="", step_budget_s=30.0)
    message = r"CalculatorEnv's step_budget_s=30 s is not below agent.step_timeout_s=30 s"
    with pytest.raises(EnvironmentFailed, match=message):
        play(env, tokenizer, generate, EpisodeLimits(max_total_tokens=400, step_timeout_s=30.0))
    assert play(CalculatorEnv(system_prompt="", step_budget_s=29.0), tokenizer, generate).turns >= 1


def test_a_step_that_raises_ends_with_env_error_and_its_message(tokenizer, generate):
    class FailingEnv(ScriptedEnv):
        def step(self, action_text, action_token_ids):
            raise ValueError("boom 42")

    env = FailingEnv()
    ep = play(env, tokenizer, generate)
    assert (ep.end_reason, ep.error, ep.turns, env.closed) == ("env_error", "ValueError: boom 42", 1, 1)


@pytest.mark.parametrize("observation", [None, []], ids=["none", "empty"])
def test_a_step_with_no_observation_that_is_not_done_ends_the_episode_not_the_run(observation, tokenizer, generate):
    class SilentEnv(ScriptedEnv):
        def step(self, action_text, action_token_ids):
            return observation, 0.0, False, {}

    env = SilentEnv()
    ep = play(env, tokenizer, generate)
    assert (ep.end_reason, ep.error, ep.turns, env.closed) == (
        "env_error",
        "step() returned no observation but done=False",
        1,
        1,
    )


def test_a_template_that_refuses_the_conversation_ends_the_episode_not_the_run(tokenizer, generate):
    # A template that insists on alternating roles, as some do, meets two observation messages in a row.
    strict = copy.copy(tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    class TwoMessagesEnv(ScriptedEnv):
        def step(self, action_text, action_token_ids):
            return [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], 0.0, False, {}

    env = TwoMessagesEnv()
    ep = play(env, strict, generate)
    assert (ep.end_reason, ep.turns, env.closed) == ("env_error", 1, 1)
    assert ep.error.startswith("the chat template refused the conversation: TemplateError: roles must alternate")


def test_a_reset_that_raises_fails_the_episode_naming_it(tokenizer, generate):
    class BrokenResetEnv(ScriptedEnv):
        def reset(self, prompt, label, metadata):
            raise RuntimeError("no dataset row")

    env = BrokenResetEnv()
    with pytest.raises(EnvironmentFailed, match=r"reset\(\) raised RuntimeError\('no dataset row'\)"):
        play(env, tokenizer, generate)
    assert env.closed == 1


def test_close_is_called_once_when_the_episode_ends_normally(tokenizer, generate):
    env = ScriptedEnv(turns=2)
    play(env, tokenizer, generate)
    assert env.closed == 1


# ---- metrics --------------------------------------------------------------------------------


def test_episode_metrics_of_two_hand_made_episodes():
    first = Episode(
        prompt_ids=[1, 2],
        token_ids=[5, 6, 7, 8],
        from_policy=[True, True, False, True],
        turn_rewards=[(1, 0.5), (3, 1.0)],
        turns=2,
        end_reason="done",
        tool_calls=2,
        tool_failures={"timeout": 1},
        drift_turns=1,
        seconds=2.0,
    )
    second = Episode(
        prompt_ids=[1],
        token_ids=[9, 9],
        from_policy=[True, True],
        turn_rewards=[(1, 0.0)],
        turns=1,
        end_reason="max_turns",
        tool_calls=0,
        tool_failures={"timeout": 2, "bad_call": 1},
        seconds=4.0,
    )
    assert episode_metrics([first, second]) == pytest.approx(
        {
            "agent/turns_mean": 1.5,
            "agent/turns_max": 2.0,
            "agent/tool_calls_mean": 1.0,
            "agent/tool_use_fraction": 0.5,
            "agent/policy_tokens_mean": 2.5,  # (3 + 2) / 2
            "agent/env_tokens_mean": 0.5,  # (1 + 0) / 2
            "agent/template_drift_turns": 1.0,
            "agent/reward_per_turn_mean": 0.5,  # (0.5 + 1.0 + 0.0) / 3
            "agent/episode_seconds_mean": 3.0,
            "agent/end/done": 0.5,
            "agent/end/max_turns": 0.5,
            "agent/end/max_tokens": 0.0,
            "agent/end/timeout": 0.0,
            "agent/end/step_timeout": 0.0,
            "agent/end/env_error": 0.0,
            "agent/tool_failures": 4.0,
            "agent/tool_failures/bad_call": 1.0,
            "agent/tool_failures/timeout": 3.0,
        }
    )


def test_episode_metrics_of_no_episodes_is_empty():
    assert episode_metrics([]) == {}


# ---- raylign.agents.env ---------------------------------------------------------------------


def test_as_messages_accepts_a_string_a_message_and_a_list():
    assert as_messages("hi", "here") == [{"role": "user", "content": "hi"}]
    assert as_messages({"role": "tool", "content": "7"}, "here") == [{"role": "tool", "content": "7"}]
    assert as_messages([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "here") == [
        {"role": "user", "content": "a"},
        {"role": "tool", "content": "b"},
    ]
    assert as_messages(None, "here") == []


@pytest.mark.parametrize(
    ("observation", "message"),
    [
        (42, "here: an observation must be a message dict, a list of them or a string, got int"),
        ([{"content": "x"}], "here: message 0 must be a dict with a 'role' string"),
        ([{"role": "user", "content": "a"}, "b"], "here: message 1 must be a dict with a 'role' string"),
        ([{"role": "user", "content": 3}], "here: message 0's content must be a string"),
    ],
)
def test_as_messages_rejects_bad_shapes_naming_the_place(observation, message):
    with pytest.raises(TypeError) as raised:
        as_messages(observation, "here")
    assert str(raised.value).startswith(message)


def test_as_step_result_checks_the_tuple():
    assert as_step_result(("obs", 1, 0, None), "w") == StepResult([{"role": "user", "content": "obs"}], 1.0, False, {})
    with pytest.raises(TypeError, match="w: step\\(\\) returned reward 'high'; it must be a number"):
        as_step_result(("obs", "high", False, {}), "w")
    with pytest.raises(TypeError, match="w: step\\(\\) returned reward '1.5'; it must be a number .*not str"):
        as_step_result(("obs", "1.5", False, {}), "w")  # a number written as text is not one
    with pytest.raises(TypeError, match="must return \\(observation, reward, done, info\\)"):
        as_step_result(("obs", 1.0, False), "w")
    with pytest.raises(TypeError, match="info of type list"):
        as_step_result(("obs", 1.0, False, []), "w")


@pytest.mark.parametrize(
    ("reward", "expected"), [(np.float32(0.25), 0.25), (np.int64(2), 2.0), (np.bool_(True), 1.0), (True, 1.0)]
)
def test_a_step_may_return_a_numpy_or_bool_reward(reward, expected):
    result = as_step_result(("obs", reward, np.bool_(False), {}), "w")
    assert (result.reward, type(result.reward), result.done) == (expected, float, False)


ENV_FILE = """
class MyEnv:
    def reset(self, prompt, label, metadata):
        return "hello " + prompt

    def step(self, action_text, action_token_ids):
        return None, 1.0, True, {}


class NoStep:
    def reset(self, prompt, label, metadata):
        return "hello"
"""


def test_load_environment_from_a_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(ENV_FILE)
    cls = load_environment(f"{path}:MyEnv")
    assert cls.__name__ == "MyEnv"
    assert cls().reset("you", None, {}) == "hello you"


def test_load_environment_from_a_module():
    assert load_environment("raylign.agents.tools:CalculatorEnv") is CalculatorEnv


def test_load_environment_errors(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(ENV_FILE)
    missing = tmp_path / "absent.py"
    with pytest.raises(FileNotFoundError, match=f"agent.env: {missing} does not exist"):
        load_environment(f"{missing}:MyEnv")
    with pytest.raises(AttributeError, match="has no 'Nope'"):
        load_environment(f"{path}:Nope")
    with pytest.raises(TypeError, match="NoStep has no step method"):
        load_environment(f"{path}:NoStep")
    with pytest.raises(ValueError, match="must be 'path/to/file.py:Name' or 'package.module:Name'"):
        load_environment("raylign.agents.tools.CalculatorEnv")


def test_a_special_token_sampled_just_before_the_end_of_turn_token_is_the_turns_own(tokenizer):
    # A turn that stopped on <|im_end|> right after a sampled <|pad|>: only the end-of-turn token is
    # the template's; the conversation keeps the <|pad|>, so the next render extends the tokens so far.
    pad, im_end = tokenizer.convert_tokens_to_ids(["<|pad|>", "<|im_end|>"])
    turn = tokenizer("ab", add_special_tokens=False).input_ids + [pad, im_end]

    async def generate(ids, sampling, index):
        return Completion(index, 0, list(ids), turn, [-1.0] * len(turn), "stop", "ab")

    ep = play(ScriptedEnv(turns=2), tokenizer, generate)
    assert ep.messages[1] == {"role": "assistant", "content": "ab<|pad|>"}
    assert (ep.end_reason, ep.drift_turns, runs(ep, True)[0][1]) == ("done", 0, turn)
