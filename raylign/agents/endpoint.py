"""An OpenAI-compatible HTTP endpoint in front of the rollout engines, for agentic RL.

An agent written against an ``openai`` client is trained unchanged: point its ``base_url`` at
:attr:`EndpointServer.url` and give each episode a session id. The endpoint renders the chat
with the policy's own template, samples one completion through ``generate`` and records the
exact token ids and log-probs of every turn in an :class:`EpisodeRecorder`, so the trainer never
tokenises text again.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (a list of token ids, or a
string tokenised with the tokenizer's special tokens), ``GET /v1/models``,
``POST /v1/sessions/{session_id}/reward`` (``{"reward": x}``). Unset sampling fields keep
:class:`SamplingConfig`'s defaults (``max_tokens`` 256); role "developer" is rendered as "system".

* Session id: header ``X-Session-Id``, else body field ``session_id`` (``extra_body`` in the
  ``openai`` client), else ``user``. Requests without one are served, not recorded. A turn is
  recorded when its completion is ready, before the answer is sent: a client that gave up
  waiting and retried leaves two turns.
* Extensions: every choice carries ``token_ids`` (the sampled ids), every response
  ``prompt_token_ids`` (``choice.model_extra`` / ``response.model_extra`` in the client);
  ``top_k`` may be sent as a body field.
* One choice per request (``n=1``), no streaming, only the sampled token's log-prob
  (``top_logprobs`` is always empty); fields that would change sampling and that the engines
  do not implement (penalties, ``logit_bias``, ...) are refused with 400 unless left at their
  no-op values. Any ``model`` name is accepted (agents hard-code them). Tool definitions are
  passed to the chat template; tool calls are not parsed out of the text.
* The returned text ends before the stop string or end-of-sequence token that ended it (as
  OpenAI's) and keeps the special tokens the model sampled before; the recorded turn keeps the
  engine's text (:mod:`raylign.agents.response_text`).
* Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 401 without
  the right ``Authorization: Bearer <key>`` (when a key is set), 400 for a bad request (the
  message names the field), 409 for a request or reward on a closed session, 500 when the
  engine fails.
"""

from __future__ import annotations

import hmac
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from raylign.agents.response_text import SpecialTokens, client_text, hidden_tail
from raylign.config.rollout import SamplingConfig
from raylign.rollout.base import Completion
from raylign.sockets import bound_socket, http_url

logger = logging.getLogger(__name__)

GenerateFn = Callable[[list[int], SamplingConfig], Awaitable[Completion]]

ROLES = {"system", "developer", "user", "assistant", "tool"}
# Request fields the engines do not implement, with the values that leave sampling unchanged.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "stream": (None, False),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "top_logprobs": (None, 0),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
}
HINTS = {
    "n": "one choice is sampled per request (n=1); send n requests instead",
    "stream": "streaming is not supported; send stream=false",
    "top_logprobs": "only the sampled token's log-prob is available; send top_logprobs=0",
}


# --- episodes -----------------------------------------------------------------------------------


@dataclass
class Turn:
    """One request of a session: what the policy saw and sampled (see :class:`Completion`)."""

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    token_versions: list[int]
    weight_version: int
    finish_reason: str
    text: str
    # How many of the response's last tokens the text returned to the client leaves out (the end token
    # or the stop string that ended it, :func:`hidden_tail`): the next request may go on from before them.
    hidden_tail: int = 0


@dataclass
class Episode:
    """The turns of one session, in the order they finished, and its reward (None until set)."""

    session_id: str
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None


class SessionClosedError(RuntimeError):
    """A turn or reward for a session that :meth:`EpisodeRecorder.close` already handed over."""


