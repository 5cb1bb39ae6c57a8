"""SpeculativeEngine (engine=speculative): continuous batching on the paged cache, plus a Proposer that
drafts k tokens per running request after every step; the next step's target forward verifies them all
(1 + k positions per request, every request in one flat batch) and the RejectionSampler keeps the output
exactly the target's (greedy: token for token; sampling: in distribution). A draft may be a tree (greedy
requests, lab/spec/tree.py): its nodes are verified in the same forward, each seeing its ancestors only, and the
accepted path's keys and features are moved to where a chain's would be.

Overrides one hook of ContinuousBatchingEngine (`select_tokens`: verify instead of sample) and appends a
draft phase to `step`. `num_spec_tokens=0` is the plain engine. How many tokens a step drafts can follow the
batch size (`num_spec_tokens_by_batch_size`, vLLM's `disable_by_batch_size`: lab/spec/schedule.py). Metrics
follow vLLM's spec-decode names. Logits processors and structured outputs apply to every verify row with the drafts
before it counted; under a grammar, the tokens it forces are drafted (`grammar_drafts`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from lab.engines.ar import AREngine
from lab.engines.base import Engine
from lab.engines.continuous import ContinuousBatchingEngine, StepBatch
from lab.errors import LabError
from lab.kv_cache import KVCacheConfig, PagedKVCacheConfig
from lab.kv_cache.tree_mask import MAX_TREE_TOKENS
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.runner.cuda_graphs import CudaGraphConfig
from lab.sample.logits_processors import apply_logits_processors_to_drafts
from lab.sample.rejection import RejectionSampler
from lab.sample.sampler import GreedyRows
from lab.sched import SchedulerConfig, SchedulerOutput
from lab.spec.counters import SpecCounters
from lab.spec.goodput import GoodputPolicy, StepCostModel, calibrated_prior, calibration_rows
from lab.spec.proposer import Draft, ProposerConfig, check_num_spec_tokens
from lab.spec.schedule import SpecSchedule
from lab.spec.tree import row_prefixes

SPEEDUP_BASELINES = frozenset({"engine", "ar"})   # what `measure_speedup` runs first: see baseline_engine
SPEEDUP_TURNS = frozenset({"auto", "steps", "chunks"})   # how it and the baseline take turns: lab/run.py run_measured
DRAFT_POLICIES = frozenset({"static", "goodput"})  # how many drafts a step verifies: see __init__
MAX_TREE_DRAFTS = MAX_TREE_TOKENS - 1                # the root and its drafts fit the attention's hidden-key bits
CALIBRATION_MAX_ROWS = 256   # the most rows engine.goodput_calibration times (past them the policy explores)
CALIBRATION_PROMPT_LEN = 16  # its placeholder requests' prompts
CALIBRATION_SAMPLES = 5      # steps timed per row count (their median)


class SpeculativeEngine(ContinuousBatchingEngine):
    # NOTE: a penalty or a grammar changes the target's distribution at every drafted position by the drafts before
    # it: each verify row is processed as if those drafts had been sampled (lab/sample/logits_processors.py)
    supports_logits_processors = True

    def __init__(self, runner: ModelRunner, proposer: ProposerConfig, num_spec_tokens: int = 4,
                 scheduler: SchedulerConfig | None = None, kv_cache: KVCacheConfig | None = None,
                 name: str | None = None, seed: int = 0, measure_speedup: bool = False,
                 speedup_rounds: int = 1, num_spec_tokens_by_batch_size: Sequence[Sequence[int]] | None = None,
                 disable_by_batch_size: int | None = None, cuda_graphs: CudaGraphConfig | None = None,
                 speedup_baseline: str = "engine", grammar_drafts: bool = True, draft_policy: str = "static",
                 speedup_turns: str = "auto", goodput_calibration: bool = True) -> None:
        """draft_policy: `static` verifies what the proposer drafts (k, or the schedule's k for the batch size, cut by
        the proposer's own confidence gate); `goodput` then keeps, per step, the drafts that maximise the expected
        tokens per second from the step costs and acceptance this engine has measured (lab/spec/goodput.py).
        goodput_calibration: under `goodput`, `calibrate` times verify steps before serving (else it explores)."""
        self._configs = (proposer, scheduler, kv_cache, cuda_graphs)
        # NOTE: prefix caching stays on for feature-reading drafters too: their features live in the KV blocks
        # (lab/spec/features.py), so a cached prompt block brings its features along. The KV memory budget pays
        # for what a proposer keeps per KV slot (features, a drafter's own KV), as vLLM's pays for draft layers.
        kv_cache = kv_cache or PagedKVCacheConfig()
        proposer_bytes = getattr(proposer, "kv_bytes_per_token", None)   # NOTE: proposers that keep per-slot state
        self.proposer_bytes_per_token = proposer_bytes(runner) if proposer_bytes is not None else 0
        super().__init__(runner, scheduler, kv_cache, name or "speculative", seed, cuda_graphs)
        self.measure_speedup = measure_speedup  # lab.run then also runs `without_speculation()` on the same work
        if speedup_rounds < 1:
            raise LabError(f"speedup_rounds must be >= 1, got {speedup_rounds}",
                           "use 1 (baseline run, then speculative run) or N (ABBA turns over N chunks)")
        self.speedup_rounds = speedup_rounds
        if speedup_turns not in SPEEDUP_TURNS:
            raise LabError(f"engine.speedup_turns must be one of {sorted(SPEEDUP_TURNS)}, got {speedup_turns!r}",
                           "use 'steps' (step by step, each engine on its own clock), 'chunks' (ABBA over "
                           "speedup_rounds chunks of the requests) or 'auto' (steps where every request arrives at "
                           "once, else chunks)")
        self.speedup_turns = speedup_turns
        if speedup_baseline not in SPEEDUP_BASELINES:
            raise LabError(f"speedup_baseline must be one of {sorted(SPEEDUP_BASELINES)}, got {speedup_baseline!r}",
                           "use 'engine' (this engine, speculation off) or 'ar' (the batch-1 AR engine)")
        self.speedup_baseline = speedup_baseline
        self.grammar_drafts = grammar_drafts   # a structured output's forced tokens are drafted (_with_forced_tokens)
        if draft_policy not in DRAFT_POLICIES:
            raise LabError(f"engine.draft_policy must be one of {sorted(DRAFT_POLICIES)}, got {draft_policy!r}",
                           "use 'static' (verify every draft the proposer keeps) or 'goodput' (keep the drafts worth "
                           "their verify rows, learnt online)")
        if num_spec_tokens < 0:
            raise LabError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}", "use 0 (off) to 8")
        self.num_spec_tokens = num_spec_tokens   # the most drafted per request; the schedule picks per step
        self.schedule = SpecSchedule.build(num_spec_tokens, num_spec_tokens_by_batch_size, disable_by_batch_size)
        self.proposer = proposer.build(runner, self.kv_manager)
        self.goodput = GoodputPolicy() if draft_policy == "goodput" and num_spec_tokens else None
        self.goodput_calibration = goodput_calibration
        # NOTE: a cascade whose fallback the policy may pause for a step (its verdict on the fallback)
        self._pausable_fallback = self.goodput is not None and getattr(self.proposer, "can_pause_fallback", False)
        if self.goodput is not None:
            _measure_confidence(self.proposer)
        check_num_spec_tokens(self.proposer, num_spec_tokens, "engine.num_spec_tokens", "this proposer", lowest=1)
        tree_drafts = getattr(self.proposer, "max_drafts", None)   # NOTE: proposers that draft trees
        max_drafts = tree_drafts(num_spec_tokens) if tree_drafts is not None else num_spec_tokens
        self.max_drafts = max_drafts   # the most draft rows one request's verify step holds
        if max_drafts > MAX_TREE_DRAFTS:
            raise LabError(f"a draft of up to {max_drafts} tokens (num_spec_tokens={num_spec_tokens} and the "
                           f"proposer's tree_width or tree_nodes) is more than a verify step's tree holds "
                           f"({MAX_TREE_DRAFTS})",
                           "lower engine.proposer.tree_width (or tree_nodes) or engine.num_spec_tokens")
        if self.decode_graphs is not None and num_spec_tokens:
            # NOTE: verify steps (1 + up to k drafts per request, more for a tree) replay graphs too, which also
            # return the features a feature-reading drafter observes.
            self.decode_graphs.configure(1 + max_drafts, tuple(self.proposer.feature_layers))
            if hasattr(self.proposer, "use_graphs"):   # NOTE: the drafter's forward too (DFlash)
                self.proposer.use_graphs(self.decode_graphs.mode, self.decode_graphs.capture_sizes,
                                         runner.max_model_len)
        self.rejection_sampler = RejectionSampler()
        self._drafts: dict[str, Draft] = {}
        self._drafted_last_step = False   # whether the next step verifies a draft phase's output (goodput policy)
        self._fallback_step = FallbackStep()   # what a cascade's fallback drafted for the next step (goodput policy)
        self._reset_spec_counters()

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys + values of one token over all layers, and what the proposer keeps beside them (the target features
        a drafter reads, a drafter's own KV)."""
        return super().kv_bytes_per_token + self.proposer_bytes_per_token

    def without_speculation(self) -> "SpeculativeEngine":
        """The same engine with speculation off (num_spec_tokens=0): the baseline for speedups."""
        proposer, scheduler, kv_cache, cuda_graphs = self._configs
        return SpeculativeEngine(self.runner, proposer, 0, scheduler, kv_cache, f"{self.name}_k0", self.seed,
                                 cuda_graphs=cuda_graphs)

    def baseline_engine(self, max_concurrency: int | None) -> Engine:
        """What `measure_speedup` compares against, run on the same requests in the same process:
        `without_speculation()` ('engine': the continuous-batching AR this engine is, at any concurrency) or
        the `ar` engine ('ar': our fastest batch-1 decoding, one request at a time, so only at concurrency 1)."""
        if self.speedup_baseline == "engine":
            return self.without_speculation()
        if max_concurrency != 1:
            raise LabError(f"speedup_baseline='ar' serves one request at a time, but max_concurrency is "
                           f"{max_concurrency}: its TPOT would be a batch-1 figure against a batched one",
                           "set workload.max_concurrency=1, or engine.speedup_baseline=engine for batches")
        return AREngine(self.runner, use_kv_cache=True, seed=self.seed)

    def calibrate(self, max_batch: int) -> dict[int, float]:
        """Under the goodput policy (engine.goodput_calibration): time verify steps at a ladder of row counts
        (calibration_rows) up to `max_batch` requests' worth of drafts, before serving, on placeholder requests that
        are then aborted; the batch grows by powers of two so every count holds a draft row or more per request.
        The policy then starts from these prices (StepCostModel.prior: each count's median of CALIBRATION_SAMPLES
        steps, never falling with the rows) instead of exploring them, which a short run cannot afford. Caches and
        counters are reset afterwards. -> the calibrated seconds by row count ({} where there is nothing to do)."""
        if self.goodput is None or not self.goodput_calibration or self.has_unfinished_requests():
            return {}
        batch = max(1, min(max_batch, self.scheduler.config.max_num_seqs))
        sizes = sorted({2 ** i for i in range(batch.bit_length()) if 2 ** i < batch} | {batch})
        ladder = calibration_rows(min(batch * (1 + self.max_drafts), CALIBRATION_MAX_ROWS))
        prompt = [(1000 + i) % self.runner.vocab_size for i in range(CALIBRATION_PROMPT_LEN)]
        # NOTE: what every step could add, within the context and with the whole batch in the cache at once
        max_tokens = max(1, min(self.runner.max_model_len, self.kv_manager.num_blocks * self.kv_manager.block_size
                                // batch) - CALIBRATION_PROMPT_LEN)
        max_tokens = min(max_tokens, len(ladder) * CALIBRATION_SAMPLES * (1 + self.max_drafts) + 1)
        placeholders: list[Request] = []
        timings: dict[int, list[float]] = {}
        try:
            for rows in ladder:
                if any(r.is_finished for r in placeholders):
                    break   # NOTE: a cache too small for the ladder: the counts past here are explored while serving
                size = max(s for s in sizes if s <= rows)
                while len(placeholders) < size:
                    placeholders.append(Request(f"calibration-{len(placeholders)}", list(prompt),
                                                SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
                    self.add_request(placeholders[-1])
                while any(r.num_computed_tokens < r.num_tokens - 1 for r in placeholders):
                    ContinuousBatchingEngine.step(self)   # NOTE: their prefill, not timed
                drafts = rows - size
                for _ in range(CALIBRATION_SAMPLES):
                    if any(r.is_finished for r in placeholders):
                        break
                    for i, request in enumerate(placeholders):
                        # NOTE: drafts of its last token: whether the verify accepts them does not change the rows
                        request.spec_token_ids = [request.all_token_ids[-1]] * (drafts // size + (i < drafts % size))
                    decode_s = self.phases.seconds["decode"]
                    ContinuousBatchingEngine.step(self)   # NOTE: a verify step as served, without the draft after it
                    timings.setdefault(rows, []).append(self.phases.seconds["decode"] - decode_s)
        finally:
            for request in placeholders:
                self.abort_request(request.request_id, "calibration placeholder")
                self.release_request_state(request.request_id)
            self.goodput.costs = StepCostModel(prior=calibrated_prior(timings))
            self.reset_caches()
            self.reset_stats()
        return dict(self.goodput.costs.prior)

    def _reset_spec_counters(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_target_forwards = self.num_emitted_tokens = 0
        self.num_steps_not_drafted = 0   # steps whose batch size the schedule drafts nothing for
        self.num_tree_off_chain = 0      # tree verifications that accepted a runner-up, not the chain
        self.num_forced_drafts = self.num_forced_draft_tokens = 0   # drafts a grammar forced
        self.accepted_per_position = [0] * self.num_spec_tokens
        self.acceptance_histogram = [0] * (self.num_spec_tokens + 1)

    def spec_counters(self) -> SpecCounters:
        """The draft and acceptance counts since the last reset_stats (what a server exports on /metrics)."""
        return SpecCounters(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                            tuple(self.accepted_per_position))

    def reset_caches(self) -> None:
        super().reset_caches()
        self.proposer.reset_history()

    def reset_stats(self) -> None:
        super().reset_stats()
        self._reset_spec_counters()

    # -- the target forward: also hands its features to drafters that read them ---------------------
    def forward(self, batch: StepBatch) -> torch.Tensor | GreedyRows:
        if not self.proposer.feature_layers or not self.num_spec_tokens:
            return super().forward(batch)
        logits, features = self.target_forward(batch, tuple(self.proposer.feature_layers))
        # NOTE: each row's features go where its keys and values just went: the step's slot mapping
        self.proposer.observe(self.kv_cache.index.slot_mapping, features)                # (N,), (N, F)
        return logits

    # -- verify (the hook) ---------------------------------------------------------------------------
    def select_tokens(self, out: SchedulerOutput, requests: list[Request],
                      logits: torch.Tensor | GreedyRows) -> dict[str, int | list[int]]:
        sampled: dict[str, int | list[int]] = {}
        row = 0
        self.num_target_forwards += 1
        for request in requests:
            spec = out.scheduled_spec_token_ids.get(request.request_id, [])
            rows = logits[row:row + 1 + len(spec)]                                       # (1 + k, V)
            row += 1 + len(spec)
            draft = self._drafts.pop(request.request_id, None)
            parents = out.scheduled_spec_parents.get(request.request_id)
            processed = rows   # NOTE: logprobs stay the raw rows' (vLLM's default); the verify reads these
            if request.sampling_params.has_logits_processors:
                processed = apply_logits_processors_to_drafts(rows, request, self.runner.eos_token_ids,
                                                              row_prefixes(spec, parents))
            if parents is not None:
                result = self.rejection_sampler.verify_tree_greedy(processed, spec, parents)
                self._keep_tree_path(request, result.path)
                # NOTE: path[0] follows the root (row 0), path[d] follows draft path[d - 1] (its row, + 1)
                self.record_logprobs(request, rows, [0] + [node + 1 for node in result.path], result.token_ids)
            else:
                probs = None if draft is None or draft.probs is None else draft.probs[:len(spec)]
                result = self.rejection_sampler.verify(processed, spec, request.sampling_params,
                                                       self.generator_for(request), probs)
                self.record_logprobs(request, rows, list(range(len(result.token_ids))), result.token_ids)
                if self.goodput is not None and spec and draft is not None and not draft.forced:
                    confidence = draft.confidence or [None] * len(spec)
                    self.goodput.acceptance.observe(confidence[:len(spec)], result.num_accepted)
            if request.request_id in self._fallback_step.request_ids and draft is not None and not draft.forced:
                self._fallback_step.rows += len(spec)
                self._fallback_step.accepted += result.num_accepted
            sampled[request.request_id] = result.token_ids
            self.num_emitted_tokens += len(result.token_ids)
            if spec:
                self._count(len(spec), result.num_accepted)
        return sampled

    def _keep_tree_path(self, request: Request, path: list[int]) -> None:
        """A tree's accepted drafts sit where the step stored them (draft i after the root at num_computed + 1 + i);
        move their keys, values and features to where a chain's would be (depth d at num_computed + d), so the
        next step, the cache and the drafter see the accepted sequence only."""
        start = request.num_computed_tokens + 1     # the first draft's slot; the root is at num_computed
        moves = [(start + node, start + depth) for depth, node in enumerate(path) if node != depth]
        if not moves:
            return
        self.num_tree_off_chain += 1
        src, dst = (list(positions) for positions in zip(*moves))
        self.kv_cache.move_tokens(self.kv_manager.block_table(request.request_id), src, dst)
        self.proposer.move_positions(request.request_id, src, dst)

    def _count(self, num_spec: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_spec
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        self.acceptance_histogram[num_accepted] += 1

    # -- draft -----------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        if self.goodput is not None:
            start, timed_s = time.perf_counter(), sum(self.phases.seconds.values())
        finished = super().step()
        for request in finished:
            self.proposer.free(request.request_id)
            self._drafts.pop(request.request_id, None)
        if self.num_spec_tokens:
            self._propose()
        if self.goodput is not None:   # NOTE: what the step spent outside its timed phases (goodput.step_overhead_s)
            self.goodput.observe_step_overhead(time.perf_counter() - start - (sum(self.phases.seconds.values())
                                                                              - timed_s))
        return finished

    def _propose(self) -> None:
        self._drafted_last_step = False
        num_spec_tokens = self.schedule.num_spec_tokens(len(self.scheduler.running))
        if (num_spec_tokens and self.goodput is not None and self.scheduler.running
                and not self.goodput.should_draft(len(self.scheduler.running))):
            num_spec_tokens = 0   # NOTE: the goodput policy found drafting does not pay now (lab/spec/goodput.py)
        if not num_spec_tokens:
            # NOTE: feature drafters still observe every target forward, so they draft again at once when
            # the batch shrinks; the skipped tokens are caught up like a cascade's fallback's.
            self.num_steps_not_drafted += bool(self.scheduler.running)
            return
        if self._pausable_fallback:
            self.proposer.fallback_paused = not self.goodput.should_draft_fallback()
        ready, rooms = [], []
        for request in self.scheduler.running:
            # NOTE: only requests past prefill draft; never past max_tokens (those drafts could not be kept).
            room = request.sampling_params.max_tokens - request.num_output_tokens - 1
            if request.num_computed_tokens == request.num_tokens - 1 and room > 0:
                ready.append(request)
                rooms.append(room)
        if not ready:
            return
        self._drafted_last_step = True
        draft_s = self.phases.seconds["draft"]
        with self.phases.phase("draft", num_tokens=len(ready) * num_spec_tokens):
            drafts = self.proposer.propose(ready, num_spec_tokens, [self.generator_for(r) for r in ready])
        kept: list[tuple[Request, Draft]] = []
        for request, room in zip(ready, rooms):
            draft, is_forced = drafts.get(request.request_id), False
            if self.grammar_drafts and request.grammar is not None:
                draft, is_forced = self._with_forced_tokens(request, draft)
            if draft is not None and draft.token_ids:
                draft.fit(min(num_spec_tokens, room), room)
                self.num_forced_drafts += is_forced
                self.num_forced_draft_tokens += len(draft.token_ids) if is_forced else 0
                draft.forced = is_forced
                kept.append((request, draft))
        if self.goodput is not None:
            self.goodput.observe_draft(self.phases.seconds["draft"] - draft_s)
            self._fit_to_goodput(kept)
        if self._pausable_fallback:
            self._fallback_step = FallbackStep(set(self.proposer.last_fallback_ids), self.proposer.last_fallback_s)
        for request, draft in kept:
            if draft.token_ids:
                request.spec_token_ids = list(draft.token_ids)
                request.spec_parents = None if draft.parents is None else list(draft.parents)
                self._drafts[request.request_id] = draft

    def _fit_to_goodput(self, kept: list[tuple[Request, Draft]]) -> None:
        """Cut each chain draft to what the goodput policy verifies (engine.draft_policy=goodput); trees and
        the tokens a grammar forces are kept whole and counted as the step's fixed rows."""
        chains = [(r, d) for r, d in kept if d.parents is None and not d.forced]
        fixed_rows = len(self.scheduler.running) + sum(len(d.token_ids) for _, d in kept
                                                       if d.parents is not None or d.forced)
        confidences = [d.confidence or [None] * len(d.token_ids) for _, d in chains]
        lengths = self.goodput.lengths(fixed_rows, confidences)
        if lengths is not None:
            for (_, draft), length in zip(chains, lengths):
                draft.fit(length, length)

    def _execute(self, out: SchedulerOutput) -> dict[str, int | list[int]]:
        if self.goodput is None:
            return super()._execute(out)
        decode_s, decode_steps = self.phases.seconds["decode"], self.phases.steps["decode"]
        sampled = super()._execute(out)
        if self.phases.steps["decode"] > decode_steps:   # NOTE: a pure decode / verify step: what its rows cost here
            rows = out.total_num_scheduled_tokens
            self.goodput.costs.observe(rows, self.phases.seconds["decode"] - decode_s)
            if self._drafted_last_step:
                self.goodput.observe_verify(len(sampled), rows, sum(
                    len(tokens) if isinstance(tokens, list) else 1 for tokens in sampled.values()))
                step = self._fallback_step
                self.goodput.observe_fallback(len(sampled), rows, len(step.request_ids & sampled.keys()), step.rows,
                                              step.accepted, step.seconds)
        self._fallback_step = FallbackStep()
        return sampled

    def _with_forced_tokens(self, request: Request, draft: Draft | None) -> tuple[Draft | None, bool]:
        """Under a structured output, the tokens its grammar forces next are drafts the verify accepts unless the
        target spells the same text with other tokens (SGLang's jump-forward decoding, kept lossless by verifying
        it): they replace a draft that disagrees with them; a chain that starts with them and goes on is kept.
        -> (the draft, whether the grammar made it)."""
        forced = request.grammar.forced_tokens(request.output_token_ids)
        if not forced or (draft is not None and draft.parents is None and draft.token_ids[:len(forced)] == forced):
            return draft, False
        return Draft(forced), True

    def abort_request(self, request_id: str, error: str = "aborted") -> Request | None:
        self.proposer.free(request_id)
        self._drafts.pop(request_id, None)
        return super().abort_request(request_id, error)

    def abort_running(self, error: str) -> list[Request]:
        aborted = super().abort_running(error)
        for request in aborted:
            self.proposer.free(request.request_id)
            self._drafts.pop(request.request_id, None)
        return aborted

    def stats(self) -> dict[str, float]:
        verify_s = sum(self.phases.seconds.get(p, 0.0) for p in ("prefill", "decode", "mixed"))
        stats = {**super().stats(), **self.proposer.stats(), **self.spec_counters().summary(),
                 "spec/num_spec_tokens": self.num_spec_tokens,
                 "spec/num_steps_not_drafted": self.num_steps_not_drafted,
                 "spec/tree_off_chain_accepts": self.num_tree_off_chain,
                 "spec/grammar_forced_drafts": self.num_forced_drafts,
                 "spec/grammar_forced_draft_tokens": self.num_forced_draft_tokens,
                 "spec/draft_s": self.phases.seconds.get("draft", 0.0), "spec/verify_s": verify_s,
                 "spec/tokens_per_target_forward": self.num_emitted_tokens / max(1, self.num_target_forwards)}
        for num_accepted, count in enumerate(self.acceptance_histogram):
            stats[f"spec/acceptance_histogram/{num_accepted}"] = count
        if self.goodput is not None:
            stats.update(self.goodput.stats())
        return stats


@dataclasses.dataclass(slots=True)
class FallbackStep:
    """What a cascade's fallback drafted for one step, for the goodput policy's verdict on it: the requests it drafted
    for, its seconds, and (filled in by the verify) the rows its kept drafts took and how many were accepted."""

    request_ids: set[str] = dataclasses.field(default_factory=set)
    seconds: float = 0.0
    rows: int = 0
    accepted: int = 0


def _measure_confidence(proposer: object) -> None:
    """Have the proposer's drafters (a cascade's both) report their confidences with each draft, cutting nothing."""
    for part in (proposer, getattr(proposer, "primary", None), getattr(proposer, "fallback", None)):
        gate = getattr(part, "gate", None)
        if gate is not None:
            part.gate = dataclasses.replace(gate, measure=True)
