"""DFlashProposer (engine=dflash, proposer=dflash): block-diffusion drafting. One drafter forward per step
proposes all B-1 tokens of every request's block in parallel: the block is the last token followed by
B-1 mask embeddings; every drafter layer attends to the request's context as keys/values projected from
the target's features (cached per request and extended with the features of newly accepted tokens).

Owns: the per-request context K/V cache. Its entries are only ever computed from positions below the
request's num_computed_tokens, whose tokens are final, so rejections need no rollback here.

`lookahead_masks`: a step that verifies k drafts need not run the whole trained block. The block is then the
last token + k + lookahead_masks masks (at most the trained block): the drafts change a little (fewer masks
to attend to), the output never does (the target verifies), and the drafter's layers push fewer rows.

`denoise_steps` > 1 (block diffusion's denoising steps, for a drafter trained with `drafter.max_fill`): the block
is drafted again with the drafts kept so far given as tokens, one more kept per step, so each later offset is drafted
knowing the drafts before it, where one forward must guess it from the context alone.

With the engine's graphs on (`engine.cuda_graphs`: cuda on a GPU, or eager), greedy blocks run in
DFlashBlockGraphs (lab/spec/dflash_graphs.py): the same drafter forward on padded static buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lab.drafters.checkpoint import read_drafter_config, resolve_checkpoint
from lab.drafters.dflash import DFlashConfig, DFlashDrafter
from lab.errors import LabError
from lab.kv_cache.manager import KVCacheManager
from lab.kv_cache.tree_mask import MAX_TREE_TOKENS
from lab.request import Request
from lab.runner import ModelRunner
from lab.spec.dflash_graphs import DFlashBlockGraphs
from lab.spec.feature_proposer import (MAX_TREE_WIDTH, ConfidenceGate, DraftWeights, FeatureProposer, build_drafter,
                                       resolve_draft_weights, resolve_head_weights)
from lab.spec.proposer import Draft
from lab.spec.tree import Candidates, Paths, Redrafts, grow_redrafts, marginal_tree, with_siblings


def _check_tree_nodes(tree_nodes: int, tree_width: int, tree_tails: bool, denoise_steps: int, tree_redraft: int,
                      tree_redraft_levels: int, max_fill: int) -> None:
    """A tree of paths is its own shape: not with runners-up at the first position, nor redrafted blocks; its
    redrafts under its likeliest paths need a drafter trained with that many offsets given."""
    if not 0 <= tree_nodes <= MAX_TREE_TOKENS - 1:
        raise LabError(f"engine.proposer.tree_nodes must be 0 (off) to {MAX_TREE_TOKENS - 1} (a verify step's tree "
                       f"holds {MAX_TREE_TOKENS} tokens with the root), got {tree_nodes}",
                       "e.g. engine.proposer.tree_nodes=62 (EAGLE-2's trees are ~60 tokens)")
    if tree_nodes and (tree_width > 1 or tree_tails):
        raise LabError("engine.proposer.tree_nodes (a tree of the block's likeliest paths) and tree_width / "
                       "tree_tails (runners-up at the first position) are two tree shapes; set one",
                       "set engine.proposer.tree_width=1 engine.proposer.tree_tails=false with tree_nodes")
    if tree_nodes and denoise_steps > 1:
        raise LabError("engine.proposer.tree_nodes needs the whole block drafted in one forward (its paths are "
                       "built from every offset's distribution), but denoise_steps > 1 redrafts it",
                       "set engine.proposer.denoise_steps=1 with tree_nodes")
    if tree_redraft and not tree_nodes:
        raise LabError("engine.proposer.tree_redraft grows a tree of paths (tree_nodes), which is off",
                       "set engine.proposer.tree_nodes too, e.g. 62")
    # NOTE: a level redrafts its tree's likeliest paths that deep, so no more of them than the tree has nodes (the
    # first level has at most a node's candidates, MAX_TREE_WIDTH; deeper levels have more)
    if not 0 <= tree_redraft <= tree_nodes:
        raise LabError(f"engine.proposer.tree_redraft (paths redrafted a level) must be 0 (off) to tree_nodes "
                       f"({tree_nodes}), got {tree_redraft}",
                       "e.g. engine.proposer.tree_redraft=8: the block drafted again under its 8 likeliest first "
                       "tokens, then under its 8 likeliest 2-token paths, ...")
    if tree_redraft and max_fill < 1:
        raise LabError("engine.proposer.tree_redraft drafts the block again with its first token given, but this "
                       "drafter was trained without given tokens (max_fill 0)",
                       "use a drafter trained with drafter.max_fill >= 1 (smollm2: engine.proposer.checkpoint="
                       "checkpoints/smollm2/dflash_denoise.pt), or set engine.proposer.tree_redraft=0")
    if tree_redraft_levels < 1:
        raise LabError(f"engine.proposer.tree_redraft_levels must be >= 1, got {tree_redraft_levels}",
                       "e.g. engine.proposer.tree_redraft_levels=2: redraft under the likeliest first tokens, then "
                       "under the likeliest two-token paths")
    if tree_redraft_levels > 1 and not tree_redraft:
        raise LabError(f"engine.proposer.tree_redraft_levels={tree_redraft_levels} redrafts the tree level by level, "
                       "but tree_redraft (the paths redrafted a level) is 0",
                       "set engine.proposer.tree_redraft too, e.g. 4")
    if tree_redraft and tree_redraft_levels > max_fill:
        raise LabError(f"engine.proposer.tree_redraft_levels={tree_redraft_levels} gives the drafter paths of up "
                       f"to {tree_redraft_levels} tokens, but this drafter was trained with at most {max_fill} given "
                       "(its max_fill)",
                       f"set engine.proposer.tree_redraft_levels to 1..{max_fill}, or draft with a drafter trained "
                       f"with drafter.max_fill={tree_redraft_levels}")


class _ContextKV:
    """One request's context keys and values for every drafter layer: (layers, 2, Hkv, capacity, D), and the
    context stream of its last position (H,), which the next block's input fusion reads."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.length = 0
        self.last_stream: torch.Tensor | None = None

    def append(self, kv: torch.Tensor, last_stream: torch.Tensor) -> None:
        """kv (layers, 2, Hkv, num, D) of the next positions; last_stream (H,): the last one's context stream."""
        self.last_stream = last_stream
        end = self.length + kv.shape[3]
        if self.data is None or self.data.shape[3] < end:
            grown = kv.new_empty(*kv.shape[:3], max(end, 2 * self.length, 64), kv.shape[4])
            if self.data is not None:
                grown[:, :, :, :self.length] = self.data[:, :, :, :self.length]
            self.data = grown
        self.data[:, :, :, self.length:end] = kv
        self.length = end


