"""Running one chat-completion request: a slot (:class:`~specem_integrations.server._admission.Admission`),
the engine's stream, the answer as JSON or SSE, and its end counted and logged once, however it
ended (completed, cancelled by the client or the shutdown, timed out, failed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specem_core.engine import SpecEM
from specem_core.errors import AllMembersFailedError, ConfigError, ContextWindowError, InputError, SpecEMError
from specem_core.types import GenerationResult, StreamEvent
from specem_integrations.server._admission import Admission, QueueFullError, Stats
from specem_integrations.server._errors import (
    APIError,
    internal_error,
    invalid_request,
    queue_full,
    shutting_down,
    timed_out,
)
from specem_integrations.server._lifecycle import Lifecycle
from specem_integrations.server._metrics import ServerMetrics
from specem_integrations.server._protocol import ChunkWriter, EngineCall, completion_body, error_event, sse
from specem_integrations.server._request_ids import REQUEST_ID_HEADER, current_request_id, new_request_id
from specem_integrations.server._stream import (
    ClientGoneError,
    DisconnectWatch,
    EventStream,
    Job,
    Outcome,
    ShuttingDownError,
    TimedOutError,
    guarded,
)

logger = logging.getLogger("specem.server")


async def read_json(request: Request, max_bytes: int) -> object:
    """The body as JSON (400 when it does not parse, 413 when it is larger than ``max_bytes``)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise invalid_request("the request body is empty: send a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise invalid_request(
            f"We could not parse the JSON body of your request ({type(exc).__name__}: {exc}).",
            code="invalid_json",
        ) from None


