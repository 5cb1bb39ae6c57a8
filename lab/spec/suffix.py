"""SuffixProposer (proposer=suffix): model-free drafting from what was already written, after SuffixDecoding
(Oliaro et al., 2024; vLLM's `suffix` method): prompt lookup that also remembers earlier requests and
drafts only as far as past text makes it likely.

Two tables count, for every run of the last n tokens (n = 1..max_n), which token came next: one per
running request (its prompt and output so far) and one global table over the last `max_cached_requests`
finished requests (prompts and outputs). A draft walks from the context's end: the longest suffix seen
before picks the most frequent continuation (local counts weigh `local_weight` times global ones; the
global table answers only suffixes of `global_min_n`+ tokens), and the walk stops when the product of the
chosen continuations' estimated probabilities, count / (total + 1), falls below `min_confidence`, or at
k tokens. So it drafts several tokens where earlier text is sure, and none where a one-token match is a
guess: on CPU every verified token costs a share of a step (docs/speculative.md).

Owns: the count tables. Ignores: models and caches (drafts are free and deterministic, q is one-hot).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from lab.errors import LabError
from lab.request import Request
from lab.spec.proposer import Draft

Counts = dict[int, int]


class ContinuationTable:
    """(n-token run) -> {next token: count}, for n = 1..max_n."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.counts: dict[tuple[int, ...], Counts] = {}

    def add(self, token_ids: list[int], start: int = 1, sign: int = 1) -> None:
        """Count (or with sign=-1 uncount) the continuation at every position from `start` on."""
        counts = self.counts
        for i in range(max(1, start), len(token_ids)):
            token = token_ids[i]
            for n in range(1, min(self.max_n, i) + 1):
                key = tuple(token_ids[i - n:i])
                nexts = counts.setdefault(key, {})
                count = nexts.get(token, 0) + sign
                if count > 0:
                    nexts[token] = count
                else:
                    nexts.pop(token, None)
                    if not nexts:
                        del counts[key]

    def get(self, key: tuple[int, ...]) -> Counts | None:
        return self.counts.get(key)


