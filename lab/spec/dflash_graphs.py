"""DFlashBlockGraphs: DFlash's block forward and its greedy draft head in CUDA graphs (or in their fixed-shape
eager form, which is how CPU tests run them), so that a GPU drafts a block with one launch instead of a Python
launch per drafter op (lab/runner/cuda_graphs.py does the same for the target's decode and verify steps).

A drafting step of S requests runs in the graph of capture size P >= S, context width C (the next power of two
of the longest context), block B and k draft rows. Each request's context K/V (the proposer's _ContextKV, every
drafter layer) is copied into row r of a static (layers, 2, P, Hkv, C, D) buffer and masked past its length;
its last token, the context stream before its block and the block's first position go into small static
buffers. The graph then builds the block inputs, runs the drafter and takes the head's argmax over block rows
1..k (with denoising steps, again with the drafts kept so far filled in, redrafting the rest). It returns the
tokens (P, k) and, with a confidence gate, the largest probability at each (P, k). Padding rows see no context and
are never read.

Owns: the static buffers, the buckets and the capture of the drafter's block forward. Ignores: which request a
row is; projecting new context positions (eager, a few ops over the new positions only); sampled drafts (eager).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lab.runner.cuda_graphs import bucket_size, capture, pow2_width

if TYPE_CHECKING:
    from lab.spec.dflash import DFlashProposer, _ContextKV

MIN_CONTEXT_WIDTH = 64   # NOTE: short contexts share one graph instead of one per power of two below this


@dataclass(slots=True)
class _BlockInputs:
    """The static inputs of every graph of P rows and context width C (graphs of other blocks or k share them)."""

    context: torch.Tensor                         # (layers, 2, P, Hkv, C, D) every row's context K/V
    context_lens: torch.Tensor                    # (P,) context positions each row sees
    last_ids: torch.Tensor                        # (P,) the token each block starts from
    last_stream: torch.Tensor                     # (P, 1, H) the context stream of the position before the block
    first_positions: torch.Tensor                 # (P,) the block's first position


@dataclass(slots=True)
class _BlockGraph:
    inputs: _BlockInputs
    graph: torch.cuda.CUDAGraph | None            # None in eager mode
    outputs: tuple[torch.Tensor, torch.Tensor | None] | None   # the captured (tokens (P, k), confidence (P, k))


class DFlashBlockGraphs:
    def __init__(self, proposer: DFlashProposer, mode: str, capture_sizes: Sequence[int], max_context: int) -> None:
        self.proposer, self.mode = proposer, mode
        self.capture_sizes = sorted(capture_sizes)
        self.max_context = max_context
        self._graphs: dict[tuple[int, int, int, int], _BlockGraph] = {}
        # NOTE: the context buffer is the big one (P x C positions of every layer's K/V): one per (P, C), shared by
        # the graphs of every block size and k; replays are sequential, so sharing inputs is safe.
        self._inputs: dict[tuple[int, int], _BlockInputs] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.num_replays = 0
        self.capture_s = 0.0

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.capture_sizes[-1]

    @torch.inference_mode()
    def run(self, contexts: list[_ContextKV], last_ids: list[int], first_positions: list[int], block: int,
            k: int) -> tuple[list[int], list[float] | None, list[list[tuple[int, float]]]]:
        """S requests' contexts, last tokens and block starts -> their k greedy drafts each, flat (S * k,), with a
        confidence gate the drafter's largest probability at each (else None), and the candidates of the rows the
        proposer's tree_candidates(k) selects, flat in request order (else [])."""
        num_seqs = len(contexts)
        width = pow2_width(max(MIN_CONTEXT_WIDTH, *(c.length for c in contexts)), self.max_context)
        key = (bucket_size(self.capture_sizes, num_seqs), width, block, k)
        graph = self._graphs.get(key) or self._build(*key, contexts[0].data)
        self._load(graph.inputs, contexts, last_ids, first_positions)
        if graph.graph is not None:
            graph.graph.replay()
            tokens, confidence, top = graph.outputs
        else:
            tokens, confidence, top = self._forward(graph.inputs, block, k)
        self.num_replays += 1
        tokens_list = tokens[:num_seqs].flatten().tolist()
        best = ([] if top is None
                else self.proposer.kept_candidates(top[0][:num_seqs].flatten(0, 1), top[1][:num_seqs].flatten(0, 1)))
        return tokens_list, None if confidence is None else confidence[:num_seqs].flatten().tolist(), best

    def _load(self, inputs: _BlockInputs, contexts: list[_ContextKV], last_ids: list[int],
              first_positions: list[int]) -> None:
        num_seqs, device = len(contexts), inputs.context.device
        for row, context in enumerate(contexts):
            inputs.context[:, :, row, :, :context.length].copy_(context.data[:, :, :, :context.length])
        inputs.context_lens.zero_()
        inputs.context_lens[:num_seqs].copy_(torch.tensor([c.length for c in contexts]).to(device))
        inputs.last_ids.zero_()
        inputs.last_ids[:num_seqs].copy_(torch.tensor(last_ids).to(device))
        inputs.first_positions.zero_()
        inputs.first_positions[:num_seqs].copy_(torch.tensor(first_positions).to(device))
        if self.proposer.drafter.reads_last_context:
            inputs.last_stream[:num_seqs, 0].copy_(torch.stack([c.last_stream for c in contexts]))

    def _forward(self, inputs: _BlockInputs, block: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        proposer = self.proposer
        num_rows, width = inputs.context.shape[2], inputs.context.shape[4]
        last_stream = inputs.last_stream if proposer.drafter.reads_last_context else None
        sees_context = torch.arange(width, device=inputs.context.device) < inputs.context_lens[:, None]  # (P, C)
        sees = torch.cat((sees_context, sees_context.new_ones(num_rows, block)), dim=1)            # (P, C + B)
        mask = sees[:, None, None].expand(num_rows, 1, block, width + block)                       # (P, 1, B, C + B)
        context_kv = [(layer[0], layer[1]) for layer in inputs.context]
        hidden = proposer.block_hidden(inputs.last_ids, last_stream, inputs.first_positions, context_kv, mask,
                                       block, k)                                                 # (P, k, H)
        scores = proposer.head_scores(hidden)                                                    # (P, k, N)
        tokens, confidence = proposer.greedy_from_scores(scores)                                 # (P, k) each
        tree_rows, width = proposer.tree_candidates(k)
        # NOTE: (P, rows, W) each: every position's candidates (tree_nodes), or the first position's (tree_width)
        top = proposer.candidates(scores[:, tree_rows], width) if tree_rows is not None else None
        for committed in range(1, min(proposer.denoise_steps, k)):   # NOTE: the proposer's denoising steps, in-graph
            hidden = proposer.block_hidden(inputs.last_ids, last_stream, inputs.first_positions, context_kv, mask,
                                           block, k, fill_ids=tokens[:, :committed])              # (P, k - c, H)
            redrafted, sure = proposer.greedy_from_scores(proposer.head_scores(hidden))
            tokens = torch.cat((tokens[:, :committed], redrafted), dim=1)
            if confidence is not None:
                confidence = torch.cat((confidence[:, :committed], sure), dim=1)
        return tokens, confidence, top

    def _build(self, num_rows: int, width: int, block: int, k: int, sample: torch.Tensor) -> _BlockGraph:
        """sample: a context's data (layers, 2, Hkv, capacity, D), for the buffers' shapes, dtype and device."""
        inputs = self._inputs.get((num_rows, width)) or self._new_inputs(num_rows, width, sample)
        graph = _BlockGraph(inputs, None, None)
        if self.mode == "cuda":
            start = time.perf_counter()
            graph.graph, graph.outputs = capture(lambda: self._forward(inputs, block, k), sample.device, self._pool)
            self.capture_s += time.perf_counter() - start
        self._graphs[(num_rows, width, block, k)] = graph
        return graph

    def _new_inputs(self, num_rows: int, width: int, sample: torch.Tensor) -> _BlockInputs:
        layers, _, num_kv_heads, _, head_dim = sample.shape
        device, dtype = sample.device, sample.dtype
        hidden = self.proposer.target.config.hidden_size
        inputs = _BlockInputs(
            context=torch.zeros(layers, 2, num_rows, num_kv_heads, width, head_dim, dtype=dtype, device=device),
            context_lens=torch.zeros(num_rows, dtype=torch.long, device=device),
            last_ids=torch.zeros(num_rows, dtype=torch.long, device=device),
            last_stream=torch.zeros(num_rows, 1, hidden, dtype=dtype, device=device),
            first_positions=torch.zeros(num_rows, dtype=torch.long, device=device))
        self._inputs[(num_rows, width)] = inputs
        return inputs

    def stats(self) -> dict[str, float]:
        return {"spec/draft_graphs": len(self._graphs), "spec/draft_graph_replays": self.num_replays,
                "spec/draft_graph_capture_s": self.capture_s}
