"""NgramProposer (proposer=ngram): prompt lookup. Find the most recent earlier occurrence of the context's
last n tokens (n from max_n down to min_n) and propose the k tokens that followed it.

Owns: matching over token ids. Ignores: models and caches (it drafts for free, q is one-hot).
"""

from __future__ import annotations

import numpy as np

from lab.errors import LabError


class NgramProposer:
    is_deterministic = True

    def __init__(self, min_n: int = 1, max_n: int = 4, short_match_tokens: int | None = None,
                 long_match_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise LabError(f"ngram proposer needs 1 <= min_n <= max_n, got {min_n}, {max_n}",
                           "e.g. engine.proposer.min_n=1 engine.proposer.max_n=4")
        if short_match_tokens is not None and short_match_tokens < 1:
            raise LabError(f"ngram proposer needs short_match_tokens >= 1 or null, got {short_match_tokens}",
                           "e.g. engine.proposer.short_match_tokens=2 (null: every match drafts k tokens)")
        self.min_n, self.max_n = min_n, max_n
        # NOTE: a match shorter than long_match_n tokens is a weaker guess: it drafts at most
        # short_match_tokens (where verifying costs more per token than a decode, drafting k on every
        # one-token match wastes verify work; drafting none loses the matches that do continue).
        self.short_match_tokens, self.long_match_n = short_match_tokens, long_match_n

    def propose_one(self, token_ids: list[int], num_spec_tokens: int) -> list[int]:
        """Up to num_spec_tokens draft tokens continuing `token_ids` (empty when nothing matches)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # windows ending before the suffix itself: every start i with i + n <= length - 1
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)   # (length - n, n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n  # NOTE: the most recent match tends to continue best
                count = num_spec_tokens
                if self.short_match_tokens is not None and n < self.long_match_n:
                    count = min(count, self.short_match_tokens)
                return tokens[start:start + count].tolist()
        return []

    def propose(self, contexts: list[list[int]], num_spec_tokens: int) -> list[list[int]]:
        return [self.propose_one(context, num_spec_tokens) for context in contexts]