class EpisodeRecorder:
    """The open episodes by session id; safe to use from the server thread and the trainer at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._episodes: dict[str, Episode] = {}
        self._closed: set[str] = set()  # a late request must not start a new episode nobody closes

    def _open(self, session_id: str) -> Episode:
        self._raise_if_closed(session_id)
        return self._episodes.setdefault(session_id, Episode(session_id))

    def _raise_if_closed(self, session_id: str) -> None:
        if session_id in self._closed:
            raise SessionClosedError(f"session {session_id!r} is closed; its episode was already handed over")

    def check_open(self, session_id: str) -> None:
        """Raise :class:`SessionClosedError` when ``session_id`` was closed."""
        with self._lock:
            self._raise_if_closed(session_id)

    def record(self, session_id: str, completion: Completion, hidden_tail: int = 0) -> None:
        """Append ``completion`` as the next turn of ``session_id``; ``hidden_tail``: see :class:`Turn`."""
        turn = Turn(
            prompt_token_ids=list(completion.prompt_token_ids),
            response_token_ids=list(completion.response_token_ids),
            response_logprobs=list(completion.response_logprobs),
            token_versions=list(completion.token_versions or []),
            weight_version=completion.weight_version,
            finish_reason=completion.finish_reason,
            text=completion.text,
            hidden_tail=hidden_tail,
        )
        with self._lock:
            self._open(session_id).turns.append(turn)

    def turns(self, session_id: str) -> list[Turn]:
        """The turns recorded so far for an open session (empty when none)."""
        with self._lock:
            episode = self._episodes.get(session_id)
            return list(episode.turns) if episode else []

    def set_reward(self, session_id: str, reward: float) -> None:
        """Set (or replace) the reward of ``session_id``'s episode."""
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"session {session_id!r}: reward must be a finite number, got {reward}")
        with self._lock:
            self._open(session_id).reward = reward

    def close(self, session_id: str) -> Episode:
        """Hand over ``session_id``'s episode; later turns or rewards for it raise :class:`SessionClosedError`."""
        with self._lock:
            if session_id not in self._episodes:
                state = "was already closed" if session_id in self._closed else "has no turns and no reward"
                raise KeyError(f"session {session_id!r} {state}")
            self._closed.add(session_id)
            return self._episodes.pop(session_id)


# --- requests -----------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}
        return JSONResponse(body, status_code=self.status)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields this endpoint ignores; see NO_OP_VALUES

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    session_id: str | None = None


class ChatRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _sampled_token_only(cls, value: int | None) -> int | None:
        if value not in (None, 0):
            raise ValueError("only the sampled token's log-prob is available; send logprobs=0")
        return value


def _field_name(loc: tuple[Any, ...]) -> str:
    names = {"max_new_tokens": "max_tokens"}  # SamplingConfig's names for the request's
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{names.get(p, p)}" for p in loc).lstrip(".")
    return path or "body"


def _bad_request(err: ValidationError) -> ApiError:
    first = err.errors()[0]
    param = _field_name(tuple(first["loc"]))
    return ApiError(400, f"{param}: {first['msg']}", param)


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """The request as ``model``, or a 400 naming the first wrong field (or an unsupported value)."""
    try:
        request = model.model_validate_json(raw)
    except ValidationError as err:
        raise _bad_request(err) from None
    given = request.model_extra or {}
    for name, no_ops in NO_OP_VALUES.items():
        if name in given and given[name] not in no_ops:
            hint = HINTS.get(name, "not supported by this endpoint; leave it unset")
            raise ApiError(400, f"{name}={given[name]!r}: {hint}", name)
    return request


