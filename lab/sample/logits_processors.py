"""vLLM's built-in logits processors, applied to the raw logits before temperature, top-k and top-p, so greedy
decoding takes the processed argmax (logprobs stay the raw ones, as vLLM's default):

- repetition_penalty r (HF's and vLLM's): every token in the prompt or the output so far has its logit divided by
  r where positive and multiplied by r where negative (r > 1 discourages repeats; 1 is off);
- frequency_penalty f: minus f times the token's count in the output so far (OpenAI's; 0 is off);
- presence_penalty p: minus p for every token the output already holds (OpenAI's; 0 is off);
- logit_bias {token id: b}: plus b (OpenAI's, -100 to 100);
- min_tokens m: until the output holds m tokens, its stop tokens (EOS unless ignore_eos, stop_token_ids) are
  banned (vLLM's).

Owns: that arithmetic. Ignores: sampling (lab/sample/sampler.py) and which engines apply it.
"""

from __future__ import annotations

import torch

from lab.request import Request, stop_ids


def apply_logits_processors(logits: torch.Tensor, requests: list[Request], eos_token_ids: set[int]) -> torch.Tensor:
    """logits (R, V), row i the next-token logits of requests[i] -> the same with each request's processors (a new
    tensor when any row has some; the input itself otherwise)."""
    rows = [i for i, request in enumerate(requests) if request.sampling_params.has_logits_processors]
    if not rows:
        return logits
    logits = logits.clone()
    vocab_size = logits.shape[-1]
    for i in rows:
        params, request, row = requests[i].sampling_params, requests[i], logits[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.prompt_token_ids) | set(request.output_token_ids)),
                                dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab_size]
            values = row[seen]
            row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if request.output_token_ids and (params.frequency_penalty or params.presence_penalty):
            outputs = torch.tensor(request.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(outputs, minlength=vocab_size)[:vocab_size].to(row.dtype)     # (V,)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
            row[ids] += torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=logits.device)
        if request.num_output_tokens < params.min_tokens:
            banned = [t for t in stop_ids(params, eos_token_ids) if t < vocab_size]
            row[banned] = float("-inf")
    return logits
