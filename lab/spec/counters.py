"""SpecCounters: the cumulative draft and acceptance counts of a speculative engine, in vLLM's terms
(`spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`, `_num_accepted_tokens_per_pos`), and
what a window of them says (acceptance rate and length, per-position rates).

Owns: the counts a server exports on /metrics and a benchmark client reads back as before/after deltas.
Ignores: how they are counted (the engine) and how they travel (Prometheus text, lab/serve and lab/bench).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest
from typing import Any


@dataclass(frozen=True, slots=True)
class SpecCounters:
    num_drafts: int = 0                           # requests' drafts verified (one per request and step)
    num_draft_tokens: int = 0                     # draft tokens verified
    num_accepted_tokens: int = 0                  # of those, accepted
    accepted_per_position: tuple[int, ...] = ()   # accepted at draft position 0, 1, ... (k entries)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        """Two engines' counts together (replicas)."""
        return SpecCounters(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                            self.num_accepted_tokens + other.num_accepted_tokens,
                            _add(self.accepted_per_position, other.accepted_per_position))

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        """What happened since `earlier` (a snapshot of the same counters)."""
        return SpecCounters(self.num_drafts - earlier.num_drafts,
                            self.num_draft_tokens - earlier.num_draft_tokens,
                            self.num_accepted_tokens - earlier.num_accepted_tokens,
                            _add(self.accepted_per_position, tuple(-n for n in earlier.accepted_per_position)))

    def summary(self) -> dict[str, Any]:
        """vLLM's derived figures under `vllm bench serve`'s result names: acceptance rate (%) = accepted /
        drafted tokens, acceptance length = 1 + accepted / drafts (the bonus token included), and per position
        the share of drafts whose token there was accepted."""
        drafts = max(1, self.num_drafts)
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_draft_tokens": self.num_draft_tokens,
                "spec_decode_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_acceptance_rate": 100.0 * self.num_accepted_tokens / max(1, self.num_draft_tokens),
                "spec_decode_acceptance_length": 1.0 + self.num_accepted_tokens / drafts,
                "spec_decode_per_position_acceptance_rates": [accepted / drafts
                                                              for accepted in self.accepted_per_position]}


def _add(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip_longest(a, b, fillvalue=0))