def sampling_config(request: _SamplingFields, max_tokens: int | None) -> SamplingConfig:
    """The engine's sampling settings for ``request`` (unset fields keep :class:`SamplingConfig`'s defaults)."""
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    values = dict(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        max_new_tokens=max_tokens,
        stop=stop,
        seed=request.seed,
    )
    try:
        return SamplingConfig(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as err:
        raise _bad_request(err) from None


def session_of(http: Request, request: _SamplingFields) -> str | None:
    return http.headers.get("x-session-id") or request.session_id or request.user or None


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: a known role and text content ("developer" is "system")."""
    rendered = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role: {role!r} is not one of {sorted(ROLES)}", f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p.get("text", "") for p in content)
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content: expected a string or text parts", f"messages[{i}].content")
        rendered.append({**message, "role": "system" if role == "developer" else role, "content": content or ""})
    return rendered


def render_chat(tokenizer: Any, request: ChatRequest, previous: Turn | None = None) -> list[int]:
    """The prompt token ids: the policy's chat template with the assistant's turn opened.

    When the session's ``previous`` turn is what the conversation continues (its prompt and sampled
    tokens, decoded, begin the fresh render), the prompt is those very tokens plus the new part of
    the render, tokenised: the sampled tokens are never tokenised again from the text the client
    sent back. Otherwise (the client changed the history, or the template is not append-only) it is
    the fresh render, and the trainer sees that the turns do not continue one another."""
    messages = chat_messages(request.messages)
    try:
        text = tokenizer.apply_chat_template(messages, tools=request.tools, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # jinja2 errors, templates raising on roles or content they do not accept
        raise ApiError(400, f"messages: the chat template failed: {err}", "messages") from None
    if previous is not None:
        so_far = previous.prompt_token_ids + previous.response_token_ids
        decoded = tokenizer.decode(so_far, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if text.startswith(decoded):
            return so_far + list(tokenizer(text[len(decoded) :], add_special_tokens=False)["input_ids"])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def is_request_error(err: BaseException) -> bool:
    """Whether the engine refused the request itself: raylign's prompt checks raise ValueError or
    TypeError, vLLM a ``VLLMClientError`` (e.g. a prompt longer than ``max_model_len``), matched by
    name so that machines without vLLM need not import it."""
    return isinstance(err, (ValueError, TypeError)) or any(c.__name__ == "VLLMClientError" for c in type(err).__mro__)


async def sample(generate: GenerateFn, prompt: list[int], sampling: SamplingConfig, param: str) -> Completion:
    """One completion; the engine's refusal of the prompt (too long, ids outside the vocabulary) is a 400."""
    try:
        return await generate(prompt, sampling)
    except Exception as err:
        cause = getattr(err, "cause", None)  # an error raised in a Ray actor carries the original as .cause
        cause = cause if isinstance(cause, BaseException) else err
        if is_request_error(err):
            raise ApiError(400, f"{param}: {cause}", param) from None
        logger.exception("endpoint: generation failed")
        raise ApiError(500, f"generation failed: {type(cause).__name__}: {cause}", None, "server_error") from None


# --- responses ----------------------------------------------------------------------------------


def usage(completion: Completion) -> dict[str, int]:
    prompt, response = len(completion.prompt_token_ids), len(completion.response_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": response, "total_tokens": prompt + response}


def chat_logprobs(tokenizer: Any, completion: Completion) -> dict[str, Any]:
    """Chat's ``logprobs.content``: one entry per sampled token (``bytes`` of its decoded text)."""
    content = []
    for token_id, logprob in zip(completion.response_token_ids, completion.response_logprobs):
        token = tokenizer.decode([token_id])
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return {"content": content}


def text_logprobs(tokenizer: Any, completion: Completion) -> dict[str, Any]:
    """The legacy completions' ``logprobs``: tokens and their log-probs, no alternatives."""
    tokens = [tokenizer.decode([t]) for t in completion.response_token_ids]
    return {"tokens": tokens, "token_logprobs": completion.response_logprobs, "top_logprobs": None}


def openai_response(kind: str, completion: Completion, choice: dict[str, Any], model: str) -> dict[str, Any]:
    """A response of ``kind`` ("chat.completion" or "text_completion") with one choice and the id extensions."""
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                **choice,
                "finish_reason": completion.finish_reason,
                "token_ids": completion.response_token_ids,
            }
        ],
        "usage": usage(completion),
        "prompt_token_ids": completion.prompt_token_ids,
    }


# --- the app ------------------------------------------------------------------------------------


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float = Field(strict=True, allow_inf_nan=False)  # not "0.5" or true: a client sending those is wrong


