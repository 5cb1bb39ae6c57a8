"""Labelled ranges (schedule, prepare_inputs, prefill, decode, attention, sample, draft, verify).

NOTE: a `record_function` costs a few microseconds even with no profiler attached; ranges are no-ops
until a profiler turns them on, so the per-layer `attention` label is free in normal runs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch.profiler import record_function

_ENABLED = False
_NULL = nullcontext()


def set_ranges_enabled(enabled: bool) -> None:
    global _ENABLED
    _ENABLED = enabled


def profile_range(name: str) -> AbstractContextManager[object]:
    return record_function(name) if _ENABLED else _NULL
