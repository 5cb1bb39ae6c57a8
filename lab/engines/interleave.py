"""run_interleaved: two (or more) engines serve their own copies of the same requests in one process, taking
turns step by step, each timed on its own clock. What `engine.speedup_turns=steps` measures speedups with.

Turns by chunks of requests (ABBA, `engine.speedup_rounds`) cancel a drift of the machine's speed only at the scale
of a chunk, and a batch of 16-32 requests is a single chunk: what another process on the machine does during the
baseline's half of the run and not during the other's goes straight into the ratio (the crossover's cells swung
+-10-25 % from it). Here the turns are steps (milliseconds), so whatever slows the machine slows every engine alike.

- **Whose turn**: the engine with the fewest output tokens so far (ties: the one that waited longest). Every engine
  serves the same requests, so they move through the work side by side, a speculative engine stepping less often
  for the same tokens, and all finish at about the same moment: none runs its last stretch alone.
- **Own clocks**: each engine's timestamps (arrivals, first schedules, tokens, finishes, its run's start) are moved
  onto a clock that runs only while that engine steps: the other engines' steps, and this loop between turns, are
  taken out. So TTFT, TPOT, ITL, E2EL and the duration are what the engine would show alone on the same machine.

Needs every request to arrive at t = 0 (a closed loop or `request_rate=inf`): with arrivals over time an engine
would wait for a request while another steps, and the schedule itself runs on wall-clock time.

Owns: the turn order and the clock mapping. Ignores: what the engines compute (each is its own `Engine.serve`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Generator
from dataclasses import dataclass, field

from lab.engines.base import Engine, RunResult
from lab.errors import LabError
from lab.request import Request


@dataclass(slots=True)
class OwnClock:
    """The wall-clock intervals one engine stepped in; `own(t)` maps a wall-clock time inside one of them to the
    engine's own time: the seconds it had stepped by then."""
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    stepped_before: list[float] = field(default_factory=list)   # own seconds before each interval
    total: float = 0.0

    def add(self, start: float, end: float) -> None:
        self.starts.append(start)
        self.ends.append(end)
        self.stepped_before.append(self.total)
        self.total += end - start

    def own(self, t: float) -> float:
        """A wall-clock time -> own seconds: inside an interval, its own time there; between intervals, the own time
        at the end of the one before (a time before the first maps to 0)."""
        i = bisect.bisect_right(self.starts, t) - 1
        if i < 0:
            return 0.0
        return self.stepped_before[i] + min(t, self.ends[i]) - self.starts[i]

    def move(self, result: RunResult) -> RunResult:
        """The run's timestamps, in place, and its start and duration onto this clock."""
        own = self.own
        for request in result.requests:
            request.arrival_time = own(request.arrival_time)
            if request.first_scheduled_time is not None:
                request.first_scheduled_time = own(request.first_scheduled_time)
            request.token_times = [own(t) for t in request.token_times]
            if request.finished_time is not None:
                request.finished_time = own(request.finished_time)
        start = own(result.start_time)
        return RunResult(result.requests, start, own(result.start_time + result.duration) - start)


def arrive_at_once(requests: list[Request]) -> bool:
    """Whether every request arrives at the same time (a closed loop or request_rate=inf): what turns by steps need."""
    return len({r.arrival_time for r in requests}) <= 1


def check_interleavable(engines: list[Engine], request_sets: list[list[Request]]) -> None:
    """Refuse what turns by steps cannot measure: arrivals over time, and engines with a run loop of their own."""
    for engine in engines:
        if type(engine).serve is not Engine.serve or type(engine).run is not Engine.run:
            raise LabError(f"engine {engine.name} has a run loop of its own, so it cannot take turns step by step",
                           "set engine.speedup_turns=chunks")
    for requests in request_sets:
        if not arrive_at_once(requests):
            raise LabError("engine.speedup_turns=steps needs every request to arrive at once (a closed loop or "
                           "workload.request_rate=inf), but this workload's requests arrive over time",
                           "set engine.speedup_turns=chunks (or auto) for arrivals over time")


def run_interleaved(engines: list[Engine], request_sets: list[list[Request]], max_concurrency: int | None
                    ) -> list[RunResult]:
    """engines[i] serves request_sets[i] (copies of the same requests), turns step by step as the module docstring
    says -> each engine's RunResult on its own clock."""
    check_interleavable(engines, request_sets)
    loops: list[Generator[None, None, RunResult] | None] = [
        engine.serve(requests, max_concurrency) for engine, requests in zip(engines, request_sets)]
    clocks = [OwnClock() for _ in engines]
    results: list[RunResult | None] = [None] * len(engines)
    last_turn = [0] * len(engines)
    turn = 0
    while any(loop is not None for loop in loops):
        live = [i for i, loop in enumerate(loops) if loop is not None]
        i = min(live, key=lambda j: (sum(r.num_output_tokens for r in request_sets[j]), last_turn[j]))
        turn += 1
        last_turn[i] = turn
        start = time.perf_counter()
        try:
            next(loops[i])
        except StopIteration as done:
            results[i] = done.value
            loops[i] = None
        clocks[i].add(start, time.perf_counter())
    return [clock.move(result) for clock, result in zip(clocks, results)]
