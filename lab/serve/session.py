"""One HTTP request's generation: submit to the engine client, turn outputs into text, stream or collect.

A request with several choices (`n`, a batch of prompts) is a group of sessions, one engine request each, as
vLLM's parallel sampling fans a request out into child requests: collected together, or streamed as their
chunks come, each chunk naming its choice's index.

Owns: the per-choice state (detokenizer, token times, finish reason), aborting on disconnect or a stop
string, and releasing each engine request exactly once. Ignores: routing and request parsing (app.py).
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
from lab.sample.logprobs import TokenLogprobs
from lab.serve import protocol, tools
from lab.serve.detokenizer import IncrementalDetokenizer
from lab.serve.engine_loop import EngineClient, RequestOutput
from lab.serve.protocol import APIError, Endpoint
from lab.serve.tools import ToolChoice


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
    response_id: str                    # the HTTP response's id (one per group; request_id is the engine's)
    index: int                          # the choice this session fills
    prompt_index: int                   # which of the request's prompts it answers
    client: EngineClient
    detokenizer: IncrementalDetokenizer
    include_usage: bool
    on_close: Callable[["Session"], None]           # metrics and the outstanding count; called once
    echo_text: str | None = None        # completions' echo: the prompt, sent before the generated text
    show_prompt_logprobs: bool = False  # the request set prompt_logprobs: vLLM's `prompt_logprobs` field
    tool_choice: ToolChoice | None = None   # chat's forced function call: the text is its arguments (or calls)
    tool_calls: list[dict[str, Any]] | None = None   # the text as OpenAI's tool_calls, once it ended as one
    continuous_usage: bool = False      # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    sink: "asyncio.Queue[RequestOutput]" = field(default_factory=asyncio.Queue)
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)   # of the tokens counted (token_times), if asked
    num_sent_logprobs: int = 0          # streamed so far
    num_sent_logprob_chars: int = 0     # their tokens' characters (the completions API's text_offset)
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # with the first output, if the request asked
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
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.new_token_ids and not self.detokenizer.is_stopped:
            self.token_times.extend([now] * len(output.new_token_ids))
            self.logprobs.extend(output.new_logprobs or [])
        text = self.detokenizer.add(output.new_token_ids, is_final=output.is_finished,
                                    stop_token_ended=output.is_finished and output.finish_reason == "stop")
        if output.is_finished:
            self.finish_reason, self.error, self.is_invalid = output.finish_reason, output.error, output.is_invalid
            if self.tool_choice is not None and self.finish_reason == "stop":
                self.tool_calls = tools.tool_calls(self.tool_choice, self.detokenizer.text)
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

    @property
    def wants_logprobs(self) -> bool:
        return self.request.sampling_params.logprobs is not None

    @property
    def text(self) -> str:
        """The choice's whole text: the echoed prompt, if any, then what was generated."""
        return (self.echo_text or "") + self.detokenizer.text

    @property
    def known_prompt_logprobs(self) -> list[TokenLogprobs | None]:
        """One entry per prompt token: the engine's, or None throughout when none came (the request ended first)."""
        return self.prompt_logprobs or [None] * self.request.num_prompt_tokens

    def echo_logprobs(self) -> dict[str, Any] | None:
        """Completions' echo with logprobs: the prompt tokens' lists (the first token's logprob null)."""
        if self.echo_text is None or not self.wants_logprobs:
            return None
        return protocol.completion_logprobs(self.request.prompt_token_ids, self.known_prompt_logprobs,
                                            self.detokenizer.tokenizer)

    def prompt_logprobs_field(self) -> dict[str, Any]:
        """vLLM's `prompt_logprobs` choice field, for a request that set prompt_logprobs (else nothing)."""
        if not self.show_prompt_logprobs:
            return {}
        return {"prompt_logprobs": protocol.vllm_prompt_logprobs(self.request.prompt_token_ids,
                                                                 self.known_prompt_logprobs,
                                                                 self.detokenizer.tokenizer)}

    def all_logprobs(self) -> dict[str, Any] | None:
        """OpenAI's logprobs of every counted token, after the echoed prompt's (None: the request did not ask)."""
        if not self.wants_logprobs:
            return None
        generated = protocol.logprobs_body(self.kind, self.logprobs, self.detokenizer.tokenizer,
                                           len(self.echo_text or ""))
        echoed = self.echo_logprobs()
        return generated if echoed is None else {key: echoed[key] + generated[key] for key in generated}

    def new_logprobs(self) -> dict[str, Any] | None:
        """Streaming: the logprobs of the counted tokens not sent yet, marked sent (None: none, or not asked)."""
        entries = self.logprobs[self.num_sent_logprobs:]
        if not entries:
            return None
        offset = self.num_sent_logprob_chars + len(self.echo_text or "")
        body = protocol.logprobs_body(self.kind, entries, self.detokenizer.tokenizer, offset)
        self.num_sent_logprobs = len(self.logprobs)
        if self.kind == "completion":
            self.num_sent_logprob_chars += sum(len(token) for token in body["tokens"])
        return body

    def with_usage(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A chunk of this choice, with its usage so far when the request asked for it in every chunk (vLLM's
        continuous_usage_stats: the prompt's tokens and this choice's tokens up to this chunk)."""
        if self.continuous_usage:
            chunk["usage"] = protocol.usage(self.request.num_prompt_tokens, self.num_output_tokens)
        return chunk

    def public_finish_reason(self) -> str | None:
        if self.tool_calls:
            return self.tool_choice.finish_reason
        return "stop" if self.finish_reason == "stop_string" else self.finish_reason


async def _finish(session: Session, disconnect: "asyncio.Task[None]") -> bool:
    """Consume one choice's outputs to its end and release it (False: the client left first)."""
    while session.finish_reason is None:
        output = await session.next_output(disconnect)
        if output is None:
            return False
        session.consume(output)
    session.close()   # NOTE: now, not with the group: a stop string frees its KV while the others still run
    return True


async def collect(group: list[Session], http_request: HTTPRequest) -> dict[str, Any] | None:
    """Non-streaming: wait for every choice's end and build the whole response (None: the client left first)."""
    disconnect = asyncio.ensure_future(wait_for_disconnect(http_request))
    try:
        if not all(await asyncio.gather(*(_finish(session, disconnect) for session in group))):
            return None
        for session in group:
            session.raise_if_failed()
        choices = [{**protocol.choice_body(s.kind, s.index, s.text, s.public_finish_reason(), s.all_logprobs(),
                                           s.tool_calls), **s.prompt_logprobs_field()} for s in group]
        first = group[0]
        return protocol.completion_body(first.kind, first.response_id, first.model, choices,
                                        group_prompt_tokens(group), sum(s.num_output_tokens for s in group))
    finally:
        disconnect.cancel()
        for session in group:
            session.close()


def group_prompt_tokens(group: list[Session]) -> int:
    """usage.prompt_tokens: each prompt once, however many choices it has (as vLLM counts them)."""
    return sum({s.prompt_index: s.request.num_prompt_tokens for s in group}.values())


async def first_outputs(group: list[Session], http_request: HTTPRequest) -> list[RequestOutput] | None:
    """Streaming: wait for every choice's first output before sending headers, so an engine failure is still a
    5xx (None: the client left first)."""
    disconnect = asyncio.ensure_future(wait_for_disconnect(http_request))
    firsts: list[RequestOutput] = []
    try:
        for session in group:
            output = await session.next_output(disconnect)
            if output is None:
                break
            if output.finish_reason == "error":
                session.consume(output)
                for other in group:
                    other.close()
                session.raise_if_failed()
            firsts.append(output)
    finally:
        disconnect.cancel()
    if len(firsts) < len(group):
        for session in group:
            session.close()
        return None
    return firsts


async def choice_chunks(session: Session, first: RequestOutput) -> AsyncIterator[dict[str, Any]]:
    """One choice's chunks: one per output with text (chat's first also carries the role), then its finish; an
    engine error ends it with an error event."""
    kind, is_first = session.kind, True
    output: RequestOutput | None = first
    while output is not None:
        text = session.consume(output)
        finish = session.public_finish_reason()
        if session.finish_reason == "error":
            yield {"error": APIError(500, f"generation failed: {session.error}", "server_error").body()["error"]}
            return
        if is_first and session.echo_text is not None:   # NOTE: completions' echo: the prompt comes first
            chunk = protocol.chunk_body(kind, session.response_id, session.model, session.echo_text, None,
                                        index=session.index, logprobs=session.echo_logprobs())
            chunk["choices"][0].update(session.prompt_logprobs_field())
            yield session.with_usage(chunk)
            is_first = False
        if session.tool_choice is not None:
            # NOTE: a function call is sent whole when it ends (OpenAI's clients join argument deltas, so one delta
            # is a valid stream); output that did not end as a call (cut at max_tokens) is sent as text then
            text = "" if finish is None else ("" if session.tool_calls else session.detokenizer.text)
        if text or finish is not None or (is_first and kind == "chat"):
            chunk = protocol.chunk_body(kind, session.response_id, session.model,
                                        text if text or kind == "completion" else "", finish,
                                        role=is_first and kind == "chat", index=session.index,
                                        logprobs=session.new_logprobs(), tool_calls=session.tool_calls)
            if is_first:
                chunk["choices"][0].update(session.prompt_logprobs_field())
            yield session.with_usage(chunk)
            is_first = False
        output = None if finish is not None else await session.sink.get()
    session.close()


async def merged(streams: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[dict[str, Any]]:
    """The chunks of several choices in the order they come (one choice: its own, with no task in between)."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield chunk
        return
    chunks: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for chunk in stream:
                await chunks.put(chunk)
        finally:
            await chunks.put(None)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            chunk = await chunks.get()
            if chunk is None:
                remaining -= 1
                continue
            yield chunk
    finally:
        for task in tasks:
            task.cancel()


async def stream_events(group: list[Session], firsts: list[RequestOutput]) -> AsyncIterator[str]:
    """SSE: every choice's chunks as they come, then the usage of them all (stream_options), then [DONE]; an
    engine error in any choice ends the stream after its error event."""
    async for chunk in merged([choice_chunks(s, first) for s, first in zip(group, firsts)]):
        yield sse(chunk)
        if "error" in chunk:
            break
    first = group[0]
    if first.include_usage:
        yield sse(protocol.usage_chunk(first.kind, first.response_id, first.model, group_prompt_tokens(group),
                                       sum(s.num_output_tokens for s in group)))
    yield sse("[DONE]")


class SessionStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its sessions however the stream ends (done, disconnect, or never
    started because the client left before the first byte)."""

    def __init__(self, group: list[Session], content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for session in self.group:
                session.close()
