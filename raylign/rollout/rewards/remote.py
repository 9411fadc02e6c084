"""Rewards from a remote scorer over HTTP (for example ``raylign serve-rm`` on another machine).

Protocol: ``POST <url>`` with JSON ``{"prompts": [...], "responses": [...], "labels": [...]}``
(plus ``"metadata": [...]`` when some sample has metadata); the answer is ``{"rewards": [...]}``
with one number per sample, and optionally ``"metrics": {name: [...]}``. With an API key the
request carries ``Authorization: Bearer <key>``.

``timeout_s`` bounds each request in all (connecting, sending, reading the whole answer), so a
server that sends a byte now and then is cut off at ``timeout_s`` too.

Failures that a later attempt may not meet are retried ``max_retries`` times with exponential
backoff: timeouts, connection errors, malformed JSON, a wrong number of rewards, and the answers
408, 429, 500, 502, 503 and 504. 500 is among them because uvicorn answers it for the requests a
shutdown cuts, and a service that calls others answers it for their passing failures;
``raylign serve-rm`` answers 422, not 500, for a batch its scorer cannot score. Any other error
answer (400, 401, 403, 404, 413, 422, 501, ...) would come again on a retry and stops at once.
The RewardError names the endpoint, the batch (its size and first prompt) and the last cause,
quoting the server's message (the ``detail`` of a FastAPI error answer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import weakref
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from raylign.rollout.rewards.base import (
    KEEP_NON_FINITE_HEADER,
    RewardError,
    RewardResult,
    RewardSource,
    concatenate_results,
    describe_batch,
    short_repr,
)

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("raylign")


class _Retryable(Exception):
    """A failure worth another attempt."""


class _Permanent(Exception):
    """A failure that another attempt would repeat."""


def backoff_delay(retry: int, backoff_s: float) -> float:
    """Seconds to wait before retry ``retry`` (1, 2, ...): ``backoff_s * 2**(retry - 1)``."""
    return backoff_s * 2 ** (retry - 1)


T = TypeVar("T")

# A request timeout, rate limiting, and faults of the server or of a proxy in front of it: answers
# that a later attempt may not get.
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Seconds closing the connections (and the thread that serves them) may take.
CLOSE_TIMEOUT_S = 10.0


def _answer_text(response: Any, limit: int = 200) -> str:
    text = response.text.strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def server_message(response: Any, limit: int = 1000) -> str:
    """What an error answer says: its ``detail`` text when it is FastAPI's ``{"detail": "..."}``
    (serve-rm's messages name the sample and the cause), else the start of the body."""
    try:
        body = response.json()
    except (ValueError, RecursionError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        text = body["detail"].strip()
        return text if len(text) <= limit else text[:limit] + "..."
    return _answer_text(response, limit)


def _classify_status(response: Any) -> None:
    """Raise _Retryable / _Permanent for an error status; return for 2xx."""
    status = response.status_code
    if 200 <= status < 300:
        return
    message = server_message(response)
    if status == 401:
        raise _Permanent(f"the server refused the API key (401 Unauthorized: {message}); check api_key")
    if status == 403:
        raise _Permanent(f"the server refused access (403 Forbidden: {message})")
    if status == 413:
        raise _Permanent(f"the request is larger than the server accepts (413: {message}); lower batch_size")
    if status in RETRIED_STATUSES:
        raise _Retryable(f"the server answered {status}: {message}")
    raise _Permanent(f"the server answered {status}, which a retry would repeat: {message}")


def parse_answer(response: Any, expected: int, finite: bool = True) -> RewardResult:
    """Rewards (and metrics) from a 2xx answer; _Retryable if it is not the promised JSON (with
    ``finite``, numbers that are NaN or infinite are not)."""
    try:
        body = response.json()
    except (ValueError, RecursionError):  # ValueError covers JSON and Unicode decoding errors
        raise _Retryable(f"the answer is not valid JSON: {_answer_text(response)!r}") from None
    if not isinstance(body, dict) or "rewards" not in body:
        raise _Retryable(f"the answer has no 'rewards' field: {_answer_text(response)!r}")
    rewards = _numbers(body["rewards"], expected, "rewards", finite)
    metrics = body.get("metrics")
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, dict):
        raise _Retryable(f"'metrics' in the answer is a {type(metrics).__name__}, not an object")
    return RewardResult(rewards, {str(k): _numbers(v, expected, f"metric '{k}'", finite) for k, v in metrics.items()})


def _numbers(values: Any, expected: int, what: str, finite: bool = True) -> list[float]:
    if not isinstance(values, list):
        raise _Retryable(f"'{what}' in the answer is a {type(values).__name__}, not a list")
    if len(values) != expected:
        raise _Retryable(f"the answer has {len(values)} {what} for {expected} samples")
    bad = [i for i, v in enumerate(values) if not (_is_finite_number(v) if finite else _is_number(v))]
    if bad:
        raise _Retryable(
            f"{what} value {short_repr(values[bad[0]])} (position {bad[0]}) in the answer is not a "
            + ("finite number" if finite else "number")
        )
    return [_as_float(v) for v in values]


def _as_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range
        return math.inf if value > 0 else -math.inf


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond the float range
        return False


def _plain_value(value: Any) -> Any:
    """numpy / torch scalars and arrays as plain JSON values; anything else cannot be sent."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class _EventLoopThread:
    """An asyncio event loop in a daemon thread, running coroutines for callers in any thread.

    Requests run there under ``asyncio.timeout``: httpx's own timeouts bound each network
    operation, not a request in all (a byte every few seconds keeps every read within them).
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="http-reward-source", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """The coroutine's result within ``timeout_s`` (TimeoutError after it); a caller interrupted
        (Ctrl+C) or out of time cancels it."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout=timeout_s)
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> None:
        """Stop the loop, which then closes; callable once, from any thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)


