"""Our decoder's logits equal HF transformers' for the same weights (fp32, max abs diff <= 1e-3),
for prefill, chunked prefill and decode steps, across the Llama/Qwen2/Qwen3 variants we support."""

from __future__ import annotations

import pytest
import torch

from lab.kv_cache import ContiguousKVCache, NoCache
from lab.models.sources import ModelSource, tiny
from lab.runner import ModelRunner

TOL = 1e-3


def _hf_logits(source: ModelSource, input_ids: torch.Tensor) -> torch.Tensor:
    model = source.build_hf_model(torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        return model(input_ids).logits  # (1, T, V)


def _our_logits_incremental(runner: ModelRunner, input_ids: torch.Tensor, prefill_len: int) -> torch.Tensor:
    """Prefill `prefill_len` tokens, then decode the rest one token per forward over the KV cache."""
    num_tokens = input_ids.shape[1]
    cache = runner.allocate_kv_cache(1, num_tokens)
    positions = torch.arange(num_tokens)[None]
    cache.begin_forward(0, prefill_len)
    chunks = [runner.execute(input_ids[:, :prefill_len], positions[:, :prefill_len], cache, logits_index=None)]
    for t in range(prefill_len, num_tokens):
        cache.begin_forward(t, 1)
        chunks.append(runner.execute(input_ids[:, t:t + 1], positions[:, t:t + 1], cache, logits_index=None))
    return torch.cat(chunks, dim=1)


VARIANTS = {
    "llama": dict(),
    "llama_tied": dict(tie_word_embeddings=True),
    "qwen2_bias": dict(model_type="qwen2"),
    "qwen3_qk_norm": dict(model_type="qwen3"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_prefill_and_decode_logits_match_hf(variant: str) -> None:
    source = tiny(seed=1, vocab_size=128, with_tokenizer=False, **VARIANTS[variant])
    runner = ModelRunner(source, dtype="float32", device="cpu")
    input_ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    reference = _hf_logits(source, input_ids)
    prefill = runner.execute(input_ids, torch.arange(24)[None], NoCache(), logits_index=None)
    incremental = _our_logits_incremental(runner, input_ids, prefill_len=10)
    assert (prefill - reference).abs().max() <= TOL, f"prefill max diff {(prefill - reference).abs().max():.2e}"
    assert (incremental - reference).abs().max() <= TOL, \
        f"decode max diff {(incremental - reference).abs().max():.2e}"


def test_rope_scaling_llama3_matches_hf() -> None:
    source = tiny(seed=2, vocab_size=128, with_tokenizer=False)
    source.hf_config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}
    runner = ModelRunner(source, dtype="float32", device="cpu")
    input_ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    reference = _hf_logits(source, input_ids)
    ours = runner.execute(input_ids, torch.arange(200)[None], NoCache(), logits_index=None)
    assert (ours - reference).abs().max() <= TOL, f"max diff {(ours - reference).abs().max():.2e}"


def test_chunked_prefill_over_cache_matches_single_prefill(tiny_runner: ModelRunner) -> None:
    input_ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(30)[None]
    whole = tiny_runner.execute(input_ids, positions, NoCache(), logits_index=None)
    cache = tiny_runner.allocate_kv_cache(1, 30)
    parts = []
    for start, end in ((0, 7), (7, 19), (19, 30)):
        cache.begin_forward(start, end - start)
        parts.append(tiny_runner.execute(input_ids[:, start:end], positions[:, start:end], cache, logits_index=None))
    diff = (torch.cat(parts, dim=1) - whole).abs().max()
    # NOTE: relative to the logits' scale: chunks of <= 12 rows run the native GEMV, the 30-row prefill oneDNN,
    # so only fp32 summation order differs.
    scale = float(whole.abs().max().clamp(min=1))
    assert diff <= 1e-6 * scale + 1e-5, f"chunked prefill differs by {diff:.2e} (logits up to {scale:.1f})"


def test_left_padded_rows_match_unpadded(tiny_runner: ModelRunner) -> None:
    """A left-padded row with a key-padding mask gives its unpadded logits (static batching relies on it)."""
    generator = torch.Generator().manual_seed(4)
    short, long = torch.randint(0, 128, (1, 5), generator=generator), torch.randint(0, 128, (1, 9), generator=generator)
    width = 9
    input_ids = torch.zeros((2, width), dtype=torch.long)
    input_ids[0, width - 5:], input_ids[1] = short[0], long[0]
    key_padding = torch.zeros((2, width + 3), dtype=torch.bool)
    key_padding[0, width - 5:], key_padding[1] = True, True
    positions = torch.stack([torch.clamp(torch.arange(width) - (width - 5), min=0), torch.arange(width)])
    cache = ContiguousKVCache(2, 2, width + 3, 2, 16, torch.float32, torch.device("cpu"))
    cache.begin_forward(0, width, key_padding)
    batched = tiny_runner.execute(input_ids, positions, cache, logits_index=-1)       # (2, V)
    alone = tiny_runner.execute(short, torch.arange(5)[None], NoCache(), logits_index=-1)
    assert (batched[0] - alone[0]).abs().max() <= 1e-5
    assert torch.isfinite(batched).all()


def test_smollm2_prefill_and_decode_logits_match_hf(smollm2_source: ModelSource,
                                                    smollm2_runner: ModelRunner) -> None:
    tokenizer = smollm2_source.tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    input_ids = torch.tensor([ids])
    reference = _hf_logits(smollm2_source, input_ids)
    incremental = _our_logits_incremental(smollm2_runner, input_ids, prefill_len=len(ids) - 6)
    diff = (incremental - reference).abs().max()
    assert diff <= TOL, f"smollm2 max abs logit diff {diff:.2e} > {TOL}"
