"""The HTTP reward server behind ``raylign serve-rm``: any reward source behind ``POST /score``.

Request ``{"prompts": [...], "responses": [...], "labels": [...], "metadata": [...]}`` (labels and
metadata optional), answer ``{"rewards": [...], "metrics": {...}}``. Status codes: 401 without
the right ``Authorization: Bearer <key>`` (when a key is set), 413 for a body over
``max_request_bytes``, 422 for a malformed request or a batch the scorer cannot score (it raised
ValueError or RewardError, whose message, in ``detail``, names the sample and the cause: the same
request would fail again), 500 for any other exception of the scorer, a fault of the server (its
type and message in ``detail``). ``GET /health`` answers ``{"status": "ok"}``. A request with the
header ``X-Raylign-Keep-Non-Finite: 1`` (raylign's HTTP source under ``reward.non_finite: drop``)
gets NaN and infinite rewards as they are, written as JSON's ``NaN`` / ``Infinity`` extensions, where
other requests get a 422.

Scoring calls run one at a time. When a shutdown runs past its grace period, the server cuts the
requests still in flight (their clients get a 500 and may retry); those still waiting for their
turn are then skipped instead of scored for nobody.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from raylign.rollout.rewards.base import KEEP_NON_FINITE_HEADER, RewardError, RewardResult, RewardSource

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
# After a body passes the limit the rest is still read (and dropped), so the client gets the
# 413 answer rather than a reset connection, unless it keeps sending past this many bytes.
DRAIN_LIMIT_BYTES = 256 * 2**20


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[str]
    responses: list[str]
    labels: list[Any] | None = None
    metadata: list[dict[str, Any]] | None = None


def _authorized(request: Request, api_key: str) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    # Constant-time comparison: response timing must not reveal how much of a guess was right.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


async def read_body_limited(request: Request, max_bytes: int) -> bytes:
    """The request body, or HTTPException 413 once it exceeds ``max_bytes`` (never held in full then)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= max_bytes:
            chunks.append(chunk)
        elif size > DRAIN_LIMIT_BYTES:
            break
    if size > max_bytes:
        raise HTTPException(413, f"request body over the limit of {max_bytes} bytes; send fewer samples per request")
    return b"".join(chunks)


def parse_request(body: bytes) -> ScoreRequest:
    """The request, or HTTPException 422 saying which field is wrong."""
    try:
        return ScoreRequest.model_validate_json(body)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in err.errors()[:5])
        raise HTTPException(422, f"malformed request: {problems}") from None


class SerialScoring:
    """Calls into ``scorer`` one at a time: a model on one device gains nothing from overlapping calls."""

    def __init__(self, scorer: RewardSource):
        self.scorer = scorer
        self.lock = threading.Lock()
        self.requests_cut = 0  # requests whose answer was cancelled (a shutdown past its grace period)

    def score(self, request: ScoreRequest, cut: threading.Event, keep_non_finite: bool = False) -> RewardResult | None:
        """The scorer's result (NaN and infinite values in it with ``keep_non_finite``, else refused),
        or None when the request was cut before its turn came."""
        with self.lock:
            if cut.is_set():
                return None
            self.scorer.keep_non_finite = keep_non_finite
            return self.scorer.score(request.prompts, request.responses, request.labels, request.metadata)

    def close_scorer(self) -> None:
        """Close the scorer once the call in progress, if any, has ended.

        Closed under a running call, a reward file's worker pool would restart to score that batch again.
        """
        with self.lock:
            self.scorer.close()


async def score_in_turn(scoring: SerialScoring, request: ScoreRequest, keep_non_finite: bool = False) -> RewardResult:
    """``scoring.score`` in a worker thread; when this request is cut, a call still waiting is skipped."""
    cut = threading.Event()
    try:
        # The thread is abandoned on cancellation: the cut client's answer must not wait for the scorer.
        return await anyio.to_thread.run_sync(scoring.score, request, cut, keep_non_finite, abandon_on_cancel=True)
    except asyncio.CancelledError:
        cut.set()
        scoring.requests_cut += 1
        raise


def create_app(
    scorer: RewardSource, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> FastAPI:
    """A FastAPI app serving ``scorer`` on ``POST /score``; ``app.state.scoring`` is its :class:`SerialScoring`."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    app = FastAPI(title="raylign reward server")
    scoring = SerialScoring(scorer)
    app.state.scoring = scoring

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/score")
    async def score(request: Request) -> Any:
        if api_key is not None and not _authorized(request, api_key):
            return JSONResponse(
                {"detail": "missing or wrong API key (send 'Authorization: Bearer <key>')"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        parsed = parse_request(await read_body_limited(request, max_request_bytes))
        keep_non_finite = request.headers.get(KEEP_NON_FINITE_HEADER) == "1"
        try:
            result = await score_in_turn(scoring, parsed, keep_non_finite)
        # ValueError: the batch is inconsistent (lengths, types) or a sample cannot be encoded;
        # RewardError: the scorer cannot score a sample (a non-finite score, a reward function that raises).
        except (ValueError, RewardError) as err:
            raise HTTPException(422, str(err)) from None
        except Exception as err:
            raise HTTPException(500, f"{type(err).__name__}: {err}") from None
        answer = {"rewards": result.rewards, "metrics": result.metrics}
        if keep_non_finite:  # JSONResponse refuses NaN; json.dumps writes it as NaN / Infinity
            return Response(json.dumps(answer), media_type="application/json")
        return answer

    return app