class SuffixProposer:
    feature_layers: tuple[int, ...] = ()

    def __init__(self, max_n: int = 6, min_confidence: float = 0.3, local_weight: float = 4.0,
                 global_min_n: int = 1, max_cached_requests: int = 256) -> None:
        if max_n < 1 or not 0.0 <= min_confidence <= 1.0 or local_weight < 0 or max_cached_requests < 0:
            raise LabError(f"suffix proposer needs max_n >= 1, 0 <= min_confidence <= 1, local_weight >= 0 and "
                           f"max_cached_requests >= 0; got {max_n}, {min_confidence}, {local_weight}, "
                           f"{max_cached_requests}", "e.g. engine.proposer.max_n=6 engine.proposer.min_confidence=0.3")
        self.max_n, self.min_confidence, self.local_weight = max_n, min_confidence, local_weight
        self.global_min_n, self.max_cached_requests = global_min_n, max_cached_requests
        self.global_table = ContinuationTable(max_n)
        self._cached: deque[list[int]] = deque()   # finished requests' tokens, oldest first
        self._local: dict[str, tuple[ContinuationTable, Request]] = {}
        self._indexed: dict[str, int] = {}         # tokens of each request already in its local table
        self.num_global_hits = self.num_proposals = 0

    # -- Proposer interface ----------------------------------------------------------------------------
    def propose(self, requests: list[Request], num_spec_tokens: int,
                generators: list[torch.Generator | None]) -> dict[str, Draft]:
        drafts = {}
        for request in requests:
            token_ids, probabilities = self.propose_with_probabilities(request, num_spec_tokens)
            drafts[request.request_id] = Draft(token_ids, confidence=probabilities)
        return drafts

    def free(self, request_id: str) -> None:
        """The request is done: its tokens join the global table (the oldest cached request leaves)."""
        entry = self._local.pop(request_id, None)
        self._indexed.pop(request_id, None)
        if entry is not None:
            self.remember(list(entry[1].all_token_ids))

    def remember(self, token_ids: list[int]) -> None:
        """A finished request's tokens (prompt and output) join the global table; the oldest cached one leaves."""
        if self.max_cached_requests == 0:
            return
        self.global_table.add(token_ids)
        self._cached.append(token_ids)
        while len(self._cached) > self.max_cached_requests:
            self.global_table.add(self._cached.popleft(), sign=-1)

    def reset_history(self) -> None:
        """Forget every finished request, and the counters (running requests keep their local tables)."""
        self.global_table = ContinuationTable(self.max_n)
        self._cached.clear()
        self.num_global_hits = self.num_proposals = 0

    def stats(self) -> dict[str, float]:
        return {"spec/suffix_cached_requests": len(self._cached),
                "spec/suffix_global_share": self.num_global_hits / max(1, self.num_proposals)}

    # -- drafting --------------------------------------------------------------------------------------
    def propose_one(self, request: Request, num_spec_tokens: int) -> list[int]:
        return self.propose_with_probabilities(request, num_spec_tokens)[0]

    def propose_with_probabilities(self, request: Request, num_spec_tokens: int) -> tuple[list[int], list[float]]:
        """The draft, and each token's estimated probability count / (total + 1) (the Draft's confidence: the
        largest of the counted continuations', since the walk takes the most frequent)."""
        token_ids = request.all_token_ids
        local = self._sync_local(request, token_ids)
        tail = list(token_ids[-self.max_n:])
        draft: list[int] = []
        probabilities: list[float] = []
        confidence = 1.0
        used_global = False
        while len(draft) < num_spec_tokens:
            token, probability, from_global = self._next_token(local, tail)
            if token is None or confidence * probability < self.min_confidence:
                break
            confidence *= probability
            used_global |= from_global
            draft.append(token)
            probabilities.append(probability)
            tail = tail[1:] + [token] if len(tail) == self.max_n else tail + [token]
        self.num_proposals += 1
        self.num_global_hits += int(used_global)
        return draft, probabilities

    def _sync_local(self, request: Request, token_ids: list[int]) -> ContinuationTable:
        """The request's own table, extended with the tokens it gained since the last draft."""
        if request.request_id not in self._local:
            self._local[request.request_id] = (ContinuationTable(self.max_n), request)
            self._indexed[request.request_id] = 0
        local = self._local[request.request_id][0]
        local.add(token_ids, start=self._indexed[request.request_id])
        self._indexed[request.request_id] = len(token_ids)
        return local

    def _next_token(self, local: ContinuationTable, tail: list[int]) -> tuple[int | None, float, bool]:
        """(most likely next token after the longest known suffix of `tail`, its estimated probability,
        whether the global table contributed); (None, 0, False) when no suffix was seen before."""
        for n in range(len(tail), 0, -1):
            key = tuple(tail[-n:])
            local_counts = local.get(key)
            global_counts = self.global_table.get(key) if n >= self.global_min_n else None
            if not local_counts and not global_counts:
                continue
            scores: dict[int, float] = {}
            for token, count in (local_counts or {}).items():
                scores[token] = self.local_weight * count
            for token, count in (global_counts or {}).items():
                scores[token] = scores.get(token, 0.0) + count
            token, best = max(scores.items(), key=lambda item: item[1])
            return token, best / (sum(scores.values()) + 1.0), bool(global_counts)
        return None, 0.0, False


@dataclass(slots=True)
class SuffixProposerConfig:
    """conf/engine/proposer/suffix.yaml."""

    max_n: int = 6
    min_confidence: float = 0.3
    local_weight: float = 4.0
    global_min_n: int = 1
    max_cached_requests: int = 256

    def build(self, target: object, kv: object) -> SuffixProposer:
        return SuffixProposer(self.max_n, self.min_confidence, self.local_weight, self.global_min_n,
                              self.max_cached_requests)