class HttpRewardSource(RewardSource):
    """Rewards from ``POST url``; batches of ``batch_size`` samples, each retried as described above."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        batch_size: int = 64,
    ):
        import httpx

        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0 or batch_size < 1:
            raise ValueError("need max_retries >= 0, timeout_s > 0, backoff_s >= 0 and batch_size >= 1")
        self.url, self.max_retries, self.backoff_s, self.batch_size = url, max_retries, backoff_s, batch_size
        self.description = f"HTTP reward source {url}"
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # httpx bounds each network operation by timeout_s; _post bounds the whole request by it.
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), headers=headers)
        self._background = _EventLoopThread()
        # A source dropped without close() must not leave its thread behind.
        self._stop_background = weakref.finalize(self, self._background.stop)

    def close(self) -> None:
        if self._stop_background.alive:
            try:
                self._background.run(self._client.aclose(), CLOSE_TIMEOUT_S)
            except TimeoutError:  # connections left open close with the process
                log.warning("remote reward: its HTTP connections did not close within %g s", CLOSE_TIMEOUT_S)
            self._stop_background()
            self._background.thread.join(timeout=CLOSE_TIMEOUT_S)
            if self._background.thread.is_alive():
                log.warning("remote reward: its event loop did not stop within %g s", CLOSE_TIMEOUT_S)

    def _score(self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict]) -> RewardResult:
        parts = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            body = self._request_body(
                prompts[start:end], responses[start:end], labels[start:end], metadata[start:end], start
            )
            parts.append(self._post_with_retries(body, prompts[start:end], start))
        return concatenate_results(parts, self.description)

    def _request_body(
        self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict], offset: int
    ) -> bytes:
        body: dict[str, Any] = {"prompts": prompts, "responses": responses, "labels": labels}
        if any(metadata):  # left out when empty, so servers that know only the three lists accept it
            body["metadata"] = metadata
        try:
            return json.dumps(body, allow_nan=False, default=_plain_value).encode()
        except (TypeError, ValueError) as err:
            raise RewardError(
                f"{self.description}: labels or metadata of {describe_batch(prompts, offset)} "
                f"cannot be sent as JSON: {err}"
            ) from None

    async def _post(self, body: bytes) -> httpx.Response:
        async with asyncio.timeout(self.timeout_s):
            headers = {"Content-Type": "application/json"}
            if self.keep_non_finite:  # reward.non_finite: drop; servers that do not know the header ignore it
                headers[KEEP_NON_FINITE_HEADER] = "1"
            return await self._client.post(self.url, content=body, headers=headers)

    def _post_once(self, body: bytes, expected: int) -> RewardResult:
        import httpx

        try:
            # _post ends itself at timeout_s; the margin lets its cancellation finish first.
            response = self._background.run(self._post(body), self.timeout_s + CLOSE_TIMEOUT_S)
        except (TimeoutError, httpx.TimeoutException):
            raise _Retryable(f"no complete answer within timeout_s={self.timeout_s:g} s") from None
        except httpx.TransportError as err:
            raise _Retryable(f"connection failed: {type(err).__name__}: {err}") from None
        _classify_status(response)
        return parse_answer(response, expected, not self.keep_non_finite)

    def _post_with_retries(self, body: bytes, prompts: list[str], offset: int) -> RewardResult:
        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return self._post_once(body, len(prompts))
            except _Permanent as err:
                raise RewardError(f"{self.description} failed on {describe_batch(prompts, offset)}: {err}") from None
            except _Retryable as err:
                last = err
            if attempt < attempts:
                time.sleep(backoff_delay(attempt, self.backoff_s))
        raise RewardError(
            f"{self.description} failed on {describe_batch(prompts, offset)} after {attempts} attempts; "
            f"last cause: {last}"
        )
