"""The OpenAI-compatible server, driven by the official `openai` client (streaming and not), in-process on
127.0.0.1 with the tiny model: outputs equal the engine's own greedy tokens, usage counts, chat template,
stop strings, seeds, /v1/models, /health, /metrics, OpenAI-style 4xx bodies, and disconnects freeing KV.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from lab.bench.client import BenchRequest
from lab.bench.driver import Target, benchmark
from lab.bench.server_metrics import parse_spec_counters
from lab.engines.ar import AREngine
from lab.engines.base import Engine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.engines.speculative import SpeculativeEngine
from lab.engines.static import StaticBatchEngine
from lab.kv_cache import PagedKVCacheConfig
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.serve.app import OpenAIServer, ServeOptions, create_app
from lab.sched import SchedulerConfig
from lab.serve.engine_loop import AddRequest, EngineLoop, RequestOutput, Shutdown, ThreadEngineClient
from lab.serve.server import ServerThread
from lab.spec.dflash import DFlashProposerConfig
from tests.helpers import chat_prompt

MODEL = "tiny"
PROMPT = [10, 200, 3000, 45, 6, 789, 1011]


class Served:
    def __init__(self, runner: ModelRunner, max_queue_len: int = 64, engine: Engine | None = None) -> None:
        self.engine = engine or AREngine(runner)
        self.server = OpenAIServer(ThreadEngineClient(self.engine), runner.tokenizer, runner.vocab_size,
                                   ServeOptions(MODEL, max_queue_len=max_queue_len))
        self.thread = ServerThread(create_app(self.server))
        self.url = self.thread.url

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until nothing is outstanding and the engine holds no live KV (or fail with the numbers)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.server.client.stats()
            if self.server.num_outstanding == 0 and stats.kv_used_bytes == 0 and stats.num_running == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"not idle: outstanding={self.server.num_outstanding} stats={self.server.client.stats()}")


@pytest.fixture(scope="module")
def served(tiny_text_runner: ModelRunner) -> Iterator[Served]:
    served = Served(tiny_text_runner)
    with served.thread:
        yield served


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


def reference_tokens(runner: ModelRunner, prompt: list[int], max_tokens: int) -> list[int]:
    """The engine's own greedy output, run directly (the server's engine thread is idle meanwhile)."""
    request = Request("ref", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return AREngine(runner).run([request]).requests[0].output_token_ids


def test_completion_matches_engine_greedy_and_counts_usage(served: Served, client: openai.OpenAI,
                                                           tiny_text_runner: ModelRunner) -> None:
    expected = reference_tokens(tiny_text_runner, PROMPT, 12)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == tiny_text_runner.tokenizer.decode(expected, skip_special_tokens=True)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (7, 12, 19)


def test_streamed_completion_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert len([c for c in chunks if c.choices]) > 1, "streamed as one chunk"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_applies_template_streaming_and_not(client: openai.OpenAI, tiny_text_runner: ModelRunner) -> None:
    messages = [{"role": "user", "content": "Write a haiku about GPUs."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.usage.prompt_tokens == len(chat_prompt(tiny_text_runner.tokenizer, messages[0]["content"]))
    assert whole.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == whole.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_text_and_frees_the_request(served: Served, client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                        stream=stream, extra_body={"ignore_eos": True})
        chunks = list(out) if stream else [out]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == full[:full.index(stop)], f"stream={stream}: {text!r} vs stop {stop!r} in {full!r}"
        assert chunks[-1].choices[0].finish_reason == "stop"
    served.wait_idle()


def test_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9,
                                         seed=seed, extra_body={"top_k": 50}).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1, "different seeds gave one text"


def _sse_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and "[DONE]" not in lines[:-1], lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def test_n_samples_are_the_requests_seeded_seed_plus_i_streaming_and_not(served: Served, client: openai.OpenAI
                                                                          ) -> None:
    """n choices are n engine requests; as in vLLM, choice i of a seeded request samples with seed + i."""
    sampled = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(seed=7 + i, **sampled).choices[0].text for i in range(3)]
    whole = client.completions.create(n=3, seed=7, **sampled)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == alone and len(set(alone)) > 1
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(PROMPT), 30)   # the prompt once
    body = {**sampled, **sampled.pop("extra_body"), "n": 3, "seed": 7, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = _sse_chunks(httpx.post(served.url + "/v1/completions", json=body, timeout=60))
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
    assert texts == alone and finishes == ["length"] * 3
    assert len({c["id"] for c in chunks}) == 1 and chunks[-1]["usage"]["completion_tokens"] == 30
    served.wait_idle()


def test_a_batch_of_prompts_gets_n_choices_each_in_prompt_order(served: Served, client: openai.OpenAI,
                                                                 tiny_text_runner: ModelRunner) -> None:
    other = [7, 77, 777, 7777]
    out = client.completions.create(model=MODEL, prompt=[PROMPT, other], n=2, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    tokenizer = tiny_text_runner.tokenizer
    expected = [tokenizer.decode(reference_tokens(tiny_text_runner, p, 6), skip_special_tokens=True)
                for p in (PROMPT, other)]
    assert [(c.index, c.text) for c in out.choices] == [(0, expected[0]), (1, expected[0]), (2, expected[1]),
                                                        (3, expected[1])]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(PROMPT) + len(other), 4 * 6)
    texts = client.completions.create(model=MODEL, prompt=["The sky is", "Two plus two is"], max_tokens=4,
                                      temperature=0)
    assert [c.index for c in texts.choices] == [0, 1] and texts.choices[0].text != texts.choices[1].text


def test_chat_streams_each_choice_with_its_own_role_chunk(served: Served) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "n": 2,
            "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = _sse_chunks(httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60))
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for chunk in chunks:
        by_index[chunk["choices"][0]["index"]].append(chunk["choices"][0])
    for choices in by_index.values():
        assert choices[0]["delta"]["role"] == "assistant" and choices[-1]["finish_reason"] == "length"
    assert [c["delta"].get("content") for c in by_index[0]] == [c["delta"].get("content") for c in by_index[1]]
    served.wait_idle()


def test_choices_count_against_the_queue_and_a_disconnect_frees_them_all(tiny_text_runner: ModelRunner) -> None:
    served = Served(tiny_text_runner, max_queue_len=2,
                    engine=ContinuousBatchingEngine(tiny_text_runner, SchedulerConfig(max_num_seqs=4)))
    with served.thread:
        response = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 3})
        assert response.status_code == 429 and "3 more asked" in response.json()["error"]["message"], response.text
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "n": 2, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", served.url + "/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                next(line for line in stream.iter_lines() if line.startswith("data:"))
        served.wait_idle()
        assert served.engine.kv_manager.num_held_blocks == 0


def _engine_logprobs(runner: ModelRunner, prompt: list[int], max_tokens: int, num_top: int) -> Request:
    request = Request("ref", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=num_top))
    return AREngine(runner).run([request]).requests[0]


def test_completion_logprobs_are_the_engines_streaming_and_not(served: Served, tiny_text_runner: ModelRunner) -> None:
    reference = _engine_logprobs(tiny_text_runner, PROMPT, 8, 3)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    logprobs = httpx.post(served.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    tokenizer = tiny_text_runner.tokenizer
    tokens = [tokenizer.decode([t]) for t in reference.output_token_ids]
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"] == pytest.approx([e.logprob for e in reference.output_logprobs], abs=1e-5)
    assert logprobs["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for top, entry, token in zip(logprobs["top_logprobs"], reference.output_logprobs, tokens):
        assert len(top) == 3 and top[token] == pytest.approx(entry.logprob, abs=1e-5)   # greedy: the top one
    chunks = _sse_chunks(httpx.post(served.url + "/v1/completions", json={**body, "stream": True}, timeout=60))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert len(streamed) > 1
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for part in streamed for x in part[key]] == logprobs[key], key
    plain = httpx.post(served.url + "/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]
    assert plain["logprobs"] is None


def test_chat_logprobs_list_each_token_with_its_top_alternatives(served: Served, client: openai.OpenAI,
                                                                  tiny_text_runner: ModelRunner) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                  temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    reference = _engine_logprobs(tiny_text_runner, chat_prompt(tiny_text_runner.tokenizer, "Hi"), 6, 2)
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in reference.output_logprobs], abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    stream = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [item for chunk in stream if chunk.choices[0].logprobs for item in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    response = httpx.post(served.url + "/v1/chat/completions", json={**kwargs, "logprobs": False,
                                                                     "extra_body": None})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs", response.text


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(served: Served, tiny_text_runner: ModelRunner) -> None:
    """lm-eval's loglikelihood request: token-id prompts in a batch, echo, logprobs=1, max_tokens=1, greedy. Each
    prompt token after the first gets HF's log_softmax at the position before it; the first has null."""
    prompts = [PROMPT, [7, 77, 777, 7777, 42]]
    body = {"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    out = httpx.post(served.url + "/v1/completions", json=body).json()
    tokenizer = tiny_text_runner.tokenizer
    for choice, prompt in zip(out["choices"], prompts):
        logprobs = choice["logprobs"]
        assert choice["text"].startswith(tokenizer.decode(prompt, skip_special_tokens=True))
        assert logprobs["tokens"][:len(prompt)] == [tokenizer.decode([t]) for t in prompt]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1 and logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"][1]) in (1, 2)
        with torch.inference_mode():
            reference = torch.log_softmax(tiny_text_runner.hf_model()(torch.tensor([prompt])).logits[0].float(), -1)
        expected = [float(reference[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        assert logprobs["token_logprobs"][1:len(prompt)] == pytest.approx(expected, abs=1e-4)
        assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts)) and out["usage"]["completion_tokens"] == 2
    chunks = _sse_chunks(httpx.post(served.url + "/v1/completions", json={**body, "prompt": PROMPT, "max_tokens": 4,
                                                                            "stream": True}, timeout=60))
    whole = httpx.post(served.url + "/v1/completions", json={**body, "prompt": PROMPT, "max_tokens": 4}).json()
    assert chunks[0]["choices"][0]["text"] == tokenizer.decode(PROMPT, skip_special_tokens=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [x for part in streamed for x in part[key]] == whole["choices"][0]["logprobs"][key], key


def test_vllms_prompt_logprobs_field_on_both_endpoints(served: Served) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    choice = httpx.post(served.url + "/v1/completions", json=body).json()["choices"][0]
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None and choice["logprobs"] is None
    for token_id, entry in zip(PROMPT[1:], prompt_logprobs[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        assert {v["rank"] for k, v in entry.items() if k != str(token_id)} == {1, 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    choice = httpx.post(served.url + "/v1/chat/completions", json=chat).json()["choices"][0]
    assert choice["prompt_logprobs"][0] is None and all(len(e) == 1 for e in choice["prompt_logprobs"][1:])
    stream = _sse_chunks(httpx.post(served.url + "/v1/completions", json={**body, "stream": True}, timeout=60))
    assert stream[0]["choices"][0]["prompt_logprobs"] == prompt_logprobs
    assert all("prompt_logprobs" not in c["choices"][0] for c in stream[1:])


def test_penalties_logit_bias_and_min_tokens_reach_the_engine(served: Served, tiny_text_runner: ModelRunner) -> None:
    params = {"repetition_penalty": 0.5, "frequency_penalty": -1.0, "presence_penalty": -1}   # repeats, here
    request = Request("ref", list(PROMPT), SamplingParams(max_tokens=12, ignore_eos=True, **params))
    expected = AREngine(tiny_text_runner).run([request]).requests[0].output_token_ids
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **params}
    text = httpx.post(served.url + "/v1/completions", json=body).json()["choices"][0]["text"]
    assert text == tiny_text_runner.tokenizer.decode(expected, skip_special_tokens=True)
    assert expected != reference_tokens(tiny_text_runner, PROMPT, 12)
    forced = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logit_bias": {"42": 100},
              "min_tokens": 3, "stop_token_ids": [42]}   # 42 stops, but not before the third token
    choice = httpx.post(served.url + "/v1/completions", json=forced).json()["choices"][0]
    assert choice["text"] != "" and choice["finish_reason"] == "length"


def test_structured_outputs_by_every_spelling(served: Served, client: openai.OpenAI) -> None:
    """OpenAI's response_format (json_object, json_schema), vLLM's structured_outputs and its older guided_* fields:
    each output matches its constraint, streamed or not, and ends with finish_reason stop."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is it ok? Answer in JSON."}], temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}})
    message = chat.choices[0].message
    assert chat.choices[0].finish_reason == "stop" and isinstance(json.loads(message.content)["ok"], bool)
    body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 20, "temperature": 0}
    for constraint, check in [({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
                              ({"guided_regex": "[0-9]{2}"}, lambda t: len(t) == 2 and t.isdigit()),
                              ({"structured_outputs": {"regex": "x[yz]"}}, lambda t: t in ("xy", "xz")),
                              ({"guided_json": {"enum": [1, 2]}}, lambda t: json.loads(t) in (1, 2))]:
        choice = httpx.post(served.url + "/v1/completions", json={**body, **constraint}).json()["choices"][0]
        assert check(choice["text"]) and choice["finish_reason"] == "stop", (constraint, choice)
        stream = _sse_chunks(httpx.post(served.url + "/v1/completions", json={**body, **constraint, "stream": True}))
        assert "".join(c["choices"][0]["text"] for c in stream if c["choices"]) == choice["text"], constraint
    sampled = client.completions.create(model=MODEL, prompt="{", max_tokens=60, temperature=1.0, seed=1, n=3,
                                        extra_body={"guided_json": schema, "guided_decoding_backend": "guidance"})
    for choice in sampled.choices:
        assert choice.finish_reason == "length" or isinstance(json.loads(choice.text)["ok"], bool), choice.text


def test_vllm_sampling_extensions_reach_the_engine_and_the_text(served: Served, tiny_text_runner: ModelRunner) -> None:
    """min_p, allowed_token_ids, bad_words, truncate_prompt_tokens, include_stop_str_in_output, skip_special_tokens:
    each as vLLM's."""
    tokenizer = tiny_text_runner.tokenizer
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = reference_tokens(tiny_text_runner, PROMPT, 8)

    def completion(**extra) -> dict[str, Any]:
        response = httpx.post(served.url + "/v1/completions", json={**body, **extra})
        assert response.status_code == 200, (extra, response.text)
        return response.json()["choices"][0]

    assert completion(min_p=0.5)["text"] == completion()["text"]   # greedy: min-p keeps the likeliest
    assert set(tokenizer.encode(completion(allowed_token_ids=[42, 43])["text"])) <= {42, 43}
    word = tokenizer.decode([plain[0]]).strip()
    assert not completion(bad_words=[word])["text"].startswith(tokenizer.decode([plain[0]]))
    request = Request("ref", PROMPT[-3:], SamplingParams(max_tokens=8, ignore_eos=True))
    truncated = AREngine(tiny_text_runner).run([request]).requests[0].output_token_ids
    short = httpx.post(served.url + "/v1/completions", json={**body, "truncate_prompt_tokens": 3}).json()
    assert short["choices"][0]["text"] == tokenizer.decode(truncated) and short["usage"]["prompt_tokens"] == 3
    # NOTE: the stop token's text is left out unless include_stop_str_in_output (vLLM's), and so is a stop string
    stop_token = {"stop_token_ids": [plain[2]], "ignore_eos": False}
    assert completion(**stop_token)["text"] == tokenizer.decode(plain[:2])
    assert completion(**stop_token, include_stop_str_in_output=True)["text"] == tokenizer.decode(plain[:3])
    full = completion()["text"]
    stop = full[len(tokenizer.decode(plain[:2])):][:2]
    assert completion(stop=[stop], include_stop_str_in_output=True)["text"] == full[:full.index(stop) + len(stop)]
    eos = sorted(tiny_text_runner.eos_token_ids)[0]
    ended = {"logit_bias": {str(eos): 100}, "ignore_eos": False, "max_tokens": 3}
    assert completion(**ended)["text"] == "" and completion(**ended, skip_special_tokens=False)["text"] == ""
    special = completion(**ended, skip_special_tokens=False, include_stop_str_in_output=True)["text"]
    assert special == tokenizer.decode([eos])


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(served: Served) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _sse_chunks(httpx.post(served.url + "/v1/completions", json=body))
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c["usage"]["prompt_tokens"] == len(PROMPT)
                                                                for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    plain = _sse_chunks(httpx.post(served.url + "/v1/completions",
                                   json={**body, "stream_options": {"include_usage": True}}))
    assert all("usage" not in c for c in plain[:-1])


def test_tokenize_and_detokenize(served: Served, tiny_text_runner: ModelRunner) -> None:
    tokenizer = tiny_text_runner.tokenizer
    out = httpx.post(served.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                                       "return_token_strs": True}).json()
    assert out["tokens"] == tokenizer.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 2048 and "".join(out["token_strs"]) == "Hello world"
    chat = httpx.post(served.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == chat_prompt(tokenizer, "hi")
    text = httpx.post(served.url + "/detokenize", json={"model": MODEL, "tokens": out["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    for path, bad, param in [("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
                             ("/detokenize", {"tokens": [10**9]}, "tokens"),
                             ("/tokenize", {"model": "other", "prompt": "a"}, "model")]:
        response = httpx.post(served.url + path, json=bad)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def test_a_named_or_required_tool_choice_returns_tool_calls(client: openai.OpenAI) -> None:
    """tool_choice naming a function: the output is its arguments, matching its parameters schema (finish "stop",
    OpenAI's); "required": one or more calls to the listed tools (finish "tool_calls"); streamed, the calls come
    whole in one delta, and the openai client reads them either way."""
    messages = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], temperature=0, max_tokens=60)
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, tool_choice=named, stream=True))
            calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(**kwargs, tool_choice=named).choices[0]
            calls, finish = choice.message.tool_calls, choice.finish_reason
            assert choice.message.content is None
        assert finish == "stop" and len(calls) == 1 and calls[0].function.name == "get_weather", (stream, calls)
        arguments = json.loads(calls[0].function.arguments)
        assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7
        assert calls[0].id.startswith("chatcmpl-tool-")
    required = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], temperature=0,
                                              max_tokens=120, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    for call in required.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments),
                                                                                dict)
    # NOTE: the conversation goes on with the call and its result, as OpenAI's clients send them
    call = required.message.tool_calls[0]
    answer = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]).choices[0]
    assert answer.message.content and answer.message.tool_calls is None
    plain = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=4).choices[0]
    assert plain.message.tool_calls is None and plain.message.content is not None


