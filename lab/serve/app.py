"""The FastAPI app: OpenAI routes, request validation, admission (a bounded number of outstanding
requests, 429 past it), /health, /v1/models, /metrics, and the engine client's start and shutdown.

Owns: turning HTTP requests into engine Requests and errors into OpenAI error bodies. Ignores: how the
engine (or the replicas behind a router) steps; see engine_loop.py and replicas.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import Request as HTTPRequest

from lab.errors import LabError
from lab.request import Request
from lab.serve import protocol
from lab.serve import session as sessions
from lab.serve.detokenizer import IncrementalDetokenizer
from lab.serve.engine_loop import EngineClient, RequestOutput
from lab.serve.metrics import ServerMetrics
from lab.serve.protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                DetokenizeRequest, Endpoint, SamplingFields, TokenizeRequest, refuse_unsupported)
from lab.workloads.file import encode_record

log = logging.getLogger("lab.serve")


@dataclass
class ServeOptions:
    model_name: str
    max_queue_len: int = 256        # requests accepted and not yet answered (waiting + running); past it, 429
    drain_timeout_s: float = 30.0   # on shutdown, how long in-flight requests may take before being aborted


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not valid JSON")


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return (f"{where}: {first['msg']}" if where else first["msg"]), (str(first["loc"][0]) if first["loc"] else None)


class OpenAIServer:
    def __init__(self, client: EngineClient, tokenizer: Any | None, vocab_size: int, options: ServeOptions) -> None:
        self.client, self.tokenizer, self.vocab_size, self.options = client, tokenizer, vocab_size, options
        self.metrics = ServerMetrics(options.model_name)
        self.num_outstanding = 0
        self.sessions: dict[str, sessions.Session] = {}   # in flight, by request id
        self.is_draining = False
        self.created = int(time.time())

    # -- parsing ---------------------------------------------------------------------------------
    async def parse(self, http_request: HTTPRequest, schema: type[BaseModel]) -> Any:
        try:
            payload = json.loads(await http_request.body(), parse_constant=_not_json)
        except (ValueError, UnicodeDecodeError) as exc:   # NOTE: JSONDecodeError is a ValueError
            raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        refuse_unsupported(payload, schema)
        try:
            body = schema.model_validate(payload)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise APIError(400, message, param=param, code="invalid_type") from None
        if body.model is not None and body.model != self.options.model_name:   # NOTE: optional only for /tokenize
            raise APIError(404, f"the model `{body.model}` does not exist; this server serves "
                           f"`{self.options.model_name}`", param="model", code="model_not_found")
        return body

    def tokenize_prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", param=param)
            return list(prompt)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return encode_record({"prompt": prompt}, self.tokenizer)

    def tokenize_chat(self, chat_messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation through the chat template (which sees the tools, as vLLM's does; SmolLM2's ignores them)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in chat_messages]
        try:
            return encode_record({"messages": messages}, self.tokenizer, tools)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation (roles, order)
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None

    def max_tokens(self, requested: int | None, num_prompt_tokens: int, param: str, prompt_param: str) -> int:
        """Check the context: prompt + max_tokens must fit (None: whatever room the context leaves)."""
        context = self.client.max_model_len
        if requested is not None and requested <= 0:
            raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
        if num_prompt_tokens >= context or num_prompt_tokens + (requested or 0) > context:
            raise APIError(400, f"this model's maximum context length is {context} tokens; you requested "
                           f"{num_prompt_tokens + (requested or 0)} tokens ({num_prompt_tokens} in the prompt, "
                           f"{requested or 0} to generate)", param=prompt_param if num_prompt_tokens >= context
                           else param, code="context_length_exceeded")
        return requested if requested is not None else context - num_prompt_tokens

    # -- shutdown ----------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Shutdown has begun: /health says 503 and new requests are refused while in-flight ones finish."""
        self.is_draining = True

    def abort_in_flight(self) -> None:
        """The drain timed out: abort what is left, so each stream still ends properly (finish_reason "abort",
        usage, [DONE]) instead of being cut off mid-chunk."""
        for request_id, session in list(self.sessions.items()):
            self.client.abort_request(request_id)   # NOTE: frees the engine's side; its outputs stop here
            session.sink.put_nowait(RequestOutput(request_id, [], "abort", "the server shut down"))

    # -- generation --------------------------------------------------------------------------------
    def admit(self, num_requests: int) -> None:
        """Count a request's engine requests (one per choice) as outstanding, or refuse them all."""
        if self.is_draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        if self.num_outstanding + num_requests > self.options.max_queue_len:
            self.metrics.rejected.labels(self.options.model_name, "queue_full").inc()
            raise APIError(429, f"the server is at capacity: {self.num_outstanding} requests outstanding, "
                           f"{num_requests} more asked (serve.max_queue_len={self.options.max_queue_len}); retry "
                           "later", type="rate_limit_error", code="queue_full")
        self.num_outstanding += num_requests

    def release(self, session: sessions.Session) -> None:
        self.num_outstanding -= 1
        self.sessions.pop(session.request.request_id, None)
        self.metrics.observe_finished(session.finish_reason or "abort", session.request.arrival_time,
                                      session.token_times)

    async def generate(self, http_request: HTTPRequest, kind: Endpoint, body: SamplingFields,
                       prompts: list[tuple[list[int], int]], echo_texts: list[str] | None = None) -> Response:
        """prompts: (token ids, max_tokens) each; every prompt gets body.n choices, each its own engine request;
        echo_texts: completions' echo, each prompt's text to send before its choices' generated text."""
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        now = time.perf_counter()
        choices = [(p, i) for p in range(len(prompts)) for i in range(body.n)]
        bad_words_token_ids = self.tokenize_bad_words(body.bad_words or [])
        requests = []
        for index, (prompt_index, sample_index) in enumerate(choices):
            prompt_token_ids, max_tokens = prompts[prompt_index]
            # NOTE: one choice keeps the response's id as the engine's; several get -<index> (vLLM: <index>_<id>)
            request_id = response_id if len(choices) == 1 else f"{response_id}-{index}"
            request = Request(request_id, prompt_token_ids,
                              body.sampling_params(max_tokens, sample_index, bad_words_token_ids), arrival_time=now)
            try:
                self.client.validate(request)
            except LabError as exc:
                raise APIError(400, exc.one_line, code="invalid_request") from None
            requests.append(request)
        self.admit(len(requests))
        self.metrics.prompt_tokens.labels(self.options.model_name).inc(sum(len(p) for p, _ in prompts))
        group = [sessions.Session(kind, self.options.model_name, request, response_id, index, choices[index][0],
                                  self.client, IncrementalDetokenizer(self.tokenizer, body.stop_strings, body.stream,
                                                         body.include_stop_str_in_output, body.skip_special_tokens),
                                  body.include_usage, self.release,
                                  echo_text=None if echo_texts is None else echo_texts[choices[index][0]],
                                  show_prompt_logprobs=body.prompt_logprobs is not None,
                                  tool_choice=body.tool_call_choice(), continuous_usage=body.continuous_usage)
                 for index, request in enumerate(requests)]
        for session in group:
            self.sessions[session.request.request_id] = session
            session.submit()
        if not body.stream:
            response = await sessions.collect(group, http_request)
            return Response(status_code=499) if response is None else JSONResponse(response)
        firsts = await sessions.first_outputs(group, http_request)
        if firsts is None:
            return Response(status_code=499)
        return sessions.SessionStreamingResponse(group, sessions.stream_events(group, firsts))

    async def completions(self, http_request: HTTPRequest) -> Response:
        body: CompletionRequest = await self.parse(http_request, CompletionRequest)
        prompts, echo_texts = [], []
        for prompt in body.prompts():
            whole = self.tokenize_prompt(prompt)
            prompt_token_ids = body.truncated(whole)
            prompts.append((prompt_token_ids, self.max_tokens(body.max_tokens, len(prompt_token_ids), "max_tokens",
                                                              "prompt")))
            echo_texts.append(prompt if isinstance(prompt, str) and prompt_token_ids is whole
                              else self.decode_prompt(prompt_token_ids))
        return await self.generate(http_request, "completion", body, prompts, echo_texts if body.echo else None)

    def tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """vLLM's bad_words as token ids: each word as it would start the text and, where that is a different token
        sequence of the same length, as it would follow a space (so the word is banned mid-text too)."""
        if words and self.tokenizer is None:
            raise APIError(400, "bad_words needs the model's tokenizer; this model has token ids only",
                           param="bad_words")
        sequences = []
        for word in words:
            if not word.strip():
                raise APIError(400, "bad_words must not hold an empty word", param="bad_words")
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(alone)
            if spaced != alone and len(spaced) == len(alone):
                sequences.append(spaced)
        return sequences

    def decode_prompt(self, token_ids: list[int]) -> str:
        """A token-id prompt's text, for echo (the ids themselves without a tokenizer, as vLLM's `token_id:<id>`)."""
        if self.tokenizer is None:
            return "".join(protocol.token_text(None, t) for t in token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def chat_completions(self, http_request: HTTPRequest) -> Response:
        body: ChatCompletionRequest = await self.parse(http_request, ChatCompletionRequest)
        prompt_token_ids = body.truncated(self.tokenize_chat(body.messages, body.tools))
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(body.requested_max_tokens, len(prompt_token_ids), param, "messages")
        return await self.generate(http_request, "chat", body, [(prompt_token_ids, max_tokens)])

    async def tokenize(self, http_request: HTTPRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the token ids the completions or chat endpoint would run for this prompt."""
        body: TokenizeRequest = await self.parse(http_request, TokenizeRequest)
        body.only_one()
        token_ids = self.tokenize_prompt(body.prompt) if body.prompt is not None else self.tokenize_chat(body.messages)
        strs = [protocol.token_text(self.tokenizer, t) for t in token_ids] if body.return_token_strs else None
        return {"count": len(token_ids), "max_model_len": self.client.max_model_len, "tokens": token_ids,
                "token_strs": strs}

    async def detokenize(self, http_request: HTTPRequest) -> dict[str, Any]:
        """vLLM's /detokenize: token ids to text."""
        body: DetokenizeRequest = await self.parse(http_request, DetokenizeRequest)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        return {"prompt": self.decode_prompt(self.tokenize_prompt(body.tokens, param="tokens"))}

    def models(self) -> dict[str, Any]:
        card = {"id": self.options.model_name, "object": "model", "created": self.created, "owned_by": "lab",
                "root": self.options.model_name, "max_model_len": self.client.max_model_len}
        return {"object": "list", "data": [card]}


def create_app(server: OpenAIServer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.client.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            # NOTE: uvicorn has already let in-flight requests finish (or cancelled them after its
            # graceful timeout); whatever is still in the engine now has no client left.
            server.is_draining = True
            await asyncio.to_thread(server.client.shutdown, False, server.options.drain_timeout_s)

    app = FastAPI(title="lab", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        headers = {"retry-after": "1"} if exc.status_code == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def internal_error(_: HTTPRequest, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        body = APIError(500, f"{type(exc).__name__}: {exc}", type="server_error").body()
        return JSONResponse(body, status_code=500)

    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if server.is_draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = server.metrics.render(server.client.stats(), server.num_outstanding)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
