"""The OpenAI wire format: request schemas (validated with pydantic), error bodies, response builders.

Owns: what a client may send and what it gets back, field by field. Ignores: engines and tokenization.
Extensions as in vLLM: `top_k`, `ignore_eos`, `stop_token_ids`, `structured_outputs` (and its older `guided_*`
fields); prompts may be token ids.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from lab.errors import LabError
from lab.request import MAX_LOGPROBS, SamplingParams
from lab.sample.logprobs import TokenLogprobs
from lab.sample.structured import StructuredOutputsParams
from lab.serve.errors import APIError
from lab.serve.tools import ToolChoice, tool_choice_constraint

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default
MAX_N = 128          # OpenAI's limit on `n`
MAX_CHOICES = 1024   # prompts x n of one request: each choice is an engine request (and counts towards the queue)


# NOTE: OpenAI options this server does not implement, each with the values that leave it off; any other value is
# refused (400), not silently ignored: a client asking for JSON must not get free text back
UNSUPPORTED_UNLESS_OFF: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "suffix": (None, ""),
    # NOTE: vLLM's extensions not built here: beam search (and its length penalty), spacing of special tokens
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "spaces_between_special_tokens": (None, True),
    "guided_whitespace_pattern": (None,),
}


# NOTE: vLLM's older spellings of structured outputs (before `structured_outputs`), each the field it sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def refuse_unsupported(payload: dict[str, Any], schema: type[BaseModel]) -> None:
    """400 for an option this server does not implement (on this endpoint: `schema` lists what it does) set to
    anything but its off value."""
    for name, off in UNSUPPORTED_UNLESS_OFF.items():
        if name in schema.model_fields or name not in payload:
            continue
        if not any(payload[name] == value and type(payload[name]) is type(value) for value in off):
            raise APIError(400, f"{name}={payload[name]!r} is not supported by this server; leave it unset",
                           param=name, code="unsupported_value")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's: with include_usage, every chunk also carries its choice's usage


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. NOTE: strict, so "16" or true is not silently taken as a number; null is
    the default, as OpenAI's nullable fields are; unknown fields (user, metadata, ...) are ignored, as clients
    send many, but options that change the output are refused unless off (refuse_unsupported)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None                   # vLLM's extension
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)   # vLLM's extension
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None   # vLLM's extension (HF's meaning)
    logit_bias: dict[str, float] | None = None   # OpenAI's: token id (a JSON key, so a string) -> bias
    min_tokens: int | None = None                # vLLM's extension
    response_format: dict[str, Any] | None = None   # OpenAI's: text, json_object or json_schema
    structured_outputs: dict[str, Any] | None = None   # vLLM's: json, regex, choice, grammar or json_object
    guided_json: dict[str, Any] | str | None = None    # vLLM's older spellings of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[int] | None = None   # vLLM's extensions: only these tokens; never these words
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False     # vLLM's: keep the stop string (or the EOS / stop token's text)
    skip_special_tokens: bool = True             # vLLM's: leave special tokens out of the text
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)   # vLLM's: keep only the prompt's last k tokens

    @field_validator("n", "ignore_eos", "stream", "echo", "include_stop_str_in_output", "skip_special_tokens",
                     mode="before", check_fields=False)
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

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @field_validator("n")
    @classmethod
    def _n_in_range(cls, value: int) -> int:
        if not 1 <= value <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {value}")
        return value

    @property
    def num_logprobs(self) -> int | None:
        """How many top logprobs each generated token reports (None: no logprobs); each endpoint spells it."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """How many top logprobs each prompt token reports (None: none)."""
        return self.prompt_logprobs

    def tool_call_choice(self) -> ToolChoice | None:
        """The function call the output must be (chat's tools and tool_choice); None: text."""
        return None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint the request sets, by whichever of its spellings (None: free text)."""
        given: dict[str, dict[str, Any]] = {}
        if (tool_choice := self.tool_call_choice()) is not None:
            # NOTE: compact JSON: the arguments are re-serialised anyway, and a small model can run away in whitespace
            given["tool_choice"] = {"json": tool_choice.schema, "disable_any_whitespace": True}
        if self.response_format is not None:
            if (spec := response_format_constraint(self.response_format)) is not None:
                given["response_format"] = spec
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for name, field in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                given[name] = {field: getattr(self, name)}
        if not given:
            return None
        if len(given) > 1:
            raise APIError(400, f"set one output constraint, got {', '.join(given)}", param=list(given)[1])
        (param, spec), = given.items()
        unknown = set(spec) - set(StructuredOutputsParams.__dataclass_fields__)
        if unknown:
            raise APIError(400, f"{param} has unknown fields {sorted(unknown)}; it takes one of json, regex, choice, "
                           "grammar, json_object (and disable_any_whitespace)", param=param)
        try:
            return StructuredOutputsParams(**spec)
        except (LabError, TypeError) as exc:
            raise APIError(400, f"{param}: {exc.problem if isinstance(exc, LabError) else exc}", param=param) from None

    def truncated(self, prompt_token_ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens k: the prompt's last k tokens."""
        if self.truncate_prompt_tokens is None:
            return prompt_token_ids
        return prompt_token_ids[-self.truncate_prompt_tokens:]

    def sampling_params(self, max_tokens: int, sample_index: int = 0,
                        bad_words_token_ids: list[list[int]] | None = None) -> SamplingParams:
        """The parameters of one of the `n` samples; as in vLLM, sample i of a seeded request uses seed + i.
        bad_words_token_ids: `bad_words` tokenized (the caller has the tokenizer)."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        try:
            logit_bias = {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {list(self.logit_bias or {})[:5]}",
                           param="logit_bias") from None
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                # NOTE: OpenAI's default temperature is 1.0 (sampling); send 0 for greedy.
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=self.top_k if self.top_k is not None and self.top_k > 0 else 0,
                top_p=1.0 if self.top_p is None else self.top_p, min_p=self.min_p or 0.0,
                seed=None if self.seed is None else self.seed + sample_index,
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                logprobs=self.num_logprobs, prompt_logprobs=self.num_prompt_logprobs,
                frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=logit_bias or None, min_tokens=self.min_tokens or 0,
                structured_outputs=self.structured_outputs_params(), allowed_token_ids=self.allowed_token_ids,
                bad_words_token_ids=bad_words_token_ids or None)
        except LabError as exc:
            raise APIError(400, exc.problem, param=exc.problem.split(" ", 1)[0]) from None


def response_format_constraint(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's response_format -> structured-output fields: "text" none, "json_object" any JSON object,
    "json_schema" the schema under json_schema.schema (strict or not, the output matches it)."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                           param="response_format")
        return {"json": schema}
    raise APIError(400, f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                   param="response_format")


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)   # the legacy API's: top logprobs per token

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, value: Any) -> Any:
        return None if value is False else value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        # NOTE: echo with logprobs reports the prompt's tokens too (what lm-eval's loglikelihood reads)
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one (text or token ids), or a batch of them (a list of texts or of token-id
        lists); each gets `n` choices, indexed prompt by prompt as in vLLM (choice p * n + i)."""
        prompt = self.prompt
        is_batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        prompts: list[str | list[int]] = list(prompt) if is_batch else [prompt]   # type: ignore[arg-type]
        if len(prompts) * self.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={self.n} = {len(prompts) * self.n} choices; at most "
                           f"{MAX_CHOICES} per request", param="prompt")
        for i, one in enumerate(prompts):
            if len(one) == 0:
                raise APIError(400, "prompt is empty" if not is_batch else f"prompt {i} of the batch is empty",
                               param="prompt")
        return prompts


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
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None              # OpenAI's function tools (lab/serve/tools.py)
    tool_choice: str | dict[str, Any] | None = None        # "none", "auto", "required" or a named function

    def tool_call_choice(self) -> ToolChoice | None:
        return tool_choice_constraint(self.tools, self.tool_choice)

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt (tokenized as /v1/completions does) or messages (as /v1/chat/completions does)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    return_token_strs: bool = False

    def only_one(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", param="prompt")


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


# -- responses -----------------------------------------------------------------------------------
Endpoint = Literal["completion", "chat"]


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


def token_text(tokenizer: Any | None, token_id: int) -> str:
    """A token as logprobs name it: its text, special tokens included (vLLM's `token_id:<id>` without a tokenizer)."""
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprobs | None], tokenizer: Any | None,
                        text_offset: int = 0) -> dict[str, Any]:
    """The completions API's parallel lists for some tokens (an entry None: a token with no logprob, the prompt's
    first); top_logprobs also holds the token itself, as vLLM's; text_offset counts from `text_offset`."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens), initial=text_offset))[:len(tokens)]
    top = [None if e is None else {**{token_text(tokenizer, t): lp for t, lp in e.top}, text: e.logprob}
           for e, text in zip(entries, tokens)]
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": top, "text_offset": offsets}


def logprobs_body(kind: Endpoint, entries: list[TokenLogprobs], tokenizer: Any | None,
                  text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs of some generated tokens: the completions API's parallel lists (completion_logprobs), or
    chat's `content` list."""
    if kind == "completion":
        return completion_logprobs([e.token_id for e in entries], entries, tokenizer, text_offset)

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def vllm_prompt_logprobs(token_ids: list[int], entries: list[TokenLogprobs | None], tokenizer: Any | None
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: logprob, rank, decoded_token}
    for the token itself and the k most likely."""
    def item(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tokenizer, token_id)}
    result: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            result.append(None)
            continue
        top = {str(t): item(t, lp, rank) for rank, (t, lp) in enumerate(entry.top, start=1)}
        result.append({**top, str(token_id): item(token_id, entry.logprob, entry.rank)})
    return result


def choice_body(kind: Endpoint, index: int, text: str, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None
                ) -> dict[str, Any]:
    """One choice of a non-streaming response (logprobs: logprobs_body's, for a request that asked; tool_calls: the
    text as function calls, OpenAI's message then has no content)."""
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    message: dict[str, Any] = {"role": "assistant", "content": None if tool_calls else text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(kind: Endpoint, request_id: str, model: str, choices: list[dict[str, Any]],
                    num_prompt_tokens: int, num_output_tokens: int) -> dict[str, Any]:
    """The non-streaming response: its choices (choice_body) and the usage of them all."""
    obj = "text_completion" if kind == "completion" else "chat.completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(num_prompt_tokens, num_output_tokens)}


def chunk_body(kind: Endpoint, request_id: str, model: str, text: str | None, finish_reason: str | None,
               role: bool = False, index: int = 0, logprobs: dict[str, Any] | None = None,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One streamed chunk of choice `index` (with the logprobs of the tokens it brings, for a request that asked);
    a chat stream's first chunk of each choice also carries the role; tool_calls: whole calls, each with its index."""
    if kind == "completion":
        choice: dict[str, Any] = {"index": index, "text": text or "", "logprobs": logprobs,
                                  "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(kind: Endpoint, request_id: str, model: str, num_prompt_tokens: int,
                num_output_tokens: int) -> dict[str, Any]:
    """stream_options.include_usage: a last chunk with no choices and the usage."""
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(num_prompt_tokens, num_output_tokens)}