@pytest.mark.parametrize("extra,param", [
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),   # NOTE: OpenAI's default with tools is "auto"
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_tool_choices_that_cannot_be_served_are_400s(served: Served, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    response = httpx.post(served.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    completions = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "tools": [WEATHER]})
    assert completions.status_code == 400 and completions.json()["error"]["param"] == "tools"


def test_an_engine_without_logprobs_refuses_them_by_name(tiny_text_runner: ModelRunner) -> None:
    served = Served(tiny_text_runner, engine=StaticBatchEngine(tiny_text_runner, batch_size=2))
    with served.thread:
        response = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "logprobs": 1})
        assert response.status_code == 400 and "engine static does not compute logprobs" in response.text
        assert httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}).status_code == 200


def test_models_health_and_metrics(served: Served, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(served.url + "/health").status_code == 200
    text = httpx.get(served.url + "/metrics").text
    for name in ("lab:num_requests_running", "lab:num_requests_waiting", "lab:kv_cache_usage_perc",
                 "lab:time_to_first_token_seconds_bucket", "lab:request_time_per_output_token_seconds_count",
                 "lab:inter_token_latency_seconds_count",
                 "lab:request_success_total"):
        assert name in text, f"{name} missing from /metrics"


def test_dflash_behind_the_server_is_lossless_at_batch_4(tiny_text_runner: ModelRunner) -> None:
    """A DFlash engine (a random drafter: its drafts get rejected, so every step rolls back) serving 4 concurrent
    greedy streams answers each exactly as AR does, and its /metrics counts the drafts it verified. Accepted
    drafts behind the server: tests/test_bench_serve.py (the target drafting for itself)."""
    engine = SpeculativeEngine(tiny_text_runner, DFlashProposerConfig(checkpoint=None, drafter={"block_size": 4}),
                               num_spec_tokens=3, scheduler=SchedulerConfig(max_num_seqs=4),
                               kv_cache=PagedKVCacheConfig(block_size=4, num_blocks=256, kv_cache_memory_mb=None))
    prompts = [[(31 * i + 7 * j) % 900 + 50 for j in range(5 + 3 * i)] for i in range(4)]
    expected = [tiny_text_runner.tokenizer.decode(reference_tokens(tiny_text_runner, p, 14), skip_special_tokens=True)
                for p in prompts]
    served = Served(tiny_text_runner, engine=engine)
    with served.thread:
        run = asyncio.run(benchmark(Target(served.url + "/v1"), [BenchRequest(p, len(p), 14) for p in prompts],
                                    [0.0] * 4, max_concurrency=4, ready_timeout_s=10))
        counts = parse_spec_counters(httpx.get(served.url + "/metrics").text)
    assert [o.generated_text for o in run.outputs] == expected
    assert counts is not None and counts == engine.spec_counters()
    assert counts.num_draft_tokens > 0, counts


BAD_BODIES: list[tuple[str, Any, int, str | None]] = [
    ("malformed json", b'{"model": "tiny", "prompt": ', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("unknown model", {"model": "gpt-5", "prompt": "hi"}, 404, "model"),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("max_tokens 0", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens a string", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("prompt a number", {"model": MODEL, "prompt": 123}, 400, "prompt"),
    ("temperature a string", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("temperature negative", {"model": MODEL, "prompt": "hi", "temperature": -1.0}, 400, "temperature"),
    ("top_p zero", {"model": MODEL, "prompt": "hi", "top_p": 0.0}, 400, "top_p"),
    ("n 0", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("n past OpenAI's 128", {"model": MODEL, "prompt": "hi", "n": 129}, 400, "n"),
    ("too many choices", {"model": MODEL, "prompt": ["hi"] * 20, "n": 128}, 400, "prompt"),
    ("an empty prompt in a batch", {"model": MODEL, "prompt": ["hi", ""]}, 400, "prompt"),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("token id out of range", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt"),
    ("prompt over the context", {"model": MODEL, "prompt": [5] * 2048, "max_tokens": 1}, 400, "prompt"),
    ("generation over the context", {"model": MODEL, "prompt": [5] * 10, "max_tokens": 2040}, 400, "max_tokens"),
    ("temperature NaN", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, None),
    ("seed past 64 bits", {"model": MODEL, "prompt": "hi", "temperature": 1.0, "seed": 2**70}, 400, "seed"),
    ("logprobs past 20", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("logprobs true (the chat API's spelling)", {"model": MODEL, "prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("prompt_logprobs past 20", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("a penalty past 2", {"model": MODEL, "prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("repetition_penalty 0", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit_bias keyed by words", {"model": MODEL, "prompt": "hi", "logit_bias": {"hi": 1}}, 400, "logit_bias"),
    ("logit_bias past 100", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias outside the vocab", {"model": MODEL, "prompt": "hi", "logit_bias": {"999999": 1}}, 400, None),
    ("min_tokens over max_tokens", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400,
     "min_tokens"),
    ("response_format yaml", {"model": MODEL, "prompt": "hi", "response_format": {"type": "yaml"}}, 400,
     "response_format"),
    ("json_schema without a schema", {"model": MODEL, "prompt": "hi", "response_format": {"type": "json_schema"}},
     400, "response_format"),
    ("two output constraints", {"model": MODEL, "prompt": "hi", "response_format": {"type": "json_object"},
                                "guided_regex": "a+"}, 400, "guided_regex"),
    ("structured_outputs with an unknown key", {"model": MODEL, "prompt": "hi", "structured_outputs": {"yaml": 1}},
     400, "structured_outputs"),
    ("guided_choice of nothing", {"model": MODEL, "prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    ("a regex that does not compile", {"model": MODEL, "prompt": "hi", "guided_regex": "[a-"}, 400, None),
    ("min_p past 1", {"model": MODEL, "prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("allowed_token_ids empty", {"model": MODEL, "prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("allowed_token_ids outside the vocab", {"model": MODEL, "prompt": "hi", "allowed_token_ids": [10**9]}, 400, None),
    ("a bad word of spaces", {"model": MODEL, "prompt": "hi", "bad_words": [" "]}, 400, "bad_words"),
    ("truncate_prompt_tokens 0", {"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("beam search", {"model": MODEL, "prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    ("stream_options without stream", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
     400, "stream_options"),
]


@pytest.mark.parametrize("name,body,status,param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_input_gets_openai_error_and_server_keeps_serving(served: Served, name: str, body: Any, status: int,
                                                              param: str | None) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(served.url + "/v1/completions", headers={"content-type": "application/json"}, **kwargs)
    assert response.status_code == status, f"{name}: {response.status_code} {response.text}"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param, error
    ok = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_off_values_of_unsupported_options_nulls_and_a_tiny_temperature_are_served(served: Served) -> None:
    """What clients send by default (logprobs false, penalties 0, tool_choice auto, null for optional fields)
    is served; a temperature under vLLM's 1e-5 is greedy instead of overflowing the step for every request."""
    greedy = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    expected = httpx.post(served.url + "/v1/completions", json=greedy).json()["choices"][0]["text"]
    for extra in ({"logprobs": None, "frequency_penalty": 0, "presence_penalty": 0.0, "tool_choice": "auto",
                   "response_format": {"type": "text"}, "logit_bias": {}},
                  {"n": None, "stream": None, "echo": None, "ignore_eos": None}, {"temperature": 1e-45}):
        response = httpx.post(served.url + "/v1/completions", json={**greedy, **extra})
        assert response.status_code == 200, f"{extra}: {response.text}"
        assert response.json()["choices"][0]["text"] == expected, extra


def test_a_stop_string_in_the_last_allowed_token_still_finishes_with_stop(client: openai.OpenAI) -> None:
    """vLLM's: the stop string decides the finish reason even in the step that reached max_tokens."""
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    assert full.finish_reason == "length"
    stop = full.text[-2:]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop],
                                        stream=stream, extra_body={"ignore_eos": True})
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == full.text[:full.text.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop", stream


def test_shutdown_aborts_what_outlives_the_drain_and_ends_its_stream(tiny_text_runner: ModelRunner) -> None:
    """A stream still running when drain_timeout_s runs out is aborted with a last chunk (finish_reason "abort")
    and [DONE], not cut off mid-body; /health says 503 while the server drains."""
    server = OpenAIServer(ThreadEngineClient(AREngine(tiny_text_runner)), tiny_text_runner.tokenizer,
                          tiny_text_runner.vocab_size, ServeOptions(MODEL, drain_timeout_s=0.5))
    thread = ServerThread(create_app(server), drain_timeout_s=0.5).start()
    lines: list[str] = []
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1800, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}

    def stream() -> None:
        with httpx.stream("POST", thread.url + "/v1/completions", json=body, timeout=60) as response:
            lines.extend(line for line in response.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 30
    while len(lines) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    stopper = threading.Thread(target=thread.stop)
    stopper.start()
    while not server.is_draining and time.monotonic() < deadline:
        time.sleep(0.01)
    reader.join(30)
    stopper.join(30)
    assert server.is_draining and lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "abort" and chunks[-1]["usage"]["completion_tokens"] > 0


def test_chat_bad_messages_are_400(served: Served) -> None:
    for messages in ([], "hello", [{"content": "no role"}]):
        response = httpx.post(served.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert response.status_code == 400, f"{messages!r}: {response.text}"
        assert response.json()["error"]["param"].startswith("messages"), response.text


def test_client_disconnect_mid_stream_aborts_and_frees_kv(served: Served) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "stream": True, "ignore_eos": True,
            "temperature": 0}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", served.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert '"text"' in first
        # leaving the block closes the connection mid-stream
    served.wait_idle()
    assert not served.engine.has_unfinished_requests()
    assert served.engine.kv_usage()[1] == 0, f"KV still in use: {served.engine.kv_usage()}"
    assert 'finished_reason="abort"' in httpx.get(served.url + "/metrics").text


SMALL_KV = PagedKVCacheConfig(block_size=4, num_blocks=8, kv_cache_memory_mb=None)   # 32 tokens of KV in all


def _small_kv_engine(runner: ModelRunner) -> ContinuousBatchingEngine:
    return ContinuousBatchingEngine(runner, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), SMALL_KV)


def test_request_that_never_fits_the_kv_pool_is_400_not_500(tiny_text_runner: ModelRunner) -> None:
    served = Served(tiny_text_runner, engine=_small_kv_engine(tiny_text_runner))
    with served.thread:
        for stream in (False, True):
            body = {"model": MODEL, "prompt": [5] * 10, "max_tokens": 40, "stream": stream}   # 49 tokens of KV
            response = httpx.post(served.url + "/v1/completions", json=body)
            assert response.status_code == 400, f"stream={stream}: {response.status_code} {response.text}"
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error", error
            assert "more than the whole KV cache holds (8 blocks of 4 tokens)" in error["message"], error
            assert "fix:" in error["message"] and "lower max_tokens" in error["message"], error
        ok = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": [5] * 10, "max_tokens": 8})
        assert ok.status_code == 200, ok.text
        served.wait_idle()
        assert served.engine.kv_manager.num_held_blocks == 0


def test_engine_loop_marks_a_request_the_engine_refuses_as_invalid(tiny_text_runner: ModelRunner) -> None:
    """The replica path: the router does not validate, so the engine loop's refusal must still read as a 4xx."""
    emitted: list[RequestOutput] = []
    loop = EngineLoop(_small_kv_engine(tiny_text_runner), lambda outputs, stats: emitted.extend(outputs))
    loop.inbox.put(AddRequest(Request("big", [5] * 10, SamplingParams(max_tokens=40))))
    loop.inbox.put(Shutdown(drain=True))
    loop.run()
    assert [(o.request_id, o.finish_reason, o.is_invalid) for o in emitted] == [("big", "error", True)], emitted
    assert "more than the whole KV cache holds" in emitted[0].error and "fix:" in emitted[0].error
