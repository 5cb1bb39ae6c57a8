"""Log-probabilities of generated tokens, for requests that ask for them (`SamplingParams.logprobs`).

As vLLM's default (`logprobs_mode=raw_logprobs`), they are the model's own distribution: log_softmax of the raw
logits, before temperature, top-k or top-p. A speculative step's tokens get the target's logits at their
positions (the verify forward computed them), so they equal what plain decoding reports.

Owns: turning logit rows into TokenLogprobs. Ignores: requests and how the logits were computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float                          # of token_id
    rank: int                               # 1 = the most likely token (vLLM's rank)
    top: tuple[tuple[int, float], ...]      # the `num_top` most likely (token id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """logits (T, V), row t the distribution token_ids[t] was chosen from -> one TokenLogprobs per row."""
    logprobs = torch.log_softmax(logits[:len(token_ids)].float(), dim=-1)                    # (T, V)
    chosen = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    chosen_logprobs = logprobs.gather(1, chosen[:, None])                                    # (T, 1)
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1                                     # (T,)
    top_values, top_ids = torch.topk(logprobs, num_top, dim=-1) if num_top else (logprobs[:, :0],) * 2
    rows = zip(token_ids, chosen_logprobs[:, 0].tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist())
    return [TokenLogprobs(token_id, logprob, rank, tuple(zip(ids, values)))
            for token_id, logprob, rank, ids, values in rows]
