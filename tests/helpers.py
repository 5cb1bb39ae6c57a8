"""Test helpers: requests from token ids and HF's own greedy generate as the reference."""

from __future__ import annotations

from typing import Any

import torch

from lab.request import Request, SamplingParams
from lab.runner import ModelRunner


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