class DFlashProposer(FeatureProposer):
    def __init__(self, target: ModelRunner, drafter: DFlashDrafter, kv: KVCacheManager, draft_vocab_size: int = 0,
                 head_weights: DraftWeights = "fp32", gate: ConfidenceGate | None = None,
                 lookahead_masks: int | None = None, tree_width: int = 1, tree_min_prob: float = 0.0,
                 tree_tails: bool = False, denoise_steps: int = 1, tree_nodes: int = 0,
                 tree_redraft: int = 0, tree_redraft_levels: int = 1) -> None:
        super().__init__(target, drafter, kv, draft_vocab_size, head_weights, gate, tree_width, tree_min_prob)
        _check_tree_nodes(tree_nodes, tree_width, tree_tails, denoise_steps, tree_redraft, tree_redraft_levels,
                          drafter.config.max_fill)
        most = drafter.config.max_fill + 1
        if not 1 <= denoise_steps <= most:
            trained = (f"was trained to take at most {most - 1} drafted offsets filled in (its max_fill)" if most > 1
                       else "was trained without drafted offsets filled in (max_fill 0)")
            raise LabError(f"engine.proposer.denoise_steps={denoise_steps}, but this drafter {trained}",
                           f"set engine.proposer.denoise_steps to {'1' if most == 1 else f'1..{most}'}, draft with "
                           f"a drafter trained for it (smollm2: engine.proposer.checkpoint="
                           f"checkpoints/smollm2/dflash_denoise.pt, up to 4 steps), or train one with "
                           f"drafter.max_fill={max(1, denoise_steps - 1)}")
        self.block_size = drafter.block_size
        # NOTE: a block is the last token and B-1 masks, so one forward drafts at most B-1 tokens; the engine (and a
        # cascade, for its fallback) refuses a larger num_spec_tokens rather than verify fewer than it was told to.
        self.max_num_spec_tokens = drafter.block_size - 1
        self.denoise_steps = denoise_steps   # drafter forwards a block: step p keeps offset p, the last the rest
        self.tree_tails = tree_tails   # the block's later drafts under every runner-up too
        self.tree_nodes = tree_nodes   # > 0: a tree of that many of the block's likeliest paths (marginal_tree)
        self.tree_redraft = tree_redraft   # > 0: the later offsets drafted again under that many paths a level
        self.tree_redraft_levels = tree_redraft_levels   # levels redrafted: under 1-token paths, 2-token paths, ...
        self.lookahead_masks = lookahead_masks   # None: always the trained block
        self.contexts: dict[str, _ContextKV] = {}
        self.graphs: DFlashBlockGraphs | None = None   # use_graphs: greedy blocks in (CUDA) graphs

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.contexts.pop(request_id, None)

    def _extend_contexts(self, requests: list[Request]) -> list[_ContextKV]:
        """Project the features of every request's not-yet-cached context positions, in one batch; afterwards
        each context covers every position but the request's last token (whose features are not known yet)."""
        contexts, chunks, positions, spans = [], [], [], []
        for request in requests:
            context = self.contexts.setdefault(request.request_id, _ContextKV())
            contexts.append(context)
            end = request.num_tokens - 1     # features exist for every token but the last
            if end > context.length:
                chunks.append(self.store.read(request.request_id, context.length, end))
                positions.append(torch.arange(context.length, end, device=self.device))
                spans.append((context, end - context.length))
        if chunks:
            stream = self.drafter.context_stream(torch.cat(chunks)[None])                       # (1, N, H)
            kv = self.drafter.stream_kv(stream, torch.cat(positions)[None])                     # per layer (1, Hkv, N, D)
            stacked = torch.stack([torch.stack((k[0], v[0])) for k, v in kv])                 # (layers, 2, Hkv, N, D)
            offset = 0
            for context, num in spans:
                # NOTE: a copy, so the batch's whole stream is not kept alive by one row of it
                context.append(stacked[:, :, :, offset:offset + num], stream[0, offset + num - 1].clone())
                offset += num
        return contexts

    def _batch_contexts(self, contexts: list[_ContextKV], block: int
                        ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """Per drafter layer the batch's context (k, v), each (S, Hkv, C, D), and the attention mask of a block
        of `block` positions (S, 1, B, C + B), or None when every request sees all C positions."""
        if len(contexts) == 1:   # NOTE: batch 1: views of the request's cache; no padded copy, no mask
            data = contexts[0].data[:, :, None, :, :contexts[0].length]                 # (layers, 2, 1, Hkv, C, D)
            return [(layer[0], layer[1]) for layer in data], None
        longest = max(c.length for c in contexts)
        layers, _, num_kv_heads, _, head_dim = contexts[0].data.shape
        padded = contexts[0].data.new_zeros(layers, 2, len(contexts), num_kv_heads, longest, head_dim)
        sees = torch.zeros(len(contexts), 1, block, longest + block, dtype=torch.bool, device=self.device)
        sees[..., longest:] = True
        for row, context in enumerate(contexts):
            padded[:, :, row, :, :context.length] = context.data[:, :, :, :context.length]
            sees[row, :, :, :context.length] = True
        return [(layer[0], layer[1]) for layer in padded], sees

    @property
    def drafts_trees(self) -> bool:
        return self.tree_width > 1 or self.tree_nodes > 0

    def max_drafts(self, num_spec_tokens: int) -> int:
        """The most tokens a draft of `num_spec_tokens` positions holds: the chain and its runners-up (each with
        the chain's later drafts, with tree_tails), or a tree of tree_nodes paths (a sampled request's chain)."""
        k = min(num_spec_tokens, self.max_num_spec_tokens)
        if self.tree_nodes:
            return max(k, self.tree_nodes)
        return k * self.tree_width if self.tree_tails else k + self.tree_width - 1

    def offsets_to_draft(self, requests: list[Request], k: int) -> int:
        """How many of the block's k offsets go through the head: a tree of N nodes is at most N deep, so for greedy
        requests drafting trees only the first min(k, N) can be in it (the graft's 4-node tree: 4 of 7). The block
        itself (its rows, hence every draft) stays as k sets it."""
        if self.tree_nodes and all(r.sampling_params.is_greedy for r in requests):
            return min(k, self.tree_nodes)
        return k

    def tree_candidates(self, k: int) -> tuple[slice | None, int]:
        """Which of a batch's S * k draft rows (request-major) offer candidates for a tree, and how many each:
        every row for a tree of paths (tree_nodes), each block's first for runners-up (tree_width), none for
        a chain."""
        if self.tree_nodes:
            return slice(None), min(self.tree_nodes, MAX_TREE_WIDTH)
        if self.tree_width > 1:
            return slice(None, None, k), self.tree_width
        return None, 1

    def stats(self) -> dict[str, float]:
        return {**super().stats(), **(self.graphs.stats() if self.graphs is not None else {})}

    def use_graphs(self, mode: str, capture_sizes: Sequence[int], max_context: int) -> None:
        """Draft greedy blocks in CUDA graphs (`mode` cuda) or their fixed-shape eager form (`eager`)."""
        self.graphs = DFlashBlockGraphs(self, mode, capture_sizes, max_context)

    def block_hidden(self, last_ids: torch.Tensor, last_stream: torch.Tensor | None, first_positions: torch.Tensor,
                     context_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None, block: int,
                     k: int, fill_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One drafter forward over S blocks: last_ids (S,) each block's first token, last_stream (S, 1, H) or
        None, first_positions (S,), the context K/V and mask of `_batch_contexts`; fill_ids (S, F): the drafts of
        offsets 1..F already committed (a later denoising step) -> hidden (S, k - F, H) of block rows F+1..k.
        Eager drafting and DFlashBlockGraphs both run it."""
        fills = None if fill_ids is None else self.target.embed_tokens(fill_ids)[:, None]          # (S, 1, F, H)
        embeds = self.drafter.block_inputs(self.target.embed_tokens(last_ids)[:, None], last_stream, block,
                                           fill_embeds=fills)                                      # (S, B, H)
        positions = first_positions[:, None] + torch.arange(block, device=first_positions.device)        # (S, B)
        start = 1 if fill_ids is None else 1 + fill_ids.shape[1]
        return self.drafter(embeds, positions, context_kv, mask, rows=slice(start, k + 1))

    def _draft_eagerly(self, active: list[Request], contexts: list[_ContextKV], block: int, k: int,
                       generators: list[torch.Generator | None]
                       ) -> tuple[list[int], list[torch.Tensor | None], list[float], list[Candidates],
                                  list[Redrafts]]:
        """One drafter forward over the batch's blocks, as it is -> flat (S * k,) tokens, their q (None when
        greedy), the drafter's confidences, per request its tree's candidates (tree_candidates; else []) and, with
        tree_redraft, its later positions' candidates drafted again under its tree's likeliest paths (`_redraft`)."""
        num_seqs = len(active)
        context_kv, sees = self._batch_contexts(contexts, block)
        last = torch.tensor([r.all_token_ids[-1] for r in active], device=self.device)
        last_stream = None
        if self.drafter.reads_last_context:   # NOTE: the token before each block: its context stream, already projected
            last_stream = torch.stack([c.last_stream for c in contexts])[:, None]                # (S, 1, H)
        first = torch.tensor([r.num_tokens - 1 for r in active], device=self.device)
        hidden = self.block_hidden(last, last_stream, first, context_kv, sees, block, k)           # (S, k, H)
        # NOTE: every request's k drafts through the head in one call (greedy: the draft vocabulary's argmax only).
        params = [r.sampling_params for r in active for _ in range(k)]
        tree_rows, width = self.tree_candidates(k)
        tokens, probs, confidence, best = self.pick(hidden.reshape(num_seqs * k, -1), params,
                                                    [g for g in generators for _ in range(k)], tree_rows, width)
        for committed in range(1, min(self.denoise_steps, k)):
            # NOTE: denoising step committed + 1: offsets 1..committed keep their drafts and are given to the drafter
            # as tokens; the offsets after them are drafted again, now knowing them. Each kept draft's q is that of
            # the step that drew it, given the drafts before it, so sampled verification stays exact.
            grid = torch.tensor(tokens, device=self.device).view(num_seqs, k)
            hidden = self.block_hidden(last, last_stream, first, context_kv, sees, block, k,
                                       fill_ids=grid[:, :committed])                            # (S, k - c, H)
            rest = k - committed
            redrafted = self.pick(hidden.reshape(num_seqs * rest, -1),
                                  [r.sampling_params for r in active for _ in range(rest)],
                                  [g for g in generators for _ in range(rest)])
            for row in range(num_seqs):
                span, new = slice(row * k + committed, (row + 1) * k), slice(row * rest, (row + 1) * rest)
                tokens[span], probs[span], confidence[span] = (redrafted[0][new], redrafted[1][new],
                                                               redrafted[2][new])
        candidates = self.per_request(best, num_seqs, k)
        redrafted = ([{} for _ in active] if not self.tree_redraft or k < 2
                     else self._redraft(active, contexts, candidates, (last, last_stream, first), block, k))
        return tokens, probs, confidence, candidates, redrafted

    def _redraft(self, active: list[Request], contexts: list[_ContextKV], candidates: list[Candidates],
                 starts: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor], block: int, k: int) -> list[Redrafts]:
        """The block's later positions drafted again under each greedy request's likeliest paths, level by level:
        level d gives the drafter the tree_redraft likeliest d-token paths of the tree as grown so far (at offsets
        1..d, as a denoising step gives its kept drafts) and drafts positions d + 1..k under each, in one drafter
        forward over those R blocks, so the subtree below a path follows from it. starts: the batch's (last tokens
        (S,), streams before the blocks (S, 1, H) or None, first positions (S,)) -> per request, each redrafted
        path's later candidates ({} for a request drafted as a chain)."""
        greedy = [row for row, (r, c) in enumerate(zip(active, candidates)) if c and r.sampling_params.is_greedy]
        last, last_stream, first = starts

        def redraft(depth: int, tree_paths: list[Paths]) -> list[list[Candidates]]:
            """One drafter forward over the R blocks of every greedy request's paths, each given at offsets 1..depth."""
            paths = [(row, path) for row, row_paths in zip(greedy, tree_paths) for path in row_paths]
            index = torch.tensor([row for row, _ in paths], device=self.device)                 # R: a request a block
            fills = torch.tensor([path for _, path in paths], device=self.device)                # (R, depth)
            context_kv, sees = self._batch_contexts([contexts[row] for row, _ in paths], block)
            hidden = self.block_hidden(last[index], None if last_stream is None else last_stream[index],
                                       first[index], context_kv, sees, block, k, fill_ids=fills)   # (R, k - depth, H)
            scores = self.head_scores(hidden)                                                     # (R, k - depth, N)
            kept = self.kept_candidates(*self.candidates(scores.flatten(0, 1), self.tree_candidates(k)[1]))
            rest = k - depth
            per_block = iter([kept[i * rest:(i + 1) * rest] for i in range(len(paths))])
            return [[next(per_block) for _ in row_paths] for row_paths in tree_paths]

        grown = grow_redrafts([candidates[row] for row in greedy], self.tree_nodes, self.tree_min_prob,
                              self.tree_redraft, min(self.tree_redraft_levels, k - 1), redraft)
        out: list[Redrafts] = [{} for _ in active]
        for row, redrafts in zip(greedy, grown):
            out[row] = redrafts
        return out

    def per_request(self, rows: list[list[tuple[int, float]]], num_seqs: int, k: int) -> list[Candidates]:
        """The candidates of the rows tree_candidates(k) selects, flat -> per request its positions' candidates."""
        if not rows:
            return [[] for _ in range(num_seqs)]
        per_seq = len(rows) // num_seqs
        return [rows[row * per_seq:(row + 1) * per_seq] for row in range(num_seqs)]

    def _draft(self, request: Request, tokens: list[int], probs: list[torch.Tensor | None],
               candidates: Candidates, confidence: list[float] | None,
               redrafts: Redrafts | None = None) -> Draft:
        """A request's kept drafts (a chain: tokens, their q, the drafter's confidences if measured) -> its Draft; a
        tree when the request is greedy and its candidates are every kept position's (tree_nodes; `redrafts`: the
        later positions' under its likeliest paths, tree_redraft), or are the first position's and offer runners-up
        (tree_width)."""
        if candidates and request.sampling_params.is_greedy:
            path_probs = None
            if self.tree_nodes:
                later = {path: c[:len(tokens) - len(path)] for path, c in redrafts.items()} if redrafts else None
                token_ids, parents, path_probs = marginal_tree(candidates[:len(tokens)], self.tree_nodes,
                                                               self.tree_min_prob, later)
            else:
                token_ids, parents = with_siblings(tokens, [t for t, _ in candidates[0]], self.tree_tails)
            if self.tree_nodes or len(token_ids) > len(tokens):   # NOTE: N paths, even fewer nodes than the chain
                return Draft(token_ids, None, parents, path_probs=path_probs)
        return Draft(tokens, None if probs[0] is None else torch.stack(probs), confidence=confidence)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_spec_tokens: int,
                generators: list[torch.Generator | None]) -> dict[str, Draft]:
        k = min(num_spec_tokens, self.max_num_spec_tokens)
        pairs = [(r, g) for r, g in zip(requests, generators) if self.ready(r)]
        if k < 1 or not pairs:
            return {}
        active = [r for r, _ in pairs]
        num_seqs = len(active)
        block = self.block_size                                                         # B: the trained block
        if self.lookahead_masks is not None:
            block = min(block, k + 1 + self.lookahead_masks)
        contexts = self._extend_contexts(active)
        k = self.offsets_to_draft(active, k)
        redrafted: list[Redrafts] = [{} for _ in active]
        # NOTE: redrafting under the likeliest paths is eager (its blocks are R = S x tree_redraft a level, not S)
        if (self.graphs is not None and self.graphs.fits(num_seqs) and not self.tree_redraft
                and all(r.sampling_params.is_greedy for r in active)):
            tokens, confidence, rows = self.graphs.run(contexts, [r.all_token_ids[-1] for r in active],
                                                       [r.num_tokens - 1 for r in active], block, k)
            best = self.per_request(rows, num_seqs, k)
            probs = [None] * len(tokens)
            if confidence is None:   # NOTE: no gate: every drafted position counts as sure
                confidence = [1.0] * len(tokens)
        else:
            tokens, probs, confidence, best, redrafted = self._draft_eagerly(active, contexts, block, k,
                                                                             [g for _, g in pairs])
        self.num_forwards += 1
        out = {}
        for row, request in enumerate(active):
            span = slice(row * k, (row + 1) * k)
            # NOTE: the whole block is drafted at once; only its confident head goes to verification.
            length = self.gate.length(confidence[span]) if self.gate.active else k
            if length:
                out[request.request_id] = self._draft(request, tokens[span][:length], probs[span][:length],
                                                     best[row], confidence[span][:length] if self.gate.active else None,
                                                     redrafted[row])
        return out