class RequestRunner:
    """Runs the admitted requests of one app on its engine.

    Args:
        engine: the served engine.
        admission: the slots and the queue.
        stats: the ``/health`` counters.
        metrics: the Prometheus metrics.
        lifecycle: the shutdown (its ``stopping`` ends the answers still in flight).
        model_name: the served model id (in every answer).
        request_timeout: seconds from arrival (``None``: no limit).
    """

    def __init__(
        self,
        engine: SpecEM,
        admission: Admission,
        stats: Stats,
        metrics: ServerMetrics,
        lifecycle: Lifecycle,
        model_name: str,
        request_timeout: float | None,
    ) -> None:
        self.engine = engine
        self.admission = admission
        self.stats = stats
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.model_name = model_name
        self.request_timeout = request_timeout

    def count(self, outcome: Outcome | Literal["rejected"]) -> None:
        """A request ended: the ``/health`` counter and the ``specem_requests_total`` series."""
        self.stats.add(outcome)
        self.metrics.count(outcome)

    async def run(self, request: Request, call: EngineCall) -> Response:
        """Queue, run and answer a parsed chat-completion request (JSON, or SSE for ``stream``)."""
        loop = asyncio.get_running_loop()
        self.lifecycle.serving_on(loop)
        now = loop.time()
        request_id = current_request_id.get() or new_request_id()
        # the answer's id: the request id's when the server made that one, else a fresh one (a
        # client's X-Request-ID may repeat; completion ids should not)
        generated = request.headers.get(REQUEST_ID_HEADER, "").strip() != request_id
        job = Job(
            call=call,
            request_id=request_id,
            completion_id=f"chatcmpl-{request_id if generated else new_request_id()}",
            created=int(time.time()),
            arrived=now,
            deadline=None if self.request_timeout is None else now + self.request_timeout,
        )
        watch = DisconnectWatch(request.receive)
        watch.start()
        handed_over = False
        try:
            try:
                await guarded(self.admit(job), watch, job.deadline)
            except QueueFullError as exc:
                self.count("rejected")
                job.finished = True
                raise queue_full(exc.retry_after) from None
            agen = self.start(job)
            if call.stream:
                first = await guarded(anext(agen), watch, job.deadline)
                self.first_segment(job)
                seconds = self.request_timeout or 0.0

                async def finish(outcome: Outcome | None) -> None:
                    await self.finish(job, outcome)
                    await watch.stop()

                response = EventStream(
                    self.sse_body(job, first),
                    watch,
                    job.deadline,
                    on_timeout=lambda: self.stream_error(job, timed_out(seconds)),
                    finish=finish,
                    headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
                    stop=self.lifecycle.stopping,
                    on_stop=lambda: self.stream_error(job, shutting_down()),
                )
                handed_over = True
                return response
            result = await guarded(self.collect(job, agen), watch, job.deadline, self.lifecycle.stopping)
            job.outcome = "completed"
            body_out = completion_body(
                result, request_id=job.completion_id, created=job.created, model=self.model_name, trace=call.trace
            )
            return JSONResponse(body_out)
        except ClientGoneError:
            job.outcome = "cancelled"
            return Response(status_code=499)  # nobody is listening any more
        except TimedOutError:
            job.outcome = "timed_out"
            raise timed_out(self.request_timeout or 0.0) from None
        except ShuttingDownError:
            job.outcome = "cancelled"
            raise shutting_down() from None
        except APIError:
            raise
        except Exception as exc:
            job.outcome = "failed"
            error = self.engine_error(exc, job.request_id)
            if error.status < 500:
                job.outcome = "invalid"  # the caller's input (e.g. context_length_exceeded)
            raise error from None
        finally:
            if not handed_over:
                await self.finish(job)
                await watch.stop()

    def engine_error(self, exc: BaseException, request_id: str) -> APIError:
        """An engine exception as an API error (4xx for the caller's input, 5xx otherwise)."""
        if isinstance(exc, ContextWindowError):
            return APIError(400, str(exc), param="messages", code="context_length_exceeded")
        if isinstance(exc, InputError | ConfigError):
            return invalid_request(str(exc))
        if isinstance(exc, AllMembersFailedError):  # one line naming each member, stage and error
            self.metrics.excluded(exc.excluded)
            logger.warning("request %s: %s", request_id, exc)
            return APIError(500, str(exc), type="server_error", code="all_members_failed")
        if isinstance(exc, SpecEMError):
            logger.warning("request %s: %s", request_id, exc)
            return APIError(500, str(exc), type="server_error", code="engine_error")
        logger.error("request %s failed", request_id, exc_info=(type(exc), exc, exc.__traceback__))
        return internal_error(f"The server had an error while processing your request (request id {request_id}).")

    async def admit(self, job: Job) -> None:
        """Wait for a slot (raises :class:`QueueFullError`)."""
        await self.admission.acquire()
        job.admitted_at = asyncio.get_running_loop().time()
        self.stats.add("started")
        self.metrics.queued(job.admitted_at - job.arrived)

    def first_segment(self, job: Job) -> None:
        """The request's first segment is here (counted once)."""
        if job.first_segment_at is None:
            job.first_segment_at = asyncio.get_running_loop().time()
            self.metrics.first_segment(job.first_segment_at - job.arrived)

    def stream_error(self, job: Job, error: APIError) -> bytes:
        """An error event for a stream that has started, with the request id, counted by its code."""
        error.request_id = job.request_id
        self.metrics.error(error.code)
        return error_event(error)

    def start(self, job: Job) -> AsyncIterator[StreamEvent]:
        """Start the engine on an admitted job."""
        call = job.call
        job.agen = self.engine.astream(call.messages, **call.kwargs, **call.overrides)
        return job.agen

    async def finish(self, job: Job, outcome: Outcome | None = None) -> None:
        """Close the engine stream (the worker stops after its round), free the slot, count (once)."""
        if job.finished:
            return
        job.finished = True
        if outcome is not None:
            job.outcome = outcome
        closer = getattr(job.agen, "aclose", None)
        if closer is not None:
            with contextlib.suppress(BaseException):
                await closer()
        now = asyncio.get_running_loop().time()
        if job.admitted_at is not None:
            self.admission.release(now - job.admitted_at)
        self.count(job.outcome)
        if job.outcome == "completed" and job.result is not None:
            self.metrics.completed(job.result, now - job.arrived)
        self.log_finished(job, now)

    def log_finished(self, job: Job, now: float) -> None:
        """One line per request that reached the queue: how it ended, its timings and tokens
        (as fields in JSON logs)."""
        result = job.result if job.outcome == "completed" else None
        fields: dict[str, Any] = {
            "outcome": job.outcome,
            "completion_id": job.completion_id,
            "stream": job.call.stream,
            "seconds": round(now - job.arrived, 3),
            "queue_seconds": None if job.admitted_at is None else round(job.admitted_at - job.arrived, 3),
            "first_segment_seconds": (
                None if job.first_segment_at is None else round(job.first_segment_at - job.arrived, 3)
            ),
        }
        if result is not None:
            fields.update(
                finish_reason=result.finish_reason,
                prompt_tokens=result.usage.prompt_tokens,
                completion_tokens=result.usage.completion_tokens,
                cached_tokens=result.usage.cached_tokens,
                rounds=len(result.segments),
                wins=result.wins,
                excluded=[f"{e.member}:{e.stage}" for e in result.excluded],
            )
        rounds = len(result.segments) if result else 0
        tokens = f", {result.usage.completion_tokens} tokens in {rounds} round{'s' * (rounds != 1)}" if result else ""
        logger.info(
            "chat completion %s after %.2fs (%s%s)",
            job.outcome,
            now - job.arrived,
            "stream" if job.call.stream else "json",
            tokens,
            extra=fields,
        )

    async def collect(self, job: Job, agen: AsyncIterator[StreamEvent]) -> GenerationResult:
        """Run a request to its end."""
        async for event in agen:
            self.first_segment(job)
            if event.done and event.result is not None:
                job.result = event.result
                return event.result
        raise SpecEMError("the engine ended without a result")

    async def sse_body(self, job: Job, first: StreamEvent) -> AsyncIterator[bytes]:
        """The SSE events of one streamed answer: role, one chunk per segment, calls, end, usage."""
        assert job.agen is not None
        call = job.call
        writer = ChunkWriter(job.completion_id, job.created, self.model_name, call.include_usage)
        yield sse(writer.chunk({"role": "assistant", "content": ""}))
        event = first
        while True:
            extra = {"specem": event.segment.to_dict()} if call.trace and event.segment is not None else None
            if event.delta:
                yield sse(writer.chunk({"content": event.delta}, extra=extra))
            if event.done:
                result = event.result
                if result is None:
                    job.outcome = "failed"
                    yield self.stream_error(job, internal_error("the engine ended without a result"))
                    return
                job.result = result
                for chunk in writer.tool_call_chunks(result):
                    yield sse(chunk)
                final_extra = {"specem": result.trace()} if call.trace else None
                yield sse(writer.chunk({}, result.finish_reason, extra=final_extra))
                if call.include_usage:
                    yield sse(writer.usage_chunk(result))
                yield sse("[DONE]")
                job.outcome = "completed"
                return
            try:
                event = await anext(job.agen)
            except StopAsyncIteration:
                job.outcome = "failed"
                yield self.stream_error(job, internal_error("the engine ended without a result"))
                return
            except Exception as exc:
                job.outcome = "failed"
                yield self.stream_error(job, self.engine_error(exc, job.request_id))
                return
