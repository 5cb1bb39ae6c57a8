"""One benchmark request against an OpenAI-compatible endpoint, streamed and timed on the client.

vLLM's definitions (benchmarks/lib/endpoint_request_func.py): the clock starts when the request is sent;
TTFT is the first SSE message carrying choices; every later such message adds one ITL gap; latency
(E2EL) ends at the last of them; the output token count comes from the final `usage` chunk
(stream_options.include_usage), and the prompt length too when the server reports it.
Owns: the payload and the stream parsing. Ignores: arrivals and statistics.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

Api = Literal["completions", "chat"]


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int                  # tokens as the workload counted them (the server's count wins)
    output_len: int                  # max_tokens
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    request_id: str | None = None


@dataclass(slots=True)
class StreamOutput:
    """vLLM's RequestFuncOutput: times in seconds (perf_counter), as vLLM keeps them."""

    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int | None = None   # from usage; None when the server sent none
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    client_queue_time: float = 0.0     # waiting for the benchmark's own max_concurrency slot
    error: str = ""


def build_payload(request: BenchRequest, api: Api, model: str, extra_body: dict[str, Any] | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "max_tokens": request.output_len, "temperature": request.temperature,
                               "stream": True, "stream_options": {"include_usage": True}}
    if api == "completions":
        payload["prompt"] = request.prompt
    else:
        if not isinstance(request.prompt, str):
            raise ValueError("api=chat needs text prompts (prompt_format=text)")
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    # NOTE: only non-default filters are sent: servers disagree on what top_k=0 means.
    if request.top_p < 1.0:
        payload["top_p"] = request.top_p
    if request.top_k > 0:
        payload["top_k"] = request.top_k
    if request.seed is not None:
        payload["seed"] = request.seed
    if request.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra_body or {})
    return payload


def _chunk_text(choice: dict[str, Any], api: Api) -> str:
    if api == "completions":
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


async def send(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], api: Api,
               prompt_len: int) -> StreamOutput:
    """POST one streaming request and time every chunk that carries choices."""
    output = StreamOutput(prompt_len=prompt_len)
    start = most_recent = time.perf_counter()
    output.start_time = start
    text: list[str] = []
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                output.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return output
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators and SSE comments (pings)
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                message = json.loads(data)
                if not isinstance(message, dict):   # NOTE: fails this request, not the run (ValueError below)
                    raise ValueError(f"a stream message that is not a JSON object: {data[:100]!r}")
                if message.get("error"):
                    output.error = f"stream error: {message['error']}"
                    return output
                if message.get("choices"):
                    now = time.perf_counter()
                    if not text:  # the first chunk with choices
                        output.ttft = now - start
                    else:
                        output.itl.append(now - most_recent)
                    most_recent = now
                    text.append(_chunk_text(message["choices"][0], api))
                if usage := message.get("usage"):
                    output.output_tokens = usage.get("completion_tokens")
                    output.prompt_len = usage.get("prompt_tokens") or output.prompt_len
        output.generated_text = "".join(text)
        output.success = bool(text)
        output.latency = most_recent - start
        if not output.success:
            output.error = "the stream carried no choices, so no TTFT"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as exc:
        output.error = f"{type(exc).__name__}: {exc}"
    return output
