"""GoodputPolicy (engine.draft_policy=goodput): how many of each request's drafts a verify step checks, chosen per
step to maximise the expected tokens per second, from what this engine measured on this machine.

A drafted token pays only if the chance it is accepted is worth what its verify row costs. That price depends on
the machine and the batch: on a GPU extra rows are nearly free (docs/speculative.md, session 15); on this CPU with
the GGUF blocks a batch-1 decode step is compute-bound and a second row costs ~20 % of a step, a third ~30 %
(docs/speculative.md, session 31); at 16-32 requests the step is a GEMM whose every row costs. A static k (or
vLLM's `disable_by_batch_size`) fits one of these; the policy learns them all while it serves:

- **StepCostModel**: the seconds of a pure decode / verify step by its number of query rows, an exponential
  moving average per row count (started at the median of its first three), interpolated between the counts
  measured, so a batch of 32 whose verify steps hold 33-96 rows learns them from a few. Past the largest count
  measured (recently), rows look free, so they get tried: the policy explores its way to the real prices.
  Calibrated before serving (`engine.goodput_calibration`, SpeculativeEngine.calibrate: verify steps timed at a
  ladder of row counts up to the largest batch it will serve), those prices are known from the first step: they
  stand for every count not measured recently, scaled by how the ones that were compare with them (the machine's
  load, longer contexts), so a short run spends none of itself exploring.
- **AcceptanceModel**: the chance a draft is accepted given the drafts before it were, by position and, for
  drafters that report one (EAGLE, DFlash), by their confidence (the drafted distribution's largest probability)
  in tenths; a Beta prior centred on the confidence itself until the counts speak (on 1.0 without one:
  optimistic, so a drafter that reports none is tried until its record says otherwise).
- **choose**: with the batch's base rows (one per request) and per request the chance its first n drafts are all
  accepted (a product, so falling with n), adding drafts in order of that chance, which keeps each request's a
  prefix, and keeping the prefix of the order with the most expected tokens per second, draft time included.
- **Whether to draft at all**: the draft is paid before the choice. Each window of drafted steps (64
  request-steps: 64 steps at batch 1, 2 at batch 32) is weighed against plain steps emitting the same tokens;
  where drafting lost, the engine stops drafting for a while, then tries a window again (past the crossover, or on
  text the drafter cannot guess). Before drafting it measures a plain step of at most the batch's size.
- **Whether a cascade's fallback pays** (suffix decoding, then DFlash where it has nothing): the same verdict over
  the requests the fallback drafted, its draft seconds and the rows its drafts added against the tokens they
  added; where it lost, the cascade drafts with its primary alone for a while.

Lossless like the confidence gate: how many drafts are verified never changes which token is emitted (greedy), and
the inputs are the drafted distribution's maximum and past outcomes, never the drawn token (sampling).

Owns: the cost and acceptance statistics and the choice. Ignores: drafting, verifying (the engine feeds it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

CONFIDENCE_BINS = 10


@dataclass(slots=True)
class StepCostModel:
    smoothing: float = 0.2          # weight of a new measurement in a row count's moving average
    first_samples: int = 3          # a row count's average starts at the median of its first few (a first step pays
                                    #   one-off costs); until then the lower median of what it has stands for it
    stale_after: int = 200          # steps after which a row count's estimate counts as unmeasured again
    seconds: dict[int, float] = field(default_factory=dict)    # rows -> moving average of a step's seconds
    samples: dict[int, list[float]] = field(default_factory=dict)   # rows -> its first measurements
    last_seen: dict[int, int] = field(default_factory=dict)    # rows -> the step it was last measured at
    num_steps: int = 0
    prior: dict[int, float] = field(default_factory=dict)      # rows -> seconds calibrated before serving (increasing
                                                               #   rows); never stale

    def observe(self, rows: int, seconds: float) -> None:
        self.num_steps += 1
        self.last_seen[rows] = self.num_steps
        if rows in self.seconds:
            self.seconds[rows] += self.smoothing * (seconds - self.seconds[rows])
            return
        first = self.samples.setdefault(rows, [])
        first.append(seconds)
        if len(first) == self.first_samples:
            self.seconds[rows] = sorted(first)[len(first) // 2]
            del self.samples[rows]

    def estimates(self) -> dict[int, float]:
        """Row count -> its estimate, increasing: the counts measured in the last `stale_after` steps, and the
        calibrated `prior` for the others, scaled by how the measured compare with it (their sum over the prior's at
        the same counts: one factor, so one noisy count does not move its neighbours alone)."""
        table = {**{rows: sorted(first)[(len(first) - 1) // 2] for rows, first in self.samples.items()},
                 **self.seconds}
        recent = self.num_steps - self.stale_after
        measured = {rows: table[rows] for rows in table if self.last_seen[rows] >= recent}
        if not self.prior:
            return {rows: measured[rows] for rows in sorted(measured)}
        scale = (sum(measured.values()) / sum(interpolate(self.prior, rows) for rows in measured)) if measured else 1.0
        merged = {**{rows: seconds * scale for rows, seconds in self.prior.items()}, **measured}
        return {rows: merged[rows] for rows in sorted(merged)}

    def measured_up_to(self, rows: int) -> bool:
        """Whether a step of at most `rows` rows has been measured (recently) or calibrated."""
        return any(measured <= rows for measured in self.estimates())

    def cost(self, rows: int) -> float | None:
        """A step of `rows` query rows in seconds: measured; else interpolated between the nearest measured counts
        around it; past the largest measured, that one's (optimistic: more rows look free until tried); below the
        smallest, the smallest's. Counts not measured for `stale_after` steps are left out (so tried again) unless
        calibrated. None before any count is measured or calibrated."""
        return interpolate(self.estimates(), rows)


def calibration_rows(max_rows: int) -> list[int]:
    """The row counts a calibration times, increasing: every count up to 8, then ~4 a doubling (10, 12, 14, 16, 20,
    24, 28, 32, 40, ...), and `max_rows`. Interpolation fills the counts between (a step's cost is close to linear in
    its rows between a few of them)."""
    rows, counts = 1, []
    while rows < max_rows:
        counts.append(rows)
        rows += max(1, 2 ** (rows.bit_length() - 3))
    return counts + [max_rows]


def calibrated_prior(samples: dict[int, list[float]]) -> dict[int, float]:
    """A calibration's timings (row count -> a step's seconds, a few each) -> StepCostModel.prior: each count's median,
    then the closest sequence that never falls with the rows (isotonic regression: runs of counts that fall are
    pooled to their mean), since a count that timed low would make its extra rows look free to `choose`."""
    rows = sorted(samples)
    pools: list[list[float]] = []   # [mean, number of counts]
    for count in rows:
        pools.append([sorted(samples[count])[len(samples[count]) // 2], 1])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (high, n_high), (low, n_low) = pools.pop(-2), pools.pop()
            pools.append([(high * n_high + low * n_low) / (n_high + n_low), n_high + n_low])
    means = [mean for mean, n in pools for _ in range(int(n))]
    return dict(zip(rows, means))


def interpolate(table: dict[int, float], rows: int) -> float | None:
    """StepCostModel.cost over a table of its estimates (row counts increasing)."""
    if not table:
        return None
    below = [r for r in table if r <= rows]
    above = [r for r in table if r > rows]
    if not below:
        return table[above[0]]
    low = below[-1]
    if low == rows or not above:
        return table[low]
    high = above[0]
    return table[low] + (table[high] - table[low]) * (rows - low) / (high - low)


@dataclass(slots=True)
class AcceptanceModel:
    prior_strength: float = 4.0     # the prior counts as this many observations
    counts: dict[tuple[int, int], list[float]] = field(default_factory=dict)   # (position, bin) -> [accepted, seen]

    @staticmethod
    def _bin(confidence: float | None) -> int:
        return -1 if confidence is None else min(int(confidence * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)

    def estimate(self, position: int, confidence: float | None) -> float:
        """P(draft `position` (0-based) is accepted | the drafts before it were)."""
        prior = 1.0 if confidence is None else confidence
        accepted, seen = self.counts.get((position, self._bin(confidence)), (0.0, 0.0))
        return (accepted + self.prior_strength * prior) / (seen + self.prior_strength)

    def observe(self, confidences: list[float | None], num_accepted: int) -> None:
        """A verified chain: drafts 0..num_accepted-1 accepted, draft num_accepted (if any) rejected; the ones
        after it were never judged."""
        for position, confidence in enumerate(confidences[:num_accepted + 1]):
            entry = self.counts.setdefault((position, self._bin(confidence)), [0.0, 0.0])
            entry[0] += position < num_accepted
            entry[1] += 1


def choose(base_rows: int, chances: list[list[float]], cost: Callable[[int], float],
           fixed_seconds: float) -> list[int]:
    """How many drafts each request verifies. base_rows: the step's rows without drafts; chances[r][i]: the chance
    request r's drafts 0..i are all accepted (non-increasing in i); cost(rows) -> seconds; fixed_seconds: what the
    step costs besides its rows (the draft, the engine's overhead). Returns per request n."""
    order = sorted(((chance, position, r) for r, row in enumerate(chances) for position, chance in enumerate(row)),
                   key=lambda item: (-item[0], item[1]))
    tokens, best_rate, best_n = float(base_rows), base_rows / (cost(base_rows) + fixed_seconds), 0
    for n, (chance, _, _) in enumerate(order, 1):
        tokens += chance
        rate = tokens / (cost(base_rows + n) + fixed_seconds)
        if rate > best_rate:
            best_rate, best_n = rate, n
    lengths = [0] * len(chances)
    for _, _, r in order[:best_n]:
        lengths[r] += 1
    return lengths


@dataclass(slots=True)
class Verdict:
    """Whether a kind of drafting pays, judged a window at a time: each window of `window` request-steps it drafted
    weighs the modelled seconds it spent (its draft, its verify rows) against the modelled seconds plain steps would
    have needed for the tokens it added; where it spent more, it pauses for `pause` steps, then tries a window again.
    With `early`, a window that has spent `clear_loss` times what it saved after `early` request-steps ends there: a
    drafter that plainly loses stops within a short job, one near the line is judged on the whole window."""

    window: int = 64                 # request-steps (requests x steps) of drafting per verdict
    pause: int = 64                  # steps without it after a verdict that it did not pay
    early: int = 0                   # request-steps after which a clear loss is a verdict (0: never early)
    clear_loss: float = 1.5
    paused_until: int = 0
    requests: int = 0                # this window so far: request-steps drafted,
    spent_s: float = 0.0             #   the modelled seconds the drafting cost,
    saved_s: float = 0.0             #   and those plain steps would have needed for the tokens it added

    def paused(self, step: int) -> bool:
        return step < self.paused_until

    def observe(self, step: int, num_requests: int, spent_s: float, saved_s: float) -> None:
        self.requests += num_requests
        self.spent_s += spent_s
        self.saved_s += saved_s
        clear_loss = 0 < self.early <= self.requests and self.spent_s > self.clear_loss * self.saved_s
        if self.requests >= self.window or clear_loss:
            if self.spent_s > self.saved_s:
                self.paused_until = step + self.pause
            self.requests, self.spent_s, self.saved_s = 0, 0.0, 0.0


@dataclass(slots=True)
class GoodputPolicy:
    costs: StepCostModel = field(default_factory=StepCostModel)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    drafting: Verdict = field(default_factory=Verdict)   # whether drafting at all pays
    # NOTE: whether a cascade's fallback drafter pays (CascadeProposer). It drafts for only some requests of a step
    # (those the primary has nothing for), so a window fills slowly; where it plainly loses (DFlash behind suffix
    # decoding at 4 requests here) an early verdict stops it within a short job
    fallback: Verdict = field(default_factory=lambda: Verdict(early=16))
    draft_seconds: float = 0.0       # moving average of one draft phase
    # NOTE: moving average of a step's seconds outside its timed phases (scheduling, sampling, the engine's Python):
    # a token a draft saves saves a share of it too, and every step pays it whatever it verifies
    step_overhead_s: float = 0.0
    num_choices: int = 0
    num_drafts_offered: int = 0
    num_drafts_kept: int = 0
    num_steps: int = 0               # draft opportunities (steps after which the engine may draft)
    num_steps_paused: int = 0
    num_fallback_paused: int = 0     # of them, steps drafted without the cascade's fallback
    fallback_resumes: bool = False   # the step being drafted calls the fallback again after a pause (either verdict's)
    fallback_idle: bool = False      # the last draft opportunity did not call the fallback (a pause)

    def should_draft(self, num_requests: int) -> bool:
        """Whether to draft for the next step of `num_requests` requests: not before a plain step of at most that
        many rows is measured (the price every draft is weighed against; so the first steps at a new, smaller batch
        size run plain), and not while a verdict said drafting does not pay (the draft itself costs a share of a
        step, and past the crossover no choice of drafts earns it back)."""
        self.num_steps += 1
        if self.drafting.paused(self.num_steps) or not self.costs.measured_up_to(num_requests):
            self.num_steps_paused += 1
            self.fallback_idle = True
            return False
        return True

    def should_draft_fallback(self) -> bool:
        """Whether the step being drafted (should_draft said yes) calls a cascade's fallback drafter: not while its
        verdict said its drafts do not pay for their draft and rows (at 4 requests on a CPU without AMX, DFlash's
        drafts behind suffix decoding's: docs/speculative.md, session 64)."""
        paused = self.fallback.paused(self.num_steps)
        self.fallback_resumes, self.fallback_idle = not paused and self.fallback_idle, paused
        self.num_fallback_paused += paused
        return not paused

    def observe_verify(self, num_requests: int, rows: int, num_tokens: int) -> None:
        """A decode step that followed a draft: `num_requests` requests, `rows` query rows, `num_tokens` emitted.
        Against plain steps emitting as many tokens at the modelled costs (draft included): a window of
        request-steps that took longer pauses drafting (Verdict)."""
        table = self.costs.estimates()
        if not table:
            return
        plain, verify = interpolate(table, num_requests), interpolate(table, rows)
        self.drafting.observe(self.num_steps, num_requests, verify + self.draft_seconds - plain,
                              (num_tokens - num_requests) * (plain + self.step_overhead_s) / num_requests)

    def observe_fallback(self, num_requests: int, rows: int, num_drafted: int, fallback_rows: int,
                         fallback_accepted: int, fallback_seconds: float) -> None:
        """The same step, for the `num_drafted` requests a cascade's fallback drafted (`fallback_seconds` of the draft
        phase): the rows its drafts added to a step of `rows` and its seconds, against the tokens they added (the
        accepted ones: the step's own token would have come anyway) at a plain step's price each. The first step after
        a pause is left out: a feature drafter then first reads the context it skipped (DFlash projects every position
        since its last draft), work that any later draft would pay and that is no price of drafting from then on."""
        table = self.costs.estimates()
        if not table or not num_drafted or self.fallback_resumes:
            return
        plain = interpolate(table, num_requests) + self.step_overhead_s
        rows_s = interpolate(table, rows) - interpolate(table, rows - fallback_rows)
        self.fallback.observe(self.num_steps, num_drafted, rows_s + fallback_seconds,
                              fallback_accepted * plain / num_requests)

    def observe_draft(self, seconds: float) -> None:
        self.draft_seconds = self._averaged(self.draft_seconds, seconds)

    def observe_step_overhead(self, seconds: float) -> None:
        self.step_overhead_s = self._averaged(self.step_overhead_s, seconds)

    def _averaged(self, previous: float, seconds: float) -> float:
        """A moving average's next value (its first measurement starts it)."""
        return seconds if not previous else previous + self.costs.smoothing * (seconds - previous)

    def lengths(self, base_rows: int, confidences: list[list[float | None]]) -> list[int] | None:
        """Per request how many of its drafts (confidences: one per draft, None where the drafter gives none) to
        verify; None while no step has been measured yet (verify them all: that measures one)."""
        table = self.costs.estimates()
        if not table:
            return None
        chances = []
        for row in confidences:
            chance, prefix = 1.0, []
            for position, confidence in enumerate(row):
                chance *= self.acceptance.estimate(position, confidence)
                prefix.append(chance)
            chances.append(prefix)
        lengths = choose(base_rows, chances, lambda rows: interpolate(table, rows),
                         self.draft_seconds + self.step_overhead_s)
        self.num_choices += 1
        self.num_drafts_offered += sum(map(len, confidences))
        self.num_drafts_kept += sum(lengths)
        return lengths

    def stats(self) -> dict[str, float]:
        stats = {"spec/goodput_kept_draft_share": self.num_drafts_kept / max(1, self.num_drafts_offered),
                 "spec/goodput_paused_share": self.num_steps_paused / max(1, self.num_steps),
                 "spec/goodput_fallback_paused_share": self.num_fallback_paused / max(1, self.num_steps),
                 "spec/goodput_calibrated_max_rows": max(self.costs.prior, default=0)}
        measured = self.costs.estimates()
        for rows in list(measured)[:8]:   # NOTE: relative to the fewest rows measured (a plain batch-1 step: 1 row)
            stats[f"spec/goodput_step_cost/{rows}_rows"] = measured[rows] / next(iter(measured.values()))
        return stats
