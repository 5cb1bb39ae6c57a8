"""ContinuousBatchingEngine: `cb_slots` (stage 2D) and `cb_paged` (stage 2E), one loop, two KV strategies.

Each step: Scheduler.schedule() -> SchedulerOutput {request_id: num_tokens}; the scheduled tokens are laid
out as one flat (1, N) batch (single-token queries first, then prefill chunks) with per-token positions;
BlockKVCache gets each request's block table and attends per request; ModelRunner.execute returns the
logits of each request whose step reaches its last known token; Sampler picks tokens;
Scheduler.update_from_output advances `num_computed_tokens` and frees finished requests' KV.

The KV strategy is a constructor choice (conf/engine/kv_cache/): SlotKVCacheConfig gives every request
one `max_len` slot; PagedKVCacheConfig gives blocks on demand with prefix sharing.

Phase timing: a step whose tokens are all decodes is "decode", all prefill (or recompute) chunks is
"prefill", and a step with both is "mixed" (its tokens counted whole; splitting one forward's time by
token counts would be a guess).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lab.engines.base import Engine
from lab.errors import LabError
from lab.kv_cache import KVCacheConfig, PagedKVCacheConfig, SeqSlice
from lab.kv_cache.counters import PrefixCacheCounters
from lab.profiling.ranges import profile_range
from lab.request import Request
from lab.runner import ModelRunner
from lab.runner.cuda_graphs import CudaGraphConfig, DecodeGraphs
from lab.sample.logprobs import TokenLogprobs, token_logprobs
from lab.sample.logits_processors import apply_logits_processors
from lab.sample.sampler import GreedyRows
from lab.sched import Scheduler, SchedulerConfig, SchedulerOutput


@dataclass(slots=True)
class StepBatch:
    """One step's flat batch: every scheduled request's tokens back to back."""

    input_ids: torch.Tensor                       # (1, N)
    positions: torch.Tensor                       # (1, N)
    sample_rows: torch.Tensor                     # (R' + P,) rows whose logits are sampled / verified, then P rows
                                                  # of prompt logprobs
    samplers: list[Request]                       # the requests the first R' rows belong to, in order
    prompt_logprobs: list[tuple[Request, range]] = field(default_factory=list)   # the P rows' requests, positions
    in_graph: bool = False                        # a decode / verify step run by DecodeGraphs
    greedy: bool = False                          # every sampler reads only its rows' argmax (GreedyRows)


class ContinuousBatchingEngine(Engine):
    supports_logprobs = True
    supports_logits_processors = True

    def __init__(self, runner: ModelRunner, scheduler: SchedulerConfig | None = None,
                 kv_cache: KVCacheConfig | None = None, name: str | None = None, seed: int = 0,
                 cuda_graphs: CudaGraphConfig | None = None) -> None:
        super().__init__(runner, name or "cb_paged", seed)
        scheduler = scheduler or SchedulerConfig()
        kv_cache = kv_cache or PagedKVCacheConfig()
        graph_mode = (cuda_graphs or CudaGraphConfig(mode="off")).resolve_mode(runner.device)
        self.kv_manager = kv_cache.build_manager(runner.max_model_len, scheduler.max_num_seqs,
                                                 self.kv_bytes_per_token, runner.device)
        self.kv_cache = runner.allocate_block_kv_cache(self.kv_manager.num_blocks, self.kv_manager.block_size,
                                                       kv_cache.attention, scratch_block=graph_mode != "off")
        self.scheduler = Scheduler(scheduler, self.kv_manager, runner.eos_token_ids)
        # NOTE: pure-decode (and, configured, verify) steps replay a CUDA graph (lab/runner/cuda_graphs.py);
        # every other step runs eagerly.
        self.decode_graphs = None if graph_mode == "off" else DecodeGraphs(
            runner.model, self.kv_cache, cuda_graphs, scheduler.max_num_seqs, runner.max_model_len)
        self.step_logprobs: dict[str, list[TokenLogprobs]] = {}   # this step's, by request (record_logprobs)
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.num_steps = 0
        self.num_scheduled_tokens = 0
        self.reserved_token_steps = 0   # sum over steps of tokens reserved, for reserved/used per token
        self.used_token_steps = 0
        self.scheduler.reset_stats()
        if self.decode_graphs is not None:
            self.decode_graphs.reset_stats()
        self._prefix_cache_at_reset = self._prefix_cache_counters()

    def _prefix_cache_counters(self) -> PrefixCacheCounters | None:
        counters = getattr(self.kv_manager, "prefix_cache_counters", None)   # NOTE: the paged KV cache only
        return counters() if counters is not None else None

    # -- Engine interface --------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """The context checks, then whether the KV cache and token budget could ever run the request."""
        super().validate(request)
        if any(r.request_id == request.request_id for r in (*self.scheduler.waiting, *self.scheduler.running)):
            raise LabError(f"request id {request.request_id} is already in flight",
                           "give every request a unique request_id")
        error = self.scheduler.never_fits(request)
        if error is not None:
            raise error

    def add_request(self, request: Request) -> None:
        self.validate(request)
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def abort_running(self, error: str) -> list[Request]:
        return self.scheduler.abort_running(error)

    def abort_request(self, request_id: str, error: str = "aborted") -> Request | None:
        return self.scheduler.abort_request(request_id, error)

    def step(self) -> list[Request]:
        # NOTE: labelled ranges (no-ops without a profiler) so the profile splits a step into scheduler
        # work (schedule + update), prepare_inputs, the forward (prefill/decode/mixed) and sample.
        with profile_range("schedule"):
            out = self.scheduler.schedule()
        self.step_logprobs = {}
        sampled = self._execute(out) if not out.is_empty else {}
        with profile_range("schedule"):
            finished = self.scheduler.update_from_output(out, sampled, logprobs=self.step_logprobs)
        self.num_steps += 1
        self.num_scheduled_tokens += out.total_num_scheduled_tokens
        reserved, used = self._kv_tokens()
        self.reserved_token_steps += reserved
        self.used_token_steps += used
        return finished

    # -- one forward -------------------------------------------------------------------------------
    def _execute(self, out: SchedulerOutput) -> dict[str, int | list[int]]:
        """Run the scheduled tokens as one flat batch; returns {request_id: sampled token(s)}.

        A request that reaches its last known token gets logits there and, with speculation, at each
        of its draft tokens too (1 + num_spec rows, consecutive)."""
        phase = _phase_name(out)
        graph = (self.decode_graphs is not None and phase == "decode" and self.decode_graphs.fits(
            len(out.scheduled), 1 + max(map(len, out.scheduled_spec_token_ids.values()), default=0)))
        with profile_range("prepare_inputs"):
            batch = self._prepare_inputs(out, prepare_attention=not graph)
        batch.in_graph = graph
        with self.phases.phase(phase, num_tokens=batch.input_ids.shape[1]):
            logits = self.forward(batch)                                          # (R' + P, V) or GreedyRows
            with profile_range("sample"):
                if batch.prompt_logprobs:
                    logits = self._record_prompt_logprobs(batch, logits)
                return self.select_tokens(out, batch.samplers, logits) if batch.samplers else {}

    @staticmethod
    def _record_prompt_logprobs(batch: StepBatch, logits: torch.Tensor) -> torch.Tensor:
        """logits (R' + P, V): hand the last P rows to their requests' prompt logprobs; returns the first R'."""
        row = logits.shape[0] - sum(len(positions) for _, positions in batch.prompt_logprobs)
        sample_logits = logits[:row]
        for request, positions in batch.prompt_logprobs:
            tokens = request.prompt_token_ids[positions.start + 1:positions.stop + 1]
            entries = token_logprobs(logits[row:row + len(positions)], tokens, request.sampling_params.prompt_logprobs)
            request.record_prompt_logprobs(positions.start, entries)
            row += len(positions)
        return sample_logits

    def forward(self, batch: StepBatch) -> torch.Tensor | GreedyRows:
        """The target forward over the step's flat batch -> logits (R', V) at the rows to sample (or their argmax
        ids where batch.greedy)."""
        return self.target_forward(batch)[0]

    def target_forward(self, batch: StepBatch, feature_layers: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor | GreedyRows, torch.Tensor | None]:
        """(logits (R', V) at the rows to sample, the features (N, F) of every token at `feature_layers` or
        None), by graph replay or eagerly. An eager step whose samplers read only their argmax (batch.greedy)
        gets GreedyRows instead of the logits: the head's greedy screen finds them without (model.greedy_head)."""
        if batch.in_graph:
            # NOTE: a decode or verify step samples every token it runs, so its logits are the sample rows'.
            logits, features = self.decode_graphs.run(batch.input_ids, self.kv_cache.index)
            if feature_layers and features is None:
                raise LabError("the decode graphs return no target features",
                               "call decode_graphs.configure(..., feature_layers) before the first step")
            return logits, features
        if feature_layers:
            logits, features = self.runner.execute_with_features(batch.input_ids, batch.positions, self.kv_cache,
                                                                 batch.sample_rows, feature_layers, batch.greedy)
            return _sample_rows(logits[0], batch.greedy), features[0]
        logits = self.runner.execute(batch.input_ids, batch.positions, self.kv_cache, logits_index=batch.sample_rows,
                                     greedy=batch.greedy)
        return _sample_rows(logits[0], batch.greedy), None

    def _prepare_inputs(self, out: SchedulerOutput, prepare_attention: bool = True) -> StepBatch:
        """The step's flat batch; builds its KV index (block tables, slot mapping) in the cache, and the
        attention backend's metadata unless the step runs in a decode graph."""
        counts = out.num_scheduled_tokens
        # NOTE: single-token queries first, longest context first: the attention backend batches them
        # and cuts them into groups of similar length.
        order = sorted(out.scheduled, key=lambda r: (counts[r.request_id] != 1,
                                                     -r.num_computed_tokens if counts[r.request_id] == 1 else 0))
        seqs, token_ids, sample_rows, samplers, prompt_rows, prompt_logprobs = [], [], [], [], [], []
        for request in order:
            start, num = request.num_computed_tokens, counts[request.request_id]
            if positions := request.prompt_logprob_positions(start, num):
                # NOTE: the request's rows start at len(token_ids); position p is its row p - start
                first_row = len(token_ids) - start
                prompt_rows.extend(range(first_row + positions.start, first_row + positions.stop))
                prompt_logprobs.append((request, positions))
            spec = out.scheduled_spec_token_ids.get(request.request_id, [])
            parents = out.scheduled_spec_parents.get(request.request_id)
            # NOTE: query 0 is the root (the last token); draft i is query i + 1.
            tree = None if parents is None else tuple(p + 1 for p in parents)
            seqs.append(SeqSlice(self.kv_manager.block_table(request.request_id), start, num, tree))
            token_ids.extend(_token_slice(request, start, num - len(spec)) + spec)
            if out.samples(request):
                sample_rows.extend(range(len(token_ids) - 1 - len(spec), len(token_ids)))
                samplers.append(request)
        self.kv_cache.begin_step(seqs, prepare_attention)
        return StepBatch(input_ids=torch.tensor(token_ids, dtype=torch.long)[None],
                         positions=self.kv_cache.index.positions[None],
                         sample_rows=torch.tensor(sample_rows + prompt_rows, dtype=torch.long), samplers=samplers,
                         prompt_logprobs=prompt_logprobs, greedy=self.runner.greedy_head and not prompt_logprobs
                         and all(r.sampling_params.needs_only_argmax for r in samplers))

    def select_tokens(self, out: SchedulerOutput, requests: list[Request],
                      logits: torch.Tensor | GreedyRows) -> dict[str, int | list[int]]:
        """The hook speculative decoding overrides: logits (R, V), one row per sampling request (GreedyRows where
        every one reads only its argmax: no processors or logprobs touch them then)."""
        processed = apply_logits_processors(logits, requests, self.runner.eos_token_ids)
        sampled = self.sampler.sample(processed, [r.sampling_params for r in requests],
                                      [self.generator_for(r) for r in requests])
        for row, (request, token_id) in enumerate(zip(requests, sampled)):
            self.record_logprobs(request, logits, [row], [token_id])
        return {r.request_id: token for r, token in zip(requests, sampled)}

    def record_logprobs(self, request: Request, logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
        """For a request that asked for logprobs: logits[rows] (len(token_ids), V) are the rows its tokens were chosen
        from. NOTE: indexed only then, so a step whose requests ask for none pays no copies."""
        if request.sampling_params.logprobs is not None:
            self.step_logprobs[request.request_id] = token_logprobs(logits[rows], token_ids,
                                                                   request.sampling_params.logprobs)

    # -- accounting --------------------------------------------------------------------------------
    def _kv_tokens(self) -> tuple[int, int]:
        """(tokens of KV reserved by running requests, tokens actually stored for them)."""
        reserved = self.kv_manager.num_held_blocks * self.kv_manager.block_size
        used = sum(r.num_computed_tokens for r in self.scheduler.running)
        return reserved, used

    def kv_usage(self) -> tuple[int, int]:
        reserved, used = self._kv_tokens()
        return reserved * self.kv_bytes_per_token, used * self.kv_bytes_per_token

    def kv_cache_usage(self) -> float:
        # NOTE: a cached block no request holds is free, as in vLLM's block pool
        return self.kv_manager.num_held_blocks / self.kv_manager.num_blocks

    def reset_caches(self) -> None:
        self.kv_manager.reset_prefix_cache()

    def reset_stats(self) -> None:
        super().reset_stats()
        self._reset_counters()

    def stats(self) -> dict[str, float]:
        graphs = self.decode_graphs.stats() if self.decode_graphs is not None else {}
        prefix = {}
        now = self._prefix_cache_counters()
        if now is not None:   # NOTE: since reset_stats, so a run's figures leave its warm-ups' lookups out
            window = now - self._prefix_cache_at_reset
            prefix = {"kv/prefix_cache_query_tokens": window.queries, "kv/prefix_cache_hit_tokens": window.hits,
                      "kv/prefix_cache_hit_rate": window.summary()["prefix_cache_hit_rate"]}
        return {**super().stats(), **self.scheduler.stats(), **self.kv_manager.stats(), **prefix, **graphs,
                "sched/num_steps": self.num_steps,
                "sched/mean_scheduled_tokens": self.num_scheduled_tokens / max(1, self.num_steps),
                "kv/pool_bytes": self.kv_cache.num_bytes,
                "kv/reserved_per_used_token": self.reserved_token_steps / max(1, self.used_token_steps),
                "kv/held_blocks_at_end": self.kv_manager.num_held_blocks}


def _token_slice(request: Request, start: int, num: int) -> list[int]:
    """request.all_token_ids[start:start + num] without concatenating the whole sequence."""
    prompt, outputs = request.prompt_token_ids, request.output_token_ids
    end, num_prompt = start + num, len(prompt)
    if start >= num_prompt:
        return outputs[start - num_prompt:end - num_prompt]
    return prompt[start:end] + outputs[:max(0, end - num_prompt)]


def _phase_name(out: SchedulerOutput) -> str:
    is_decode = [out.num_scheduled_tokens[r.request_id] == 1 + out.num_spec_tokens(r) and r.num_output_tokens > 0
                 and r.num_computed_tokens == r.num_tokens - 1 for r in out.scheduled]
    return "decode" if all(is_decode) else "prefill" if not any(is_decode) else "mixed"


def _sample_rows(logits: torch.Tensor, greedy: bool) -> torch.Tensor | GreedyRows:
    """The runner's (R', V) logits, or with `greedy` its (R',) argmax ids as GreedyRows."""
    return GreedyRows(logits) if greedy else logits
