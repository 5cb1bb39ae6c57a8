"""ModelRunner: builds our decoder from a ModelSource, owns its device/dtype and KV tensors, runs forwards.

Owns: nn.Module, KV-cache allocation, turning token ids + positions into logits. Ignores: queues.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from lab import huge_pages as huge_pages_module
from lab.errors import LabError
from lab.kv_cache import AttentionCache, BlockKVCache, ContiguousKVCache
from lab.models import native_gemv, native_tiles
from lab.models.block_rows import measure_block_isa, measure_block_rows
from lab.models.config import DecoderConfig
from lab.models.decoder import DecoderModel
from lab.models.packed_linear import BLOCK_MAX_ROWS, GEMV_MAX_ROWS, PackedLinear, can_pack, pack_linear_weights
from lab.models.sources import ModelSource
from lab.runner.device import avoid_per_shape_attention_plans, resolve_device, resolve_dtype
from lab.sample.sampler import argmax_rows


log = logging.getLogger(__name__)

WeightBlocks = Literal["auto", "off"]
WEIGHT_BLOCKS: tuple[WeightBlocks, ...] = ("auto", "off")
BlockKernel = Literal["auto", "amx", "avx"]
BLOCK_KERNELS: tuple[BlockKernel, ...] = ("auto", "amx", "avx")
GreedyHead = Literal["auto", "off"]
GREEDY_HEADS: tuple[GreedyHead, ...] = ("auto", "off")


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple, set)) else {int(value)}


class ModelRunner:
    def __init__(self, source: ModelSource, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, weight_blocks: WeightBlocks = "auto",
                 block_rows: int | str = "auto", block_kernel: BlockKernel = "auto",
                 huge_pages: huge_pages_module.HugePages = "auto", greedy_head: GreedyHead = "auto") -> None:
        """`weight_blocks`: "auto" streams every projection whose fp32 weights are exactly GGUF block values (the
        bundled SmolLM2's are: it is a Q4_1 GGUF) as those blocks in few-row forwards, bit-identically
        (lab/models/weight_blocks.py); "off" keeps the fp32 weights (A/B runs). `block_kernel`: "amx" streams them
        through AMX tiles (lab/models/native_tiles.py: up to 16 rows for little more than one, within fp32
        rounding), "avx" through the AVX kernel (bit-identical to the fp32 weights), "auto" = amx where the CPU has
        AMX-BF16, else avx. `block_rows`: the most rows such a forward may have, "auto" = 64 on tiles, else
        measured here at load (lab/models/block_rows.py), or an integer from 1 to 64. `huge_pages`: "auto" moves
        the blocks onto 2 MiB pages where Linux offers them (lab/huge_pages.py: fewer TLB misses a step, the same
        values), "on" the same or an error, "off" leaves them on the allocator's pages (A/B runs). `greedy_head`:
        "auto" finds greedy rows' argmax without their logits where the head streams Q8_0 blocks on a CPU with
        AVX-512 VNNI (lab/models/native_head.py: the same token ids, ~2.3x faster at 7 rows), "off" computes every
        logit (A/B runs)."""
        wants_huge_pages = huge_pages_module.resolve(huge_pages)
        if greedy_head not in GREEDY_HEADS:
            raise LabError(f"model.greedy_head={greedy_head!r} is not one of {', '.join(GREEDY_HEADS)}",
                           "use model.greedy_head=auto (screen greedy rows' argmax where the head is Q8_0 blocks) "
                           "or off")
        if weight_blocks not in WEIGHT_BLOCKS:
            raise LabError(f"model.weight_blocks={weight_blocks!r} is not one of {', '.join(WEIGHT_BLOCKS)}",
                           "use model.weight_blocks=auto (stream exact GGUF blocks where the weights are) or off")
        if block_kernel not in BLOCK_KERNELS:
            raise LabError(f"model.block_kernel={block_kernel!r} is not one of {', '.join(BLOCK_KERNELS)}",
                           "use model.block_kernel=auto (AMX tiles where the CPU has them), amx or avx")
        if block_rows != "auto" and (isinstance(block_rows, bool) or not isinstance(block_rows, int)
                                     or not 1 <= block_rows <= GEMV_MAX_ROWS):
            raise LabError(f"model.block_rows={block_rows!r} is neither auto nor an integer from 1 to "
                           f"{GEMV_MAX_ROWS} (the rows the native GEMV, which GGUF blocks feed, serves)",
                           f"use model.block_rows=auto (measured here at load) or an integer from 1 to "
                           f"{GEMV_MAX_ROWS}")
        self.source = source
        self.model_id = source.model_id
        self.device = resolve_device(device)
        avoid_per_shape_attention_plans(self.device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.config = DecoderConfig.from_hf(source.hf_config)
        model = DecoderModel(self.config, source.hf_config)
        model.load_hf_state_dict(source.state_dict)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        if self.device.type == "cpu" and self.dtype == torch.float32 and native_gemv.load_kernel() is None:
            # NOTE: batch-1 decode's one-row linears run the native GEMV on the (out, in) row-major weights,
            # the layout it reads fastest; without it, MKL's gemv reads column-major weights faster than
            # row-major ones (docs/benchmarks.md). fp32 only: CPU bf16 matmuls (oneDNN) repack a
            # column-major weight on every call, ~6x slower.
            self.model.use_column_major_weights()
        if can_pack(self.device, self.dtype):
            # NOTE: batched forwards (2+ rows) run oneDNN on a prepacked copy, ~1.3x MKL's sgemm at 32-64 rows.
            pack_linear_weights(self.model)
        self.use_huge_pages = wants_huge_pages and self.device.type == "cpu"   # NOTE: a GPU's memory has its own pages
        self.block_linears = 0          # how many projections stream GGUF blocks (weight_blocks="auto")
        self.block_kernel: BlockKernel = "avx"   # the kernel they stream through (block_kernel)
        if weight_blocks == "auto" and can_pack(self.device, self.dtype) and native_gemv.AVAILABLE:
            self.block_kernel = self._resolve_block_kernel(block_kernel)
            tiles = self.block_kernel == "amx"
            self.block_linears, linears = self.model.use_block_weights(tiles=tiles)
            if self.block_linears and self.use_huge_pages:
                self.model.use_huge_pages()
            if self.block_linears and not tiles:
                self._choose_block_isa()
            if self.block_linears:
                self.model.set_block_max_rows(GEMV_MAX_ROWS if tiles and block_rows == "auto"
                                              else self._block_rows(block_rows))
                log.info("streaming %d of %d linears as their exact GGUF blocks (%s, %.0f MB a decode step instead "
                         "of %.0f) in forwards of up to %d rows", self.block_linears, linears, self.block_kernel,
                         self.streamed_weight_bytes / 2**20, self.weight_bytes / 2**20, self.model.block_max_rows)
            if self.block_linears and greedy_head == "auto" and self.model.use_head_screen(self.use_huge_pages):
                log.info("greedy rows' argmax screened over the head's Q8_0 blocks (%.0f MB more)",
                         self.model.head_screen.nbytes / 2**20)
        self.tokenizer = source.tokenizer
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.eos_token_ids = _as_id_set(getattr(source.hf_config, "eos_token_id", None))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))
        self._hf_model: torch.nn.Module | None = None

    @staticmethod
    def _resolve_block_kernel(block_kernel: BlockKernel) -> BlockKernel:
        if block_kernel == "avx":
            return "avx"
        if native_tiles.available():
            return "amx"
        if block_kernel == "amx":
            raise LabError("model.block_kernel=amx, but this machine cannot run AMX tiles (the CPU lacks "
                           f"{'/'.join(native_tiles.CPU_FLAGS)}, or Linux refused the tile state)",
                           "use model.block_kernel=auto (AMX where available, else AVX) or avx")
        return "avx"

    def _choose_block_isa(self) -> None:
        measured = measure_block_isa(self.model.block_pairs())
        if measured is not None:
            log.info("GGUF blocks, AVX-512 against AVX2 here, by rows: %s (%.2f s): %s", ", ".join(
                f"{rows}: {s:.2f}x" for rows, s in measured.speedups.items()), measured.seconds,
                "AVX-512" if measured.avx512 else "AVX2")

    def _block_rows(self, block_rows: int | str) -> int:
        if block_rows != "auto":
            return int(block_rows)
        measured = measure_block_rows(self.model.block_pairs(), BLOCK_MAX_ROWS)
        log.info("GGUF blocks against fp32 weights here, by rows: %s (%.2f s): blocks up to %d rows",
                 ", ".join(f"{rows}: {s:.2f}x" for rows, s in measured.speedups.items()), measured.seconds,
                 measured.max_rows)
        return measured.max_rows

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def weight_bytes(self) -> int:
        params = {id(p): p for p in self.model.parameters()}  # tied weights count once
        return sum(p.numel() * p.element_size() for p in params.values())

    @property
    def streamed_weight_bytes(self) -> int:
        """weight_bytes with every projection that streams GGUF blocks counted at its blocks' size: the bytes a
        batch-1 decode step reads, as weight_bytes is for fp32 weights."""
        linears = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        streamed = {id(m.weight): (m.fresh_blocks() if isinstance(m, PackedLinear) else None) for m in linears}
        total = 0
        for p in {id(p): p for p in self.model.parameters()}.values():
            blocks = streamed.get(id(p))
            total += blocks.numel() if blocks is not None else p.numel() * p.element_size()
        return total

    def allocate_kv_cache(self, batch_size: int, max_len: int) -> ContiguousKVCache:
        c = self.config
        return ContiguousKVCache(c.num_layers, batch_size, max_len, c.num_kv_heads, c.head_dim,
                                 self.dtype, self.device)

    def allocate_block_kv_cache(self, num_blocks: int, block_size: int, backend: str = "fast",
                                scratch_block: bool = False) -> BlockKVCache:
        """KV storage in `num_blocks` blocks of `block_size` tokens (slots: one block per request), plus a
        scratch block for padding rows if asked (CUDA-graph decode steps)."""
        c = self.config
        return BlockKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size, self.dtype,
                            self.device, backend, scratch_block)

    @property
    def greedy_head(self) -> bool:
        """Whether greedy rows' argmax skips their logits (model.greedy_head: lab/models/native_head.py)."""
        return self.model.head_screen is not None

    def _head(self, hidden: torch.Tensor, greedy: bool) -> torch.Tensor:
        """hidden (..., H) -> logits (..., V) fp32, or with `greedy` their argmax token ids (...) int64: the greedy
        screen's where it takes the rows, else the logits' argmax."""
        if greedy and (token_ids := self.model.greedy_tokens(hidden)) is not None:
            return token_ids
        logits = self.model.compute_logits(hidden).float()
        return argmax_rows(logits) if greedy else logits

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: AttentionCache,
                logits_index: int | torch.Tensor | None = -1, greedy: bool = False) -> torch.Tensor:
        """input_ids, positions (B, T) -> logits (B, V) at `logits_index` (None: all positions, (B, T, V);
        a 1-D tensor of R positions: (B, R, V), e.g. each request's last token in a flat batch). With `greedy`,
        their argmax token ids instead ((B,), (B, T) or (B, R) int64), without the logits where the head's greedy
        screen takes them (model.greedy_head)."""
        hidden = self.model(input_ids.to(self.device), positions.to(self.device), cache)  # (B, T, H)
        if logits_index is not None:
            hidden = hidden[:, logits_index]                                               # (B, H)
        return self._head(hidden, greedy)

    @torch.inference_mode()
    def execute_with_features(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: AttentionCache,
                              logits_index: torch.Tensor, feature_layers: tuple[int, ...], greedy: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """execute, plus the target features every position produced: (logits (B, R, V) or with `greedy` their
        argmax ids (B, R), features (B, T, len(feature_layers) * H)); layer indices may be negative (-1 = the last
        layer)."""
        layers = tuple(i % self.config.num_layers for i in feature_layers)
        hidden, features = self.model.forward_with_features(input_ids.to(self.device), positions.to(self.device),
                                                            cache, layers)
        return self._head(hidden[:, logits_index], greedy), features

    def hf_model(self) -> torch.nn.Module:
        """HF transformers' model with the same weights, dtype and device (built once)."""
        if self._hf_model is None:
            self._hf_model = self.source.build_hf_model(self.dtype, self.device)
        return self._hf_model
