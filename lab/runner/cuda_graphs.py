"""DecodeGraphs: CUDA graphs for the pure-decode and verify steps of the block-cache engines (cb_slots,
cb_paged, speculative).

On a GPU a decode step of a small model is a few hundred short kernels whose launches cost more than
their work; a CUDA graph replays them all with one launch. A graph fixes shapes and addresses, so a step
of R requests runs in the graph of the smallest capture size P >= R (vLLM's `cudagraph_capture_sizes`),
block-table width W (the next power of two of the step's widest table) and query length Q (1 for a plain
decode step; 1 + the most drafts of any request for a speculative verify step), through a StaticDecodeView
whose buffers the step's inputs are copied into. Each (P, W, Q) graph is captured the first time a step
needs it (the engine's warm-up requests usually do it), all graphs sharing one memory pool. The graph ends
at the final norm (and, for drafters that read them, the target features); the LM head then runs on the
step's real tokens only, as vLLM does. Steps with a prefill chunk or more requests than the largest size
run eagerly, as before.

Modes (conf/engine/cuda_graphs/default.yaml): `auto` = `cuda` on a GPU and `off` on CPU; `cuda` =
capture and replay; `eager` = the same fixed-shape step without capture (padding, buckets and the
static attention, testable on CPU); `off`.

Owns: graph capture, buckets, the static output buffers. Ignores: scheduling and sampling.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lab.errors import LabError
from lab.kv_cache.block_kv import BlockKVCache, StepIndex
from lab.kv_cache.static_decode import StaticDecodeView

MODES = ("auto", "cuda", "eager", "off")
T = TypeVar("T")
# NOTE: eager steps keep cuDNN's fused attention off (lab/runner/device.py: a host-side plan per shape); a graph
# pays that plan once, at capture, and its replays run cuDNN's kernels, the fastest here on the H200.
GRAPH_ATTENTION = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]


@dataclass(slots=True)
class CudaGraphConfig:
    """conf/engine/cuda_graphs/default.yaml."""

    mode: str = "auto"
    capture_sizes: Sequence[int] = field(default_factory=lambda: (1, 2, 4, 8, 16, 32, 64, 128))

    def resolve_mode(self, device: torch.device) -> str:
        if self.mode not in MODES:
            raise LabError(f"unknown engine.cuda_graphs.mode {self.mode!r}", f"use one of {', '.join(MODES)}")
        if self.mode == "cuda" and device.type != "cuda":
            raise LabError(f"engine.cuda_graphs.mode=cuda needs a CUDA device, the model is on {device}",
                           "use engine.cuda_graphs.mode=auto (graphs on a GPU only) or eager")
        if self.mode == "auto":
            return "cuda" if device.type == "cuda" else "off"
        return self.mode


def bucket_size(capture_sizes: Sequence[int], num_seqs: int) -> int:
    """The smallest capture size >= num_seqs (sorted sizes; the caller checks that one fits)."""
    return next(s for s in capture_sizes if s >= num_seqs)


def pow2_width(width: int, cap: int) -> int:
    """A fixed width for `width` columns: the next power of two, at most `cap` (but never below `width`)."""
    return max(min(1 << max(0, width - 1).bit_length(), cap), width)


def capture(forward: Callable[[], T], device: torch.device, pool: object) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture `forward` (whose inputs are static buffers) into a CUDA graph sharing `pool`, after two warm-up
    runs off the capture (lazy inits, cuBLAS workspaces, autotuning) -> (the graph, its output buffers)."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with sdpa_kernel(GRAPH_ATTENTION):
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = forward()
    torch.cuda.synchronize(device)
    return graph, outputs


@dataclass(slots=True)
class _Graph:
    view: StaticDecodeView
    graph: torch.cuda.CUDAGraph | None    # None in eager mode
    hidden: torch.Tensor | None           # (P*Q, H), the captured forward's output buffer
    features: torch.Tensor | None         # (P*Q, F) with feature layers, else None


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, cache: BlockKVCache, config: CudaGraphConfig,
                 max_num_seqs: int, max_model_len: int) -> None:
        self.mode = config.resolve_mode(cache.device)
        sizes = sorted({int(s) for s in config.capture_sizes if int(s) >= 1})
        if not sizes:
            raise LabError(f"engine.cuda_graphs.capture_sizes has no size >= 1: {list(config.capture_sizes)}",
                           "use e.g. [1, 2, 4, 8, 16, 32, 64]")
        # NOTE: no graph larger than the batch the scheduler can ever form.
        self.capture_sizes = sorted({min(s, max_num_seqs) for s in sizes})
        self.max_block_cols = -(-max_model_len // cache.block_size)
        self.model, self.cache = model, cache
        self.max_query_len = 1                       # 1 + the most drafts a verify step carries (configure)
        self.feature_layers: tuple[int, ...] = ()    # target layers whose features the graphs also return
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.mode == "cuda" else None
        self.capture_s = 0.0
        self.reset_stats()

    def configure(self, max_query_len: int, feature_layers: tuple[int, ...] = ()) -> None:
        """Also run verify steps of up to `max_query_len` tokens per request, and return the target features
        at `feature_layers` (EAGLE, DFlash); before any graph is captured."""
        if self._graphs:
            raise LabError("DecodeGraphs.configure after graphs were captured", "configure the engine's graphs first")
        num_layers = len(self.model.layers)
        self.max_query_len = max(1, max_query_len)
        self.feature_layers = tuple(i % num_layers for i in feature_layers)

    def reset_stats(self) -> None:
        self.num_replays = self.num_rows = self.num_padded_rows = 0

    def fits(self, num_seqs: int, max_query_len: int = 1) -> bool:
        return num_seqs <= self.capture_sizes[-1] and max_query_len <= self.max_query_len

    def bucket(self, num_seqs: int, num_block_cols: int) -> tuple[int, int]:
        """(P, W): the graph a step of `num_seqs` requests with tables `num_block_cols` wide runs in."""
        return bucket_size(self.capture_sizes, num_seqs), pow2_width(num_block_cols, self.max_block_cols)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, index: StepIndex) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode or verify step of R requests, N tokens: input_ids (1, N), its StepIndex -> (logits (N, V)
        at every token, the features (N, F) at `feature_layers` or None)."""
        num_seqs = index.block_tables.shape[0]
        key = (*self.bucket(num_seqs, index.block_tables.shape[1]), int(index.query_lens.max()))
        graph = self._graphs.get(key) or self._build(*key)
        token_rows = graph.view.load(input_ids[0], index)                                      # (N,)
        if graph.graph is not None:
            graph.graph.replay()
            hidden, features = graph.hidden, graph.features
        else:
            hidden, features = self._forward(graph.view)
        self.num_replays += 1
        self.num_rows += key[0] * key[2]
        self.num_padded_rows += key[0] * key[2] - token_rows.numel()
        logits = self.model.compute_logits(hidden.index_select(0, token_rows)).float()         # (N, V)
        return logits, None if features is None else features.index_select(0, token_rows)

    def _forward(self, view: StaticDecodeView) -> tuple[torch.Tensor, torch.Tensor | None]:
        view.begin_forward()
        if not self.feature_layers:
            return self.model(view.input_ids, view.positions, view)[0], None                 # (P*Q, H)
        hidden, features = self.model.forward_with_features(view.input_ids, view.positions, view,
                                                            self.feature_layers)
        return hidden[0], features[0]                                                        # (P*Q, H), (P*Q, F)

    def _build(self, num_rows: int, num_block_cols: int, query_len: int) -> _Graph:
        view = StaticDecodeView(self.cache, num_rows, num_block_cols, query_len)
        graph = _Graph(view, None, None, None)
        if self.mode == "cuda":
            # NOTE: every row of a fresh view is padding: warm-up and capture write only the scratch block.
            start = time.perf_counter()
            graph.graph, (graph.hidden, graph.features) = capture(lambda: self._forward(view), self.cache.device,
                                                                  self._pool)
            self.capture_s += time.perf_counter() - start
        self._graphs[(num_rows, num_block_cols, query_len)] = graph
        return graph

    def stats(self) -> dict[str, float]:
        # NOTE: padded_row_share: the share of the graphs' query tokens that were padding (rows and drafts).
        return {"cuda_graph/num_graphs": len(self._graphs), "cuda_graph/replays": self.num_replays,
                "cuda_graph/capture_s": self.capture_s,
                "cuda_graph/padded_row_share": self.num_padded_rows / max(1, self.num_rows)}
