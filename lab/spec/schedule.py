"""SpecSchedule: how many tokens to draft per request, given how many requests are running.

Speculation pays where a verify row is nearly free: at batch 1 on CPU a step streams the weights once,
so checking 2-3 more tokens costs little; at 16-32 requests the step is a GEMM whose cost grows with every
row, and each draft token is a row (the crossover sweep measures where each method falls below AR). So a
server drafts k tokens while the batch is small, fewer as it grows, and none past the crossover. vLLM's
`disable_by_batch_size` is the one-step case (k up to N running requests, 0 above).

    SpecSchedule.build(4, [[1, 2], [4, 1]])      # 2 drafts at 1 request, 1 at 2-4, none from 5
    SpecSchedule.build(2, None, disable_by_batch_size=4)   # 2 drafts up to 4 requests, none above

Owns: turning the engine's settings into a batch size -> k rule, and checking them. Ignores: drafting.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from lab.errors import LabError

_HINT = ("give engine.num_spec_tokens_by_batch_size as [[max running requests, k], ...] with the batch sizes "
         "increasing and every k <= engine.num_spec_tokens, e.g. [[1, 2], [4, 1]]; "
         "engine.disable_by_batch_size as a positive integer or null")


@dataclass(frozen=True, slots=True)
class SpecSchedule:
    steps: tuple[tuple[int, int], ...]   # (max running requests, k), batch sizes increasing; past the last: 0

    @classmethod
    def build(cls, num_spec_tokens: int, by_batch_size: Sequence[Sequence[int]] | None = None,
              disable_by_batch_size: int | None = None) -> "SpecSchedule":
        """num_spec_tokens at every batch size unless `by_batch_size` says otherwise; nothing above
        `disable_by_batch_size` running requests."""
        if by_batch_size is None:
            steps = [(sys.maxsize, num_spec_tokens)]   # every batch size
        else:
            if not len(by_batch_size):
                raise LabError("engine.num_spec_tokens_by_batch_size is empty",
                               "set engine.num_spec_tokens=0 to draft nothing, or null to draft at every batch size")
            steps = []
            for entry in by_batch_size:
                if not hasattr(entry, "__len__") or len(entry) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry):
                    raise LabError(f"engine.num_spec_tokens_by_batch_size entry {entry} is not [batch size, k]",
                                   _HINT)
                max_running, k = entry
                if max_running < 1 or not 0 <= k <= num_spec_tokens:
                    raise LabError(f"engine.num_spec_tokens_by_batch_size entry [{max_running}, {k}]: batch size must be "
                                   f">= 1 and k in 0..{num_spec_tokens} (engine.num_spec_tokens)", _HINT)
                if steps and max_running <= steps[-1][0]:
                    raise LabError(f"engine.num_spec_tokens_by_batch_size: batch size {max_running} does not follow "
                                   f"{steps[-1][0]}", _HINT)
                steps.append((max_running, k))
        if disable_by_batch_size is not None:
            if isinstance(disable_by_batch_size, bool) or not isinstance(disable_by_batch_size, int) \
                    or disable_by_batch_size < 1:
                raise LabError(f"engine.disable_by_batch_size must be a positive integer, got {disable_by_batch_size!r}",
                               _HINT)
            capped = []
            for max_running, k in steps:                 # increasing: cut at the first that reaches the limit
                capped.append((min(max_running, disable_by_batch_size), k))
                if max_running >= disable_by_batch_size:
                    break
            steps = capped
        return cls(tuple(steps))

    def num_spec_tokens(self, num_running: int) -> int:
        """Draft tokens per request while `num_running` requests are running."""
        for max_running, k in self.steps:
            if num_running <= max_running:
                return k
        return 0