def build_app(
    generate: GenerateFn,
    tokenizer: Any,
    recorder: EpisodeRecorder,
    api_key: str | None = None,
    model_name: str = "policy",
) -> FastAPI:
    """The endpoint's FastAPI app: ``generate`` samples one completion of a prompt's token ids."""

    def require_key(http: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = http.headers.get("authorization", "").partition(" ")
        # Constant-time comparison: response timing must not reveal how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(
                401, "missing or wrong API key (send 'Authorization: Bearer <key>')", None, "invalid_api_key"
            )

    special = SpecialTokens.of(tokenizer)
    app = FastAPI(title="raylign policy endpoint", dependencies=[Depends(require_key)])
    app.add_exception_handler(ApiError, lambda _, err: err.response())

    async def sample_and_record(
        http: Request, request: _SamplingFields, prompt: list[int], max_tokens: int | None, param: str
    ) -> tuple[Completion, str]:
        """One completion of ``prompt``, recorded when the request names a session; and its text for the client."""
        sampling = sampling_config(request, max_tokens)
        session_id = session_of(http, request)
        try:
            if session_id is not None:
                recorder.check_open(session_id)
            completion = await sample(generate, prompt, sampling, param)
            if session_id is not None:
                recorder.record(session_id, completion, hidden_tail(tokenizer, special, completion, sampling.stop))
        except SessionClosedError as err:
            raise ApiError(409, str(err), "session_id") from None
        return completion, client_text(tokenizer, special, completion, sampling.stop)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Any:
        request = parse_body(ChatRequest, await http.body())
        max_tokens = request.max_completion_tokens or request.max_tokens
        session_id = session_of(http, request)
        previous = recorder.turns(session_id)[-1:] if session_id is not None else []
        prompt = render_chat(tokenizer, request, previous[0] if previous else None)
        completion, text = await sample_and_record(http, request, prompt, max_tokens, "messages")
        logprobs = chat_logprobs(tokenizer, completion) if request.logprobs else None
        choice = {"message": {"role": "assistant", "content": text}, "logprobs": logprobs}
        return openai_response("chat.completion", completion, choice, model_name)

    @app.post("/v1/completions")
    async def completions(http: Request) -> Any:
        request = parse_body(CompletionRequest, await http.body())
        text_prompt = isinstance(request.prompt, str)
        prompt = list(tokenizer(request.prompt)["input_ids"]) if text_prompt else request.prompt
        completion, text = await sample_and_record(http, request, prompt, request.max_tokens, "prompt")
        logprobs = text_logprobs(tokenizer, completion) if request.logprobs is not None else None
        return openai_response("text_completion", completion, {"text": text, "logprobs": logprobs}, model_name)

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "raylign"}]}

    @app.post("/v1/sessions/{session_id}/reward")
    async def reward(session_id: str, http: Request) -> Any:
        request = parse_body(RewardRequest, await http.body())
        try:
            recorder.set_reward(session_id, request.reward)
        except SessionClosedError as err:
            raise ApiError(409, str(err), "session_id") from None
        return {"session_id": session_id, "reward": request.reward}

    return app


# --- the server ---------------------------------------------------------------------------------


class EndpointServer:
    """Serves ``app`` with uvicorn in a background thread; loopback and a free port by default."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    @property
    def url(self) -> str:
        """The OpenAI base URL, e.g. ``http://127.0.0.1:PORT/v1`` (the real port once started)."""
        return http_url(self.host, self.port, "/v1")

    def start(self, timeout_s: float = 30.0) -> EndpointServer:
        """Bind, serve, and return once the server accepts connections (at most ``timeout_s`` seconds)."""
        import uvicorn

        if self._thread is not None:
            raise RuntimeError(f"the endpoint server at {self.url} is already started")
        self._socket = bound_socket(self.host, self.port)
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=None)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True, name="raylign-endpoint"
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                self._release()
                raise RuntimeError(f"the endpoint server at {self.url} exited while starting (see the log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"the endpoint server at {self.url} did not accept connections within timeout_s={timeout_s} s"
                )
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving: requests in flight get until ``timeout_s`` to finish, then are cut."""
        if self._thread is None:
            return
        self._server.config.timeout_graceful_shutdown = max(timeout_s - 1.0, 0.1)  # read when shutdown begins
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(2.0)
        alive = self._thread.is_alive()
        self._release()
        if alive:
            raise TimeoutError(f"the endpoint server at {self.url} did not stop within timeout_s={timeout_s} s")

    def _release(self) -> None:
        if self._socket is not None:
            self._socket.close()
        self._thread = self._server = self._socket = None

    def __enter__(self) -> EndpointServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
