"""Test helpers: requests from token ids, HF's own greedy generate as the reference, experiments/ scripts as
modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from lab.engines.base import Engine
from lab.engines.speculative import SpeculativeEngine
from lab.models.sources import ModelSource, tiny
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def load_experiment(name: str) -> ModuleType:
    """experiments/<name>.py as a module (experiments/ on sys.path, as when it runs as a script: its sibling imports)."""
    if str(EXPERIMENTS) not in sys.path:
        sys.path.insert(0, str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # NOTE: as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def block_source() -> ModelSource:
    """A tiny model made of GGUF blocks: a tied Q8_0 head of 256 tokens (16 of the greedy screen's groups), Q4_1
    projections."""
    return tiny(seed=1, num_hidden_layers=3, with_tokenizer=False, vocab_size=256, tie_word_embeddings=True,
                gguf_blocks=True)


def make_requests(prompts: list[list[int]], max_tokens: int, **params: Any) -> list[Request]:
    return [Request(f"r{i}", list(p), SamplingParams(max_tokens=max_tokens, **params)) for i, p in enumerate(prompts)]


def hf_greedy(runner: ModelRunner, prompt: list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    """HF transformers' generate(do_sample=False), one prompt at a time (no padding involved)."""
    model = runner.hf_model()
    eos = None if ignore_eos else sorted(runner.eos_token_ids)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                 pad_token_id=0, min_new_tokens=0)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def run_one_arrival_per_step(engine: Engine, requests: list[Request]) -> list[Request]:
    """Serve `requests` with request i admitted before the engine's step i: staggered like arrival times, but the
    same schedule on every run (wall-clock arrivals depend on how fast each step happens to be), so two engines'
    statistics compare."""
    pending = list(requests)
    while pending or engine.has_unfinished_requests():
        if pending:
            engine.add_request(pending.pop(0))
        engine.step()
    for request in requests:
        engine.release_request_state(request.request_id)
    return requests


def record_drafts(engine: SpeculativeEngine) -> list:
    """Every Draft the engine's proposer returns from now on, in order (the list fills as the engine runs)."""
    drafts: list = []
    propose = engine.proposer.propose

    def recording_propose(*args):
        out = propose(*args)
        drafts.extend(out.values())
        return out

    engine.proposer.propose = recording_propose
    return drafts
