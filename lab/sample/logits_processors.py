"""vLLM's built-in logits processors, applied to the raw logits before temperature, top-k and top-p, so greedy
decoding takes the processed argmax (logprobs stay the raw ones, as vLLM's default):

- repetition_penalty r (HF's and vLLM's): every token in the prompt or the output so far has its logit divided by
  r where positive and multiplied by r where negative (r > 1 discourages repeats; 1 is off);
- frequency_penalty f: minus f times the token's count in the output so far (OpenAI's; 0 is off);
- presence_penalty p: minus p for every token the output already holds (OpenAI's; 0 is off);
- logit_bias {token id: b}: plus b (OpenAI's, -100 to 100);
- allowed_token_ids (vLLM's): -inf for every other token;
- bad words (vLLM's, as token ids): a word's last token is -inf where the output so far ends with its other tokens;
- structured outputs: -inf for every token the request's grammar does not allow next (lab/sample/structured.py);
- min_tokens m: until the output holds m tokens, its stop tokens (EOS unless ignore_eos, stop_token_ids) are
  banned (vLLM's), unless nothing else is left (a complete grammar, say): then the request may end.

A verify step (speculative decoding) scores a request's drafted tokens in one forward: the row after draft i sees
the output so far plus drafts 0..i (`drafted`), so each row is processed as if the drafts before it had been
sampled, and verifying under the processed rows keeps the output exactly plain decoding's.

Owns: that arithmetic. Ignores: sampling (lab/sample/sampler.py) and which engines apply it.
"""

from __future__ import annotations

import torch

from lab.errors import LabError
from lab.request import Request, stop_ids


def apply_logits_processors(logits: torch.Tensor, requests: list[Request], eos_token_ids: set[int]) -> torch.Tensor:
    """logits (R, V), row i the next-token logits of requests[i] -> the same with each request's processors (a new
    tensor when any row has some; the input itself otherwise)."""
    rows = [i for i, request in enumerate(requests) if request.sampling_params.has_logits_processors]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        _process_row(logits[i], requests[i], eos_token_ids, [])
    return logits


def apply_logits_processors_to_drafts(logits: torch.Tensor, request: Request, eos_token_ids: set[int],
                                      drafted: list[list[int]]) -> torch.Tensor:
    """logits (T, V): one request's verify rows, row t following its output plus the drafted tokens drafted[t]
    (row 0: none; a chain's row i + 1: drafts 0..i; a tree's: the path down to its node) -> the same processed
    (a new tensor when the request has processors; the input itself otherwise)."""
    if not request.sampling_params.has_logits_processors:
        return logits
    logits = logits.clone()
    for row, tokens in zip(logits, drafted, strict=True):
        _process_row(row, request, eos_token_ids, tokens)
    return logits


def _process_row(row: torch.Tensor, request: Request, eos_token_ids: set[int], drafted: list[int]) -> None:
    """row (V,), in place: the next-token logits after the request's output and then `drafted`."""
    params, vocab_size, device = request.sampling_params, row.shape[-1], row.device
    outputs = request.output_token_ids + drafted if drafted else request.output_token_ids
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.prompt_token_ids) | set(outputs)), dtype=torch.long, device=device)
        seen = seen[seen < vocab_size]
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if outputs and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long, device=device),
                                minlength=vocab_size)[:vocab_size].to(row.dtype)                     # (V,)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        row[ids] += torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=device)
    if params.allowed_token_ids is not None:
        allowed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        allowed[[t for t in params.allowed_token_ids if t < vocab_size]] = True
        row.masked_fill_(~allowed, float("-inf"))
    for word in params.bad_words_token_ids or ():
        *prefix, last = word
        if last < vocab_size and (not prefix or outputs[len(outputs) - len(prefix):] == prefix):
            row[last] = float("-inf")
    if request.grammar is not None:
        request.grammar.catch_up(request.output_token_ids)
        allowed = request.grammar.allowed(drafted).to(device)                         # (V_tokenizer,)
        row[:len(allowed)].masked_fill_(~allowed[:vocab_size], float("-inf"))
        row[len(allowed):] = float("-inf")
    elif params.structured_outputs is not None:
        raise LabError(f"request {request.request_id} has structured outputs but no compiled grammar",
                       "admit requests through Engine.add_request, which compiles it")
    if len(outputs) < params.min_tokens:
        banned = torch.tensor(sorted(t for t in stop_ids(params, eos_token_ids) if t < vocab_size),
                              dtype=torch.long, device=device)
        if torch.isfinite(row).sum() > torch.isfinite(row[banned]).sum():
            row[banned] = float("-inf")
