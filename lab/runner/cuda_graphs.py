"""DecodeGraphs: CUDA graphs for the pure-decode steps of the block-cache engines (cb_slots, cb_paged).

On a GPU a decode step of a small model is a few hundred short kernels whose launches cost more than
their work; a CUDA graph replays them all with one launch. A graph fixes shapes and addresses, so a step
of R requests runs in the graph of the smallest capture size P >= R (vLLM's `cudagraph_capture_sizes`)
and block-table width W (the next power of two of the step's widest table), through a StaticDecodeView
whose buffers the step's inputs are copied into. Each (P, W) graph is captured the first time a step
needs it (the engine's warm-up requests usually do it), all graphs sharing one memory pool. Steps with a
prefill chunk or more requests than the largest size run eagerly, as before.

Modes (conf/engine/cuda_graphs/default.yaml): `auto` = `cuda` on a GPU and `off` on CPU; `cuda` =
capture and replay; `eager` = the same fixed-shape step without capture (padding, buckets and the
static attention, testable on CPU); `off`.

Owns: graph capture, buckets, the static output buffer. Ignores: scheduling and sampling.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lab.errors import LabError
from lab.kv_cache.block_kv import BlockKVCache, StepIndex
from lab.kv_cache.static_decode import StaticDecodeView

MODES = ("auto", "cuda", "eager", "off")


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


@dataclass(slots=True)
class _Graph:
    view: StaticDecodeView
    graph: torch.cuda.CUDAGraph | None    # None in eager mode
    logits: torch.Tensor | None           # (P, V), the captured forward's output buffer


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
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.mode == "cuda" else None
        self.capture_s = 0.0
        self.reset_stats()

    def reset_stats(self) -> None:
        self.num_replays = self.num_rows = self.num_padded_rows = 0

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.capture_sizes[-1]

    def bucket(self, num_seqs: int, num_block_cols: int) -> tuple[int, int]:
        """(P, W): the graph a step of `num_seqs` requests with tables `num_block_cols` wide runs in."""
        rows = next(s for s in self.capture_sizes if s >= num_seqs)
        cols = min(1 << max(0, num_block_cols - 1).bit_length(), self.max_block_cols)
        return rows, max(cols, num_block_cols)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, index: StepIndex) -> torch.Tensor:
        """A decode step of R requests: input_ids (1, R), its StepIndex -> logits (R, V). The logits are a
        view of the graph's output buffer, valid until the next step."""
        num_seqs = index.block_tables.shape[0]
        key = self.bucket(num_seqs, index.block_tables.shape[1])
        graph = self._graphs.get(key) or self._build(*key)
        graph.view.load(input_ids[0], index)
        if graph.graph is not None:
            graph.graph.replay()
            logits = graph.logits
        else:
            logits = self._forward(graph.view)
        self.num_replays += 1
        self.num_rows += key[0]
        self.num_padded_rows += key[0] - num_seqs
        return logits[:num_seqs]

    def _forward(self, view: StaticDecodeView) -> torch.Tensor:
        view.begin_forward()
        hidden = self.model(view.input_ids, view.positions, view)            # (1, P, H)
        return self.model.compute_logits(hidden[0]).float()                 # (P, V)

    def _build(self, num_rows: int, num_block_cols: int) -> _Graph:
        view = StaticDecodeView(self.cache, num_rows, num_block_cols)
        graph = _Graph(view, None, None)
        if self.mode == "cuda":
            # NOTE: every row of a fresh view is padding: warm-up and capture write only the scratch block.
            start = time.perf_counter()
            side = torch.cuda.Stream(device=self.cache.device)
            side.wait_stream(torch.cuda.current_stream(self.cache.device))
            with torch.cuda.stream(side):
                for _ in range(2):   # NOTE: warm-up off the capture: lazy inits, cuBLAS workspaces, autotuning
                    self._forward(view)
            torch.cuda.current_stream(self.cache.device).wait_stream(side)
            graph.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph.graph, pool=self._pool):
                graph.logits = self._forward(view)
            torch.cuda.synchronize(self.cache.device)
            self.capture_s += time.perf_counter() - start
        self._graphs[(num_rows, num_block_cols)] = graph
        return graph

    def stats(self) -> dict[str, float]:
        return {"cuda_graph/num_graphs": len(self._graphs), "cuda_graph/replays": self.num_replays,
                "cuda_graph/capture_s": self.capture_s,
                "cuda_graph/padded_row_share": self.num_padded_rows / max(1, self.num_rows)}
