"""Arrival processes, vLLM's: `request_rate` requests/s (inf = everything at t0) with gamma-distributed
inter-arrival gaps of shape `burstiness` (1 = Poisson; < 1 burstier, > 1 more uniform; inf = evenly spaced),
seeded. As in vLLM's `bench serve` (since v0.10), each of the N requests waits one gap and the offsets are
rescaled so the last request is sent at exactly N / rate: every seed offers the same load, so throughputs
compare across seeds.

Owns: arrival offsets. Ignores: what the requests contain. `max_concurrency` (closed loop) is applied by
the engine's run loop, which holds a request back until one in flight finishes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lab.errors import LabError
from lab.request import Request


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise LabError(f"workload.request_rate must be > 0 (or inf), got {self.request_rate}",
                           "use inf to send every request at t0, or a positive rate in requests/s")
        if not self.burstiness > 0:
            raise LabError(f"workload.burstiness must be > 0, got {self.burstiness}", "use 1.0 for Poisson arrivals")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise LabError(f"workload.max_concurrency must be >= 1 or null, got {self.max_concurrency}",
                           "use null for an open loop")

    def offsets(self, num_requests: int) -> list[float]:
        """Arrival offsets in seconds from the start of the run (vLLM's `get_request` delays)."""
        if math.isinf(self.request_rate) or num_requests == 0:
            return [0.0] * num_requests
        if math.isinf(self.burstiness):
            gaps = np.full(num_requests, 1.0 / self.request_rate)
        else:
            rng = np.random.default_rng(self.seed)
            theta = 1.0 / (self.request_rate * self.burstiness)  # gamma scale: mean gap = 1 / rate
            gaps = rng.gamma(shape=self.burstiness, scale=theta, size=num_requests)
        arrivals = np.cumsum(gaps)
        if arrivals[-1] > 0:
            # NOTE: vLLM's rescale: summed gaps miss N / rate by a few %, which moves throughput between seeds
            arrivals *= (num_requests / self.request_rate) / arrivals[-1]
        return arrivals.tolist()

    def assign(self, requests: list[Request]) -> list[Request]:
        for request, offset in zip(requests, self.offsets(len(requests))):
            request.arrival_time = offset
        return requests
