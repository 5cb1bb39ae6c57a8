"""MetricsSuite (conf/metrics/): which numbers a run reports and how: percentiles, SLOs for goodput,
per-request detail, the utilization sampler. Owns: turning a finished run into results.json's fields.
Ignores: engine internals beyond `engine.stats()`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from lab.engines.base import Engine, RunResult
from lab.metrics.summary import check_slo, detailed_lists, summarize

SCHEMA_VERSION = 1


class MetricsSuite:
    def __init__(self, percentiles: list[float] | tuple[float, ...] = (50, 90, 95, 99),
                 slo: dict[str, float | None] | None = None, save_detailed: bool = False,
                 utilization: bool = True, utilization_interval_s: float = 0.1) -> None:
        self.percentiles = tuple(float(p) for p in percentiles)
        self.slo = check_slo(slo)
        self.save_detailed = save_detailed
        self.utilization = utilization
        self.utilization_interval_s = utilization_interval_s
        self.sampler: Any | None = None

    def sample_utilization(self, device: torch.device) -> AbstractContextManager[Any]:
        """A context manager polling utilization in a separate process while the run goes on."""
        if not self.utilization:
            return nullcontext()
        from lab.metrics.utilization import UtilizationSampler

        self.sampler = UtilizationSampler(interval_s=self.utilization_interval_s, device=device)
        return self.sampler

    def summarize(self, outcome: RunResult, engine: Engine, tokenizer: Any | None) -> dict[str, Any]:
        results: dict[str, Any] = {"schema_version": SCHEMA_VERSION,
                                   **summarize(outcome.requests, outcome.duration, start=outcome.start_time,
                                               percentiles=self.percentiles, slo=self.slo),
                                   "slo": self.slo or None, **engine.stats()}
        if self.sampler is not None:
            results.update(self.sampler.summary())
        if self.save_detailed:
            results.update(detailed_lists(outcome.requests, tokenizer))
        return results
