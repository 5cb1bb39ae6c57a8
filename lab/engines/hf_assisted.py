"""HFAssistedEngine (engine=hf_assisted): the anchor for engine=speculative, HF transformers' assisted
generation (`generate(assistant_model=...)`) at batch 1 on the same weights, with the same kinds of drafter:

  drafter=draft_model    -> `assistant_model`: a separate causal LM (default: the target itself)
  drafter=early_exit     -> `assistant_early_exit=n`: the target's first n layers (HF's self-speculation)
  drafter=prompt_lookup  -> `prompt_lookup_num_tokens=k`: n-gram lookup in the context

Owns: mapping our settings onto HF's generation config, and per-token timestamps: HF's streamer gets
each target forward's accepted tokens in one put (1 to k + 1 of them), so they share one timestamp and
the chunk sizes give tokens per target forward. Ignores: how HF drafts and verifies.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from lab.engines.base import take_generated
from lab.engines.hf import HFEngine
from lab.errors import LabError
from lab.models.sources import ModelSource
from lab.request import Request, RequestStatus, SamplingParams
from lab.runner import ModelRunner

DRAFTERS = ("draft_model", "early_exit", "prompt_lookup")


class _ChunkClock(BaseStreamer):
    """generate() puts the prompt once, then once per target forward with every token it accepted."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.chunk_sizes: list[int] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            now = time.perf_counter()
            self.times.extend([now] * value.numel())
            self.chunk_sizes.append(value.numel())
        self._seen_prompt = True

    def end(self) -> None:
        pass


@contextmanager
def _patched(config: Any, **values: Any) -> Iterator[None]:
    """Set attributes of a (generation) config for the duration of one generate() call."""
    saved = {name: getattr(config, name, None) for name in values}
    for name, value in values.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


class HFAssistedEngine(HFEngine):
    def __init__(self, runner: ModelRunner, drafter: str = "prompt_lookup", num_assistant_tokens: int = 4,
                 assistant_early_exit: int = 8, assistant_model: ModelSource | None = None,
                 max_matching_ngram_size: int = 4, assistant_confidence_threshold: float = 0.0,
                 num_assistant_tokens_schedule: str = "constant", name: str | None = None, seed: int = 0) -> None:
        super().__init__(runner, batch_size=1, name=name or "hf_assisted", seed=seed)
        if drafter not in DRAFTERS:
            raise LabError(f"unknown drafter {drafter!r}", f"set engine.drafter to one of {', '.join(DRAFTERS)}")
        if num_assistant_tokens < 1:
            raise LabError(f"num_assistant_tokens must be >= 1, got {num_assistant_tokens}",
                           "set engine.num_assistant_tokens=4 (plain decoding is engine=hf)")
        num_layers = runner.config.num_layers
        if drafter == "early_exit" and not 1 <= assistant_early_exit < num_layers:
            raise LabError(f"assistant_early_exit must be in 1..{num_layers - 1}, got {assistant_early_exit}",
                           f"set engine.assistant_early_exit between 1 and {num_layers - 1}")
        self.drafter, self.num_assistant_tokens = drafter, num_assistant_tokens
        self.assistant_early_exit, self.max_matching_ngram_size = assistant_early_exit, max_matching_ngram_size
        self.assistant_settings = dict(num_assistant_tokens=num_assistant_tokens,
                                       num_assistant_tokens_schedule=num_assistant_tokens_schedule,
                                       assistant_confidence_threshold=assistant_confidence_threshold)
        self.assistant_source = assistant_model
        self._assistant: torch.nn.Module | None = None
        self.chunk_sizes: list[int] = []

    def assistant(self) -> torch.nn.Module | None:
        """The HF model that drafts: the draft model, the target itself (early exit), or none (lookup)."""
        if self.drafter == "prompt_lookup":
            return None
        if self.drafter == "early_exit" or self.assistant_source is None:
            return self.runner.hf_model()
        if self._assistant is None:
            draft = self.assistant_source.build_hf_model(self.runner.dtype, self.runner.device)
            if draft.config.vocab_size != self.runner.vocab_size:
                raise LabError(f"assistant vocabulary ({draft.config.vocab_size}) differs from the target's "
                               f"({self.runner.vocab_size})", "use an assistant that shares the target's tokenizer")
            self._assistant = draft
        return self._assistant

    def _generation_config(self, params: SamplingParams, max_new_tokens: int) -> GenerationConfig:
        config = super()._generation_config(params, max_new_tokens)
        if self.drafter == "prompt_lookup":
            config.prompt_lookup_num_tokens = self.num_assistant_tokens
            config.max_matching_ngram_size = self.max_matching_ngram_size
        elif self.drafter == "early_exit":
            config.assistant_early_exit = self.assistant_early_exit
        return config

    def _generate(self, request: Request, clock: _ChunkClock) -> list[int]:
        params = request.sampling_params
        model, assistant = self.runner.hf_model(), self.assistant()
        prompt = torch.tensor([request.prompt_token_ids], dtype=torch.long, device=self.runner.device)  # (1, P)
        config = self._generation_config(params, params.max_tokens)
        if not params.is_greedy:
            torch.manual_seed(params.seed if params.seed is not None else self.seed)
        with ExitStack() as stack:
            # NOTE: generate() fills an unset eos_token_id from each model's own generation config (the
            # assistant's too), and HF reads the assistant's k and schedule from the assistant's config.
            for hf_model in {id(m): m for m in (model, assistant) if m is not None}.values():
                if params.ignore_eos:
                    stack.enter_context(_patched(hf_model.generation_config, eos_token_id=None))
            if assistant is not None:
                stack.enter_context(_patched(assistant.generation_config, **self.assistant_settings))
            stack.enter_context(torch.inference_mode())
            kwargs = {"assistant_model": assistant} if self.drafter == "draft_model" else {}
            sequences = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                       generation_config=config, streamer=clock, **kwargs)
        return sequences[0, prompt.shape[1]:].tolist()

    def step(self) -> list[Request]:
        request = self.waiting.popleft()
        self.running = [request]
        start = time.perf_counter()
        request.status, request.first_scheduled_time = RequestStatus.RUNNING, start
        clock = _ChunkClock()
        tokens = self._generate(request, clock)
        self._record_forwards(start, clock, request.num_prompt_tokens)
        take_generated(request, tokens, clock.times, self.runner.eos_token_ids, "generate()")
        self.running = []
        return [request]

    def _record_forwards(self, start: float, clock: _ChunkClock, num_prompt_tokens: int) -> None:
        """The first target forward (prefill, drafts included) closes prefill; each later one is a decode step."""
        if not clock.chunk_sizes:
            return
        first_end = clock.times[clock.chunk_sizes[0] - 1]
        phases = self.phases
        phases.seconds["prefill"] += first_end - start
        phases.steps["prefill"] += 1
        phases.tokens["prefill"] += num_prompt_tokens
        phases.seconds["decode"] += clock.times[-1] - first_end
        phases.steps["decode"] += len(clock.chunk_sizes) - 1
        phases.tokens["decode"] += sum(clock.chunk_sizes[1:])
        self.chunk_sizes += clock.chunk_sizes

    def reset_stats(self) -> None:
        super().reset_stats()
        self.chunk_sizes = []

    def stats(self) -> dict[str, float]:
        forwards = len(self.chunk_sizes)
        return {**super().stats(), "spec/num_target_forwards": forwards,
                "spec/num_spec_tokens": self.num_assistant_tokens,
                "spec/tokens_per_target_forward": sum(self.chunk_sizes) / max(1, forwards)}
