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
from lab.kv_cache.manager import KVCacheManager
from lab.models.config import DecoderConfig
from lab.request import Request
from lab.runner import ModelRunner
from lab.spec.draft_kv import DraftKV
from lab.spec.proposer import Draft, pick_draft_tokens


class DraftModelProposer:
    feature_layers: tuple[int, ...] = ()

    def __init__(self, draft: ModelRunner, num_blocks: int, block_size: int) -> None:
        self.runner = draft
        self.kv = DraftKV(draft.allocate_block_kv_cache(num_blocks, block_size), num_blocks, block_size)
        self.kv_cache = self.kv.cache
        self.num_forwards = 0

    def free(self, request_id: str) -> None:
        self.kv.free(request_id)

    def reset_history(self) -> None:
        pass   # NOTE: a draft model keeps per-request KV only

    def stats(self) -> dict[str, float]:
        return {"spec/draft_forwards": self.num_forwards, "spec/draft_skipped_requests": self.kv.num_skipped}

    def _forward(self, seqs: list[SeqSlice], token_ids: list[int]) -> torch.Tensor:
        """One flat-batch forward; logits (R, V) at each slice's last token."""
        self.kv_cache.begin_step(seqs)
        rows, total = [], 0
        for seq in seqs:
            total += seq.num_query_tokens
            rows.append(total - 1)
        input_ids = torch.tensor(token_ids, dtype=torch.long)[None]                      # (1, N)
        positions = self.runner.model.rotary.clamp_draft_positions(self.kv_cache.index.positions[None])  # (1, N)
        self.num_forwards += 1
        return self.runner.execute(input_ids, positions, self.kv_cache,
                                   logits_index=torch.tensor(rows, dtype=torch.long))[0]  # (R, V)

    def propose(self, requests: list[Request], num_spec_tokens: int,
                generators: list[torch.Generator | None]) -> dict[str, Draft]:
        if num_spec_tokens < 1 or not requests:
            return {}
        active, seqs, token_ids = [], [], []
        for request, generator in zip(requests, generators):
            seq = self.kv.catch_up(request.request_id, request.all_token_ids, num_spec_tokens - 1)
            if seq is not None:
                active.append((request, generator))
                seqs.append(seq)
                token_ids.extend(request.all_token_ids[seq.num_context_tokens:])
        if not active:
            return {}
        params = [r.sampling_params for r, _ in active]
        gens = [g for _, g in active]
        drafted, probs = pick_draft_tokens(self._forward(seqs, token_ids), params, gens)
        tokens = [[t] for t in drafted]
        dists = [[q] for q in probs]
        for i in range(1, num_spec_tokens):
            step = [SeqSlice(s.block_table, s.num_context_tokens + s.num_query_tokens + i - 1, 1) for s in seqs]
            drafted, probs = pick_draft_tokens(self._forward(step, [t[-1] for t in tokens]), params, gens)
            for row, (token, q) in enumerate(zip(drafted, probs)):
                tokens[row].append(token)
                dists[row].append(q)
        out = {}
        for (request, _), row_tokens, row_dists in zip(active, tokens, dists):
            # NOTE: the KV of drafts 1..k-1 was written; it stays valid while the target accepts them.
            self.kv.commit(request.request_id, request.all_token_ids + row_tokens[:-1])
            q = None if row_dists[0] is None else torch.stack(row_dists)                 # (k, V)
            out[request.request_id] = Draft(row_tokens, q)
        return out


@dataclass(slots=True)
class DraftModelProposerConfig:
    """conf/engine/proposer/draft_model.yaml: `source` is any model source (conf/model/*'s `source`)."""

    source: Any = None
    dtype: str | None = None   # None: the target's

    def kv_bytes_per_token(self, target: ModelRunner) -> int:
        """Kept per target KV slot: the draft model's own KV (DraftKV has as many blocks as the target)."""
        if self.source is None:
            return 0   # NOTE: build() says what is missing
        itemsize = getattr(torch, self.dtype).itemsize if self.dtype else target.dtype.itemsize
        return DecoderConfig.from_hf(self.source.hf_config).kv_bytes_per_token(itemsize)

    def build(self, target: ModelRunner, kv: KVCacheManager) -> DraftModelProposer:
        if self.source is None:
            raise LabError("proposer=draft_model needs a draft model", "set engine.proposer.source (e.g. the tiny model)")
        dtype = self.dtype or str(target.dtype).removeprefix("torch.")
        draft = ModelRunner(self.source, dtype=dtype, device=str(target.device),
                            huge_pages="auto" if target.use_huge_pages else "off")   # NOTE: as the target's
        if draft.vocab_size != target.vocab_size:
            raise LabError(f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size})",
                           "use a draft that shares the target's tokenizer")
        return DraftModelProposer(draft, kv.num_blocks, kv.block_size)


@dataclass(slots=True)
class LayerSkipProposerConfig:
    """conf/engine/proposer/layerskip.yaml: the target's first `num_layers` layers + final norm + head."""

    num_layers: int = 4

    def kv_bytes_per_token(self, target: ModelRunner) -> int:
        """Kept per target KV slot: the first `num_layers` layers' own KV (DraftKV has as many blocks as the target)."""
        return target.config.kv_bytes_per_token(target.dtype.itemsize, num_layers=self.num_layers)

    def build(self, target: ModelRunner, kv: KVCacheManager) -> DraftModelProposer:
        from lab.models.early_exit import early_exit_runner

        return DraftModelProposer(early_exit_runner(target, self.num_layers), kv.num_blocks, kv.block_size)
