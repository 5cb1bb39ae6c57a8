"""One HTTP request's generation: submit to the engine client, turn outputs into text, stream or collect.

Owns: the per-request state (detokenizer, token times, finish reason), aborting on disconnect or a stop
string, and releasing the request exactly once. Ignores: routing and request parsing (app.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from lab.request import Request
from lab.serve import protocol
from lab.serve.detokenizer import IncrementalDetokenizer
from lab.serve.engine_loop import EngineClient, RequestOutput
from lab.serve.protocol import APIError, Endpoint


async def wait_for_disconnect(http_request: HTTPRequest) -> None:
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, separators=(',', ':'))}\n\n"


@dataclass
class Session:
    kind: Endpoint
    model: str
    request: Request
    client: EngineClient
    detokenizer: IncrementalDetokenizer
    include_usage: bool
    on_close: Callable[["Session"], None]           # metrics and the outstanding count; called once
    sink: "asyncio.Queue[RequestOutput]" = field(default_factory=asyncio.Queue)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    is_invalid: bool = False            # the engine refused the request: raise_if_failed gives a 400
    is_closed: bool = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    def submit(self) -> None:
        self.client.add_request(self.request, self.sink)

    def close(self) -> None:
        """Abort the engine request if it is still running (a gone client, a stop string) and release it."""
        if self.is_closed:
            return
        self.is_closed = True
        if self.finish_reason is None or self.finish_reason == "stop_string":
            self.client.abort_request(self.request.request_id)
        if self.finish_reason is None:
            self.finish_reason = "abort"
        elif self.finish_reason == "stop_string":
            self.finish_reason = "stop"
        self.on_close(self)

    def consume(self, output: RequestOutput) -> str:
        """Take one output: returns the new text; sets finish_reason once the request (or its text) ended."""
        now = time.perf_counter()
        if output.new_token_ids and not self.detokenizer.is_stopped:
            self.token_times.extend([now] * len(output.new_token_ids))
        text = self.detokenizer.add(output.new_token_ids, is_final=output.is_finished)
        if output.is_finished:
            self.finish_reason, self.error, self.is_invalid = output.finish_reason, output.error, output.is_invalid
            if self.detokenizer.is_stopped and self.finish_reason == "length":
                self.finish_reason = "stop"   # NOTE: vLLM's: the stop string matched in the step that hit max_tokens
        elif self.detokenizer.is_stopped:
            self.finish_reason = "stop_string"  # NOTE: the engine still runs it; close() aborts it
        return text

    async def next_output(self, disconnect: "asyncio.Task[None] | None") -> RequestOutput | None:
        """The next output, or None when the client went away first."""
        if disconnect is None:
            return await self.sink.get()
        get = asyncio.ensure_future(self.sink.get())
        done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        return None

    def raise_if_failed(self) -> None:
        if self.finish_reason == "error" and self.is_invalid:
            raise APIError(400, self.error or "invalid request", code="invalid_request")
        if self.finish_reason == "error":
            raise APIError(500, f"generation failed: {self.error}", type="server_error", code="engine_error")

    def public_finish_reason(self) -> str | None:
        return "stop" if self.finish_reason == "stop_string" else self.finish_reason


async def collect(session: Session, http_request: HTTPRequest) -> dict[str, Any] | None:
    """Non-streaming: wait for the end and build the whole response (None: the client left first)."""
    disconnect = asyncio.ensure_future(wait_for_disconnect(http_request))
    try:
        while session.finish_reason is None:
            output = await session.next_output(disconnect)
            if output is None:
                return None
            session.consume(output)
        session.raise_if_failed()
        text = session.detokenizer.text
        return protocol.completion_body(session.kind, session.request.request_id, session.model, text,
                                        session.public_finish_reason(), session.request.num_prompt_tokens,
                                        session.num_output_tokens)
    finally:
        disconnect.cancel()
        session.close()


async def first_output(session: Session, http_request: HTTPRequest) -> RequestOutput | None:
    """Streaming: wait for the first output before sending headers, so an engine failure is still a 5xx
    (None: the client left first)."""
    disconnect = asyncio.ensure_future(wait_for_disconnect(http_request))
    try:
        output = await session.next_output(disconnect)
    finally:
        disconnect.cancel()
    if output is None:
        session.close()
        return None
    if output.finish_reason == "error":
        session.consume(output)
        session.close()
        session.raise_if_failed()
    return output


async def stream_events(session: Session, first: RequestOutput) -> AsyncIterator[str]:
    """SSE: a chunk per output with text (chat's first also carries the role), the finish, usage, [DONE]."""
    rid, model, kind = session.request.request_id, session.model, session.kind
    output: RequestOutput | None = first
    is_first = True
    while output is not None:
        text = session.consume(output)
        finish = session.public_finish_reason()
        if session.finish_reason == "error":
            yield sse({"error": APIError(500, f"generation failed: {session.error}", "server_error").body()["error"]})
            break
        if text or finish is not None or (is_first and kind == "chat"):
            yield sse(protocol.chunk_body(kind, rid, model, text if text or kind == "completion" else "",
                                          finish, role=is_first and kind == "chat"))
            is_first = False
        output = None if finish is not None else await session.sink.get()
    if session.include_usage:
        yield sse(protocol.usage_chunk(kind, rid, model, session.request.num_prompt_tokens,
                                       session.num_output_tokens))
    yield sse("[DONE]")


class SessionStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its session however the stream ends (done, disconnect, or never
    started because the client left before the first byte)."""

    def __init__(self, session: Session, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.session = session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.session.close()
