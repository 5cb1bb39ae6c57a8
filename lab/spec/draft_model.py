"""DraftModelProposer: a smaller causal LM (proposer=draft_model) or the target's first layers
(proposer=layerskip) drafts k tokens autoregressively, batched over requests, with its own paged KV.

Owns: the draft's KV (a PagedKVCacheManager + BlockKVCache of its own) and which of it is still valid.
Each propose: one forward catches every request up (the tokens the target accepted since the last
draft, plus the last token), drafting the first token; then k-1 single-token forwards. The draft KV of
rejected tokens is invalid: the next propose keeps only the prefix whose tokens still match the
request's context (rollback by recomputation, so preemptions and rejections need no callbacks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lab.errors import LabError
from lab.kv_cache.block_kv import SeqSlice
from lab.kv_cache.paged import PagedKVCacheManager
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.sample.rejection import target_probs
from lab.spec.proposer import Draft


@dataclass(slots=True)
class _DraftState:
    shadow: Request             # the draft's view: num_computed_tokens = its valid KV prefix
    stored_token_ids: list[int]  # the tokens whose KV the draft holds, in position order


class DraftModelProposer:
    def __init__(self, draft: ModelRunner, num_blocks: int, block_size: int) -> None:
        self.runner = draft
        self.kv_manager = PagedKVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.kv_cache = draft.allocate_block_kv_cache(num_blocks, block_size)
        self.states: dict[str, _DraftState] = {}
        self.num_forwards = 0
        self.num_skipped = 0   # requests left undrafted because the draft's KV pool was full

    def free(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.kv_manager.free(state.shadow)

    def stats(self) -> dict[str, float]:
        return {"spec/draft_forwards": self.num_forwards, "spec/draft_skipped_requests": self.num_skipped}

    def _catch_up(self, request: Request, num_spec_tokens: int) -> SeqSlice | None:
        """Reserve draft KV for context + k - 1 drafts; the slice feeds the tokens the draft has not seen."""
        context = request.all_token_ids
        state = self.states.get(request.request_id)
        if state is None:
            shadow = Request(request.request_id, [], SamplingParams(max_tokens=1))
            state = self.states[request.request_id] = _DraftState(shadow, [])
        valid = 0
        limit = min(state.shadow.num_computed_tokens, len(context) - 1)   # the last token is always fed
        while valid < limit and state.stored_token_ids[valid] == context[valid]:
            valid += 1
        state.shadow.num_computed_tokens = valid
        needed = len(context) + num_spec_tokens - 1 - valid
        if not self.kv_manager.allocate_slots(state.shadow, needed):
            self.num_skipped += 1
            return None
        state.stored_token_ids = list(context)
        return SeqSlice(self.kv_manager.block_table(request.request_id), valid, len(context) - valid)

    def _forward(self, seqs: list[SeqSlice], token_ids: list[int]) -> torch.Tensor:
        """One flat-batch forward; logits (R, V) at each slice's last token."""
        self.kv_cache.begin_step(seqs)
        rows, total = [], 0
        for seq in seqs:
            total += seq.num_query_tokens
            rows.append(total - 1)
        input_ids = torch.tensor(token_ids, dtype=torch.long)[None]                      # (1, N)
        positions = self.kv_cache.index.positions[None]                                  # (1, N)
        self.num_forwards += 1
        return self.runner.execute(input_ids, positions, self.kv_cache,
                                   logits_index=torch.tensor(rows, dtype=torch.long))[0]  # (R, V)

    @staticmethod
    def _pick(logits: torch.Tensor, params: list[SamplingParams],
              generators: list[torch.Generator | None]) -> tuple[list[int], list[torch.Tensor | None]]:
        tokens, probs = [], []
        for row, p, generator in zip(logits, params, generators):
            if p.is_greedy:
                tokens.append(int(row.argmax()))
                probs.append(None)
            else:
                q = target_probs(row[None], p)[0]                                        # (V,)
                tokens.append(int(torch.multinomial(q, 1, generator=generator)))
                probs.append(q)
        return tokens, probs

    def propose(self, requests: list[Request], num_spec_tokens: int,
                generators: list[torch.Generator | None]) -> dict[str, Draft]:
        if num_spec_tokens < 1 or not requests:
            return {}
        active, seqs, token_ids = [], [], []
        for request, generator in zip(requests, generators):
            seq = self._catch_up(request, num_spec_tokens)
            if seq is not None:
                active.append((request, generator))
                seqs.append(seq)
                token_ids.extend(request.all_token_ids[seq.num_context_tokens:])
        if not active:
            return {}
        params = [r.sampling_params for r, _ in active]
        gens = [g for _, g in active]
        drafted, probs = self._pick(self._forward(seqs, token_ids), params, gens)
        tokens = [[t] for t in drafted]
        dists = [[q] for q in probs]
        for i in range(1, num_spec_tokens):
            step = [SeqSlice(s.block_table, s.num_context_tokens + s.num_query_tokens + i - 1, 1) for s in seqs]
            drafted, probs = self._pick(self._forward(step, [t[-1] for t in tokens]), params, gens)
            for row, (token, q) in enumerate(zip(drafted, probs)):
                tokens[row].append(token)
                dists[row].append(q)
        out = {}
        for (request, _), row_tokens, row_dists, seq in zip(active, tokens, dists, seqs):
            state = self.states[request.request_id]
            state.shadow.num_computed_tokens = seq.num_context_tokens + seq.num_query_tokens + num_spec_tokens - 1
            state.stored_token_ids += row_tokens[:-1]
            q = None if row_dists[0] is None else torch.stack(row_dists)                 # (k, V)
            out[request.request_id] = Draft(row_tokens, q)
        return out


@dataclass(slots=True)
class DraftModelProposerConfig:
    """conf/engine/proposer/draft_model.yaml: `source` is any model source (conf/model/*'s `source`)."""

    source: Any = None
    dtype: str | None = None   # None: the target's

    def build(self, target: ModelRunner, num_blocks: int, block_size: int) -> DraftModelProposer:
        if self.source is None:
            raise LabError("proposer=draft_model needs a draft model", "set engine.proposer.source (e.g. the tiny model)")
        dtype = self.dtype or str(target.dtype).removeprefix("torch.")
        draft = ModelRunner(self.source, dtype=dtype, device=str(target.device))
        if draft.vocab_size != target.vocab_size:
            raise LabError(f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size})",
                           "use a draft that shares the target's tokenizer")
        return DraftModelProposer(draft, num_blocks, block_size)


@dataclass(slots=True)
class LayerSkipProposerConfig:
    """conf/engine/proposer/layerskip.yaml: the target's first `num_layers` layers + final norm + head."""

    num_layers: int = 4

    def build(self, target: ModelRunner, num_blocks: int, block_size: int) -> DraftModelProposer:
        from lab.models.early_exit import early_exit_runner

        return DraftModelProposer(early_exit_runner(target, self.num_layers), num_blocks, block_size)
