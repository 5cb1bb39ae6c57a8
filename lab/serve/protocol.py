"""The OpenAI wire format: request schemas (validated with pydantic), error bodies, response builders.

Owns: what a client may send and what it gets back, field by field. Ignores: engines and tokenization.
Extensions as in vLLM: `top_k`, `ignore_eos`, `stop_token_ids`; prompts may be token ids.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from lab.errors import LabError
from lab.request import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default


class APIError(Exception):
    """An error the client caused (4xx) or an unavailable server (5xx), rendered as OpenAI's error body."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = status_code, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# NOTE: OpenAI options this server does not implement, each with the values that leave it off; any other value is
# refused (400), not silently ignored: an evaluation asking for logprobs must not get null back
UNSUPPORTED_UNLESS_OFF: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "prompt_logprobs": (None,), "best_of": (None, 1),
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}), "response_format": (None, {"type": "text"}), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "suffix": (None, ""), "min_tokens": (None, 0),
}


def refuse_unsupported(payload: dict[str, Any]) -> None:
    """400 for an option this server does not implement set to anything but its off value."""
    for name, off in UNSUPPORTED_UNLESS_OFF.items():
        if name in payload and not any(payload[name] == value and type(payload[name]) is type(value)
                                       for value in off):
            raise APIError(400, f"{name}={payload[name]!r} is not supported by this server; leave it unset",
                           param=name, code="unsupported_value")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. NOTE: strict, so "16" or true is not silently taken as a number; null is
    the default, as OpenAI's nullable fields are; unknown fields (user, metadata, ...) are ignored, as clients
    send many, but options that change the output are refused unless off (refuse_unsupported)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("n", "ignore_eos", "stream", "echo", mode="before", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported; only n=1", param="n", code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                # NOTE: OpenAI's default temperature is 1.0 (sampling); send 0 for greedy.
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=self.top_k if self.top_k is not None and self.top_k > 0 else 0,
                top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos)
        except LabError as exc:
            raise APIError(400, exc.problem, param=exc.problem.split(" ", 1)[0]) from None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        """The one prompt this server accepts per request (a batch of prompts is refused, not truncated)."""
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_value")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"got {len(prompt)} prompts in one request; send one prompt per request",
                               param="prompt", code="unsupported_value")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise APIError(400, "prompt is empty", param="prompt")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Plain text content; list content keeps its text parts (no images here)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = [p.get("text") for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content) or not all(isinstance(t, str) for t in parts):
            raise APIError(400, "only text content parts are supported", param="messages")
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses -----------------------------------------------------------------------------------
Endpoint = Literal["completion", "chat"]


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


def completion_body(kind: Endpoint, request_id: str, model: str, text: str, finish_reason: str | None,
                    num_prompt_tokens: int, num_output_tokens: int) -> dict[str, Any]:
    """The non-streaming response: one choice and its usage."""
    if kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(num_prompt_tokens, num_output_tokens)}


def chunk_body(kind: Endpoint, request_id: str, model: str, text: str | None, finish_reason: str | None,
               role: bool = False) -> dict[str, Any]:
    """One streamed chunk; a chat stream's first chunk also carries the assistant role."""
    if kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(kind: Endpoint, request_id: str, model: str, num_prompt_tokens: int,
                num_output_tokens: int) -> dict[str, Any]:
    """stream_options.include_usage: a last chunk with no choices and the usage."""
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(num_prompt_tokens, num_output_tokens)}