@dataclass(slots=True)
class DFlashProposerConfig:
    """conf/engine/proposer/dflash.yaml. `checkpoint: null` drafts with a random-init drafter (tests only),
    built from `drafter` (block size, layers, target layers read); draft_vocab_size: draft logits for the
    first N token ids only (0: all); weights: what the drafter's few-row products stream (auto, fp32, fp16, q8_0,
    q4_1, int8; feature_proposer.resolve_draft_weights); head_weights: what the draft head's stream (auto: as weights;
    resolve_head_weights);
    min_confidence, always_draft: the ConfidenceGate (verify the block's drafts while the product of their
    confidences stays >= min_confidence, the first always_draft regardless; lab/spec/feature_proposer.py);
    lookahead_masks: run a block of the last token + k + lookahead_masks masks, not the trained block (null);
    tree_width: verify the block's tree_width best first tokens, not only its best (a tree; 1: a chain), a runner-up
    only where the drafter gives it >= tree_min_prob; tree_tails: each runner-up followed by the block's later
    drafts too (they are drafted from the context alone, so they may follow any first token); denoise_steps: drafter
    forwards per block (1: one, all drafts in parallel): step p keeps its draft of offset p and gives the drafts kept
    so far to the next step as tokens, which drafts the later offsets again knowing them (the last step keeps all
    it drafts); needs a drafter trained with drafter.max_fill >= denoise_steps - 1; tree_nodes: verify a tree of
    the tree_nodes likeliest paths through the block's drafted offsets, each offset's candidates its best tokens and
    a path's probability the product of theirs (0: off; lab/spec/tree.py's marginal_tree), paths below
    tree_min_prob left out; tree_redraft: with tree_nodes, draft the block's later offsets again under each of the
    first position's tree_redraft likeliest tokens (all its candidates where it has fewer), given at offset 1 (one
    more drafter forward, eager; a drafter trained with drafter.max_fill >= 1), so the paths through a runner-up
    follow from it; tree_redraft_levels L: then under the tree's tree_redraft likeliest 2-token paths, ... L-token
    paths (a forward a level; a drafter trained with drafter.max_fill >= L)."""

    checkpoint: str | None = "checkpoints/smollm2/dflash_56k_weighted.pt"
    seed: int = 0
    drafter: dict = field(default_factory=dict)
    draft_vocab_size: int = 8192
    weights: str = "auto"
    head_weights: str = "auto"
    min_confidence: float = 0.0
    always_draft: int = 0
    lookahead_masks: int | None = None
    tree_width: int = 1
    tree_min_prob: float = 0.0
    tree_tails: bool = False
    denoise_steps: int = 1
    tree_nodes: int = 0
    tree_redraft: int = 0
    tree_redraft_levels: int = 1

    def _drafter_config(self) -> DFlashConfig:
        """The drafter's settings: the checkpoint's, or `drafter` for a random-init one (checkpoint None)."""
        if self.checkpoint is not None:
            return DFlashConfig(**read_drafter_config(resolve_checkpoint(self.checkpoint), "dflash"))
        try:
            return DFlashConfig(**dict(self.drafter))
        except TypeError as exc:
            raise LabError(f"engine.proposer.drafter has an unknown key ({exc})",
                           "use block_size, num_layers, feature_layers, intermediate_size, fuse_last_context, "
                           "mask_per_position, input_fusion, max_fill") from exc

    def kv_bytes_per_token(self, target: ModelRunner) -> int:
        """Kept per target KV slot: the token's target features (every layer the drafter reads). (The drafter's
        projected context K/V is kept per request, outside the blocks.)"""
        layers = self._drafter_config().resolved(target.config.num_layers).feature_layers
        return len(layers) * target.config.hidden_size * target.dtype.itemsize

    def build(self, target: ModelRunner, kv: KVCacheManager) -> DFlashProposer:
        if self.lookahead_masks is not None and self.lookahead_masks < 0:
            raise LabError(f"engine.proposer.lookahead_masks must be >= 0 or null, got {self.lookahead_masks}",
                           "set it to 0 (a block of the k drafts alone), 1-2, or null (the trained block)")
        fresh = None
        if self.checkpoint is None:
            config = self._drafter_config()
            with torch.random.fork_rng():
                torch.manual_seed(self.seed)
                fresh = DFlashDrafter(target.config, config, target.source.hf_config)
        weights = resolve_draft_weights(self.weights, target)
        drafter = build_drafter("dflash", target, self.checkpoint, fresh, weights)
        return DFlashProposer(target, drafter, kv, self.draft_vocab_size,
                              resolve_head_weights(self.head_weights, weights),
                              ConfidenceGate(self.min_confidence, self.always_draft), self.lookahead_masks,
                              self.tree_width, self.tree_min_prob, self.tree_tails, self.denoise_steps,
                              self.tree_nodes, self.tree_redraft, self.tree_redraft_levels)
