"""Linear layers with a second copy of their weight prepacked for batched GEMM on CPU (fp32).

Owns: choosing per call between the module's own weight, the packed copy and the native GEMV. Up to
NATIVE_MAX_ROWS rows (batch-1 decode, a verify step's k + 1 tokens, a small decode batch) go to
lab/models/native_gemv.py's kernel on the module's own (out, in) row-major weight when the kernel is
built; without it, one row goes to F.linear, i.e. MKL's gemv on the column-major layout ModelRunner then
sets (DecoderModel.use_column_major_weights). More rows (batched decode, prefill) go to a copy packed once
for a GEMM: lab/models/native_gemm.py's panels when the kernels are built (`native`, the default), else
oneDNN's blocked layout (`onednn`; LAB_GEMM=onednn picks it for A/B runs). Where the weight is exactly GGUF block
values (the bundled SmolLM2: use_block_weights), the few-row GEMV streams those blocks instead, bit-identically.
Ignores: what the layers compute; the state dict (the copies are plain attributes, never saved).

NOTE: measured on this CPU (1 thread, SmolLM2-135M's 121 linears in sequence, weights streamed from
DRAM as in a forward): MKL sgemm reaches 42 / 48 GFLOP/s at 32 / 64 rows, oneDNN on prepacked weights
53 / 63, the native panel GEMM 80-91 at 64 rows; at one row the native GEMV reads the weights at 23-26
GB/s against 13-24 for MKL's gemv on the column-major weight and 11-18 on the row-major one; at 2 / 5 / 8 / 12 rows a native call costs ~1.05 /
1.5 / 2.0 / 2.7 one-row calls against 2.0-2.6 / 2.3-2.7 / 2.4-3.9 / 3.1-3.9 for oneDNN
(experiments/bench_gemv.py --rows); since input rows go in threes, 3 / 5 / 8 rows cost ~1.2-1.3 / 1.2-1.6 /
1.6-1.9 (a whole verify step of 3 / 5 / 8 tokens: 1.15 / 1.33 / 1.65 plain steps, docs/speculative.md).
docs/benchmarks.md, docs/profiling.md.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lab import huge_pages
from lab.models import native_gemm, native_gemv, native_head, native_tiles, weight_blocks

GemmBackend = Literal["native", "onednn"]
GEMM_BACKENDS: tuple[GemmBackend, ...] = ("native", "onednn")

# NOTE: oneDNN picks its blocked layout for a typical row count; any count >= 8 measured the same.
PACK_BATCH_HINT = 64
# NOTE: the native kernel reads each weight once for all rows; it stays ahead of oneDNN up to ~12 rows here
# (2.5-3.9 one-row calls at 12 against 3.1-3.9; even at 16, behind at 24): a verify step of 4 requests x 3.
NATIVE_MAX_ROWS = 12
# NOTE: GGUF blocks (use_block_weights) serve at least this many rows: widening a block costs arithmetic that grows
# with the rows, so from a few rows the fp32 weights' sweep may catch up (experiments/bench_gemv.py --blocks, 1
# thread: SmolLM2's projections 1.5-2.3x faster on blocks at 1-5 rows on every machine so far; 0.9-1.35x at 6-12,
# by machine). ModelRunner measures how far past it blocks still pay here (lab/models/block_rows.py).
BLOCK_MAX_ROWS = 5
# NOTE: the native GEMV's row limit, and where AMX tiles serve (lab/models/native_tiles.py): 64 rows cost ~6 one-row
# calls there, against ~15 on the AVX blocks (experiments/bench_gemv.py --tiles, docs/benchmarks.md).
GEMV_MAX_ROWS = 64


def default_backend() -> GemmBackend:
    """`native` where the kernels are built, else `onednn`; LAB_GEMM=onednn|native overrides (A/B runs)."""
    wanted = os.environ.get("LAB_GEMM", "native")
    if wanted not in GEMM_BACKENDS:
        raise ValueError(f"LAB_GEMM={wanted!r}: expected one of {', '.join(GEMM_BACKENDS)}")
    if wanted == "native" and native_gemv.load_kernel() is None:
        return "onednn"
    return wanted


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Linear):
    """nn.Linear whose forward uses the native GEMV for inputs of up to NATIVE_MAX_ROWS rows and `packed`
    (native panels or oneDNN's layout, per `backend`) for more."""

    packed: torch.Tensor | None = None
    backend: GemmBackend = "onednn"          # the layout of `packed`
    _packed_key: tuple[int, int] = (0, -1)   # (data_ptr, version) of the weight the copy was made from
    half_weight: torch.Tensor | None = None  # an fp16 copy for the few-row GEMV (drafters only: use_half_weights)
    _half_key: tuple[int, int] = (0, -1)
    blocks: torch.Tensor | None = None       # the weight's exact GGUF blocks for the few-row GEMV (use_block_weights)
    _blocks_key: tuple[int, int] = (0, -1)
    block_max_rows: int = BLOCK_MAX_ROWS     # calls of up to this many rows stream `blocks`
    int8: native_head.Int8Weight | None = None   # Q8_0 blocks in 8-bit integer products (drafters: use_int8_weights)
    _int8_key: tuple[int, int] = (0, -1)

    def pack(self, backend: GemmBackend | None = None, batch_hint: int = PACK_BATCH_HINT) -> None:
        backend = backend or default_backend()
        if backend not in GEMM_BACKENDS:
            raise ValueError(f"unknown GEMM backend {backend!r}: expected one of {', '.join(GEMM_BACKENDS)}")
        with torch.no_grad():
            if backend == "native":
                self.packed = native_gemm.pack(self.weight)
            else:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)
        self.backend = backend
        self._packed_key = self._weight_key()

    def _weight_key(self) -> tuple[int, int]:
        return self.weight.data_ptr(), self.weight._version

    def fresh_blocks(self) -> torch.Tensor | None:
        """`blocks` while they still hold the live weight's values, else None."""
        return self.blocks if self.blocks is not None and self._blocks_key == self._weight_key() else None

    def fresh_int8(self) -> native_head.Int8Weight | None:
        """`int8` while it still holds the live weight's values, else None."""
        return self.int8 if self.int8 is not None and self._int8_key == self._weight_key() else None

    def half_copy_serves(self, x: torch.Tensor) -> bool:
        """Whether input x goes to the fp16 copy: a few rows, a fresh copy, and the native kernel usable."""
        return (0 < x.numel() <= NATIVE_MAX_ROWS * self.in_features and self.half_weight is not None
                and self._half_key == self._weight_key() and native_gemv.usable(x, self.weight, self.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: a weight replaced or changed in place after packing makes the copy stale: fall back. oneDNN's
        # op and the native GEMV have no autograd kernel, so anything that backpropagates (drafter
        # training) takes F.linear too. The GEMV reads the live weight (no copy, so never stale) and needs
        # it row-major: a column-major weight (no kernel at load time) stays on MKL.
        if torch.get_float32_matmul_precision() == "medium" and x.device.type == "cpu":
            # NOTE: the native kernels multiply in fp32; under "medium" (drafter training's train.matmul_precision,
            # lab/training/precision.py) torch's products take bf16 inputs on AMX, several times the rate. The
            # precision is read first: ~0.15 us, half the device check's, and false outside training.
            return F.linear(x, self.weight, self.bias)
        weight = self.weight
        # NOTE: `int8` read first: a target's linears (none) pay one attribute read, not a method call
        if self.int8 is not None and x.numel() and self.fresh_int8() and native_gemv.usable(x, weight, self.bias):
            return self.int8.products(x, self.bias)               # NOTE: lossy: a drafter's own weights only
        few_rows = 0 < x.numel() <= NATIVE_MAX_ROWS * self.in_features
        blocks = self.fresh_blocks()
        if (blocks is not None and 0 < x.numel() <= self.block_max_rows * self.in_features
                and native_gemv.usable(x, weight, self.bias)):
            return native_gemv.gemv(x, blocks, self.bias)      # NOTE: bit-identical to the fp32 weight's GEMV
        if self.half_copy_serves(x):
            return native_gemv.gemv_f16(x, self.half_weight, self.bias)
        if (few_rows and weight.stride(-1) == 1
                and weight.dtype == torch.float32 and native_gemv.usable(x, weight)):
            return native_gemv.gemv(x, weight, self.bias)
        if (x.numel() > x.shape[-1] and self.packed is not None and self._weight_key() == self._packed_key
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            if self.backend == "onednn":
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            if native_gemv.usable(x, self.bias):
                return native_gemm.gemm(x, self.packed, self.out_features, self.bias)
        return F.linear(x, self.weight, self.bias)


def project_rows(linear: nn.Linear, x: torch.Tensor, rows: slice) -> torch.Tensor:
    """x (..., in) -> x @ linear.weight[rows].T (..., rows), no bias: part of a fused projection (a drafter's K and V
    without Q). Few rows stream that part of the blocks (use_draft_blocks) or of the fp16 copy (use_half_weights)
    where the native kernel runs, or that part's int8 products (use_int8_weights)."""
    if isinstance(linear, PackedLinear):
        int8 = linear.fresh_int8()
        if int8 is not None and x.numel() and native_gemv.usable(x, linear.weight):
            part = int8.rows(rows)
            if part is not None:
                return part.products(x)
        blocks = linear.fresh_blocks()
        if (blocks is not None and 0 < x.numel() <= linear.block_max_rows * linear.in_features
                and native_gemv.usable(x, linear.weight)):
            part = _block_rows(blocks, rows, linear.out_features)
            if part is not None:
                return native_gemv.gemv(x, part, None)
        if linear.half_copy_serves(x):
            return native_gemv.gemv_f16(x, linear.half_weight[rows], None)
    return F.linear(x, linear.weight[rows])


def _block_rows(blocks: torch.Tensor, rows: slice, out: int) -> torch.Tensor | None:
    """The blocks of output rows `rows` (a step-1 slice): a slice of a 2-D block tensor, or of whole 16-row
    groups of AMX tiles (None where `rows` cuts a group)."""
    start, stop, step = rows.indices(out)
    if step != 1:
        return None
    if not native_tiles.is_tiles(blocks):
        return blocks[start:stop]
    group = native_tiles.TILE_ROWS
    return blocks[start // group:stop // group] if start % group == 0 and stop % group == 0 else None


def pack_linear_weights(model: nn.Module, backend: GemmBackend | None = None) -> int:
    """Turn every plain nn.Linear of `model` into a PackedLinear in place (packed for `backend`, default
    default_backend()), repacking PackedLinears packed for another backend or from a weight changed since;
    returns how many.

    NOTE: the class is swapped rather than the module replaced, so parameter names, tying (a tied head
    keeps sharing the embedding's weight) and isinstance(m, nn.Linear) all stay as they were."""
    backend = backend or default_backend()
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
        if type(module) is PackedLinear:
            if (module.packed is None or module.backend != backend
                    or module._weight_key() != module._packed_key):    # NOTE: a stale copy is made again
                module.pack(backend)
            count += 1
    return count


def use_half_weights(model: nn.Module) -> int:
    """Give every PackedLinear of `model` an fp16 copy of its weight, which its few-row calls then stream
    (half the bytes; fp32 arithmetic) where the native kernel runs; returns how many. Lossy (weights rounded
    to fp16), so only for drafters, whose every token the target verifies; a drafter checkpoint is stored in
    fp16, so its own weights lose nothing. The copy goes stale, and is bypassed, if the weight changes."""
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is PackedLinear and module.weight.is_cpu:
                module.half_weight = module.weight.detach().to(torch.float16).contiguous()
                module._half_key = module._weight_key()
                count += 1
    return count


def use_block_weights(model: nn.Module, tiles: bool = False) -> tuple[int, int]:
    """Give every PackedLinear of `model` whose fp32 weight is exactly GGUF block values (Q4_1, else Q8_0:
    lab/models/weight_blocks.py) those blocks, which its few-row calls then stream where the native kernel runs:
    the same values in 0.75 / 1.125 bytes a weight instead of 4, and bit-identical outputs. Lossless, so for any
    model; a weight that is not made of blocks keeps its fp32 GEMV. With `tiles` (a CPU with AMX:
    native_tiles.available) the blocks go in AMX tile order where the output rows are a multiple of 16: the
    same bytes, within fp32 rounding rather than bit-identical. Returns (linears given blocks, linears)."""
    given = total = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is not PackedLinear:
                continue
            total += 1
            blocks = _exact_blocks(module.weight)
            if blocks is not None:
                _give_blocks(module, blocks, tiles)
                given += 1
    return given, total


def use_draft_blocks(model: nn.Module, fmt: weight_blocks.BlockFormat = "q8_0", tiles: bool = False) -> int:
    """Give every PackedLinear of `model` GGUF blocks of `fmt` for its few-row calls (in AMX tile order with `tiles`,
    where the output rows are a multiple of 16): the weight's own blocks where it is exactly GGUF block values of
    `fmt` or of a smaller one (a head shared with the target: lossless), else the weight rounded to `fmt`
    (weight_blocks.quantize_q8_0 / quantize_q4_1: lossy, so only for drafters, whose every draft the target
    verifies; a target's Q8_0 head becomes a Q4_1 draft head). Q8_0 is 1.06 bytes a weight against fp16's 2, Q4_1
    0.625 (0.75 on the AVX blocks), and on tiles up to GEMV_MAX_ROWS rows (a drafter's block) cost about one.
    Returns how many."""
    largest = weight_blocks.block_bytes(fmt)
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is not PackedLinear:
                continue
            blocks = _exact_blocks(module.weight)
            if blocks is not None and weight_blocks.block_bytes(weight_blocks.block_format(blocks)) > largest:
                blocks = None   # NOTE: exact, but in a larger format than asked for: rounded to `fmt` below
            if blocks is None and _is_cpu_fp32(module.weight):
                blocks = weight_blocks.quantize(module.weight, fmt)
            if blocks is None:
                continue
            module.block_max_rows = GEMV_MAX_ROWS if _give_blocks(module, blocks, tiles) else BLOCK_MAX_ROWS
            module.half_weight = None
            count += 1
    return count


def use_int8_weights(model: nn.Module) -> int:
    """Give every PackedLinear of `model` whose output rows are a multiple of 16 its weight as Q8_0 blocks for 8-bit
    integer products (native_head.Int8Weight: the inputs rounded to int8 per 32 columns, 64 byte products an
    instruction against an fp32 FMA's 16), which its calls then take (any number of rows): the weight rounded to
    Q8_0, which is exactly its own blocks where it is made of them (a head shared with the target's Q8_0 head).
    Lossy on both sides, so only for drafters, whose every draft the target verifies; needs a CPU with AVX-512 VNNI
    (native_head.supported). Returns how many."""
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if (type(module) is not PackedLinear or not _is_cpu_fp32(module.weight)
                    or module.out_features % native_head.GROUP_ROWS or module.in_features % weight_blocks.BLOCK):
                continue
            blocks = weight_blocks.quantize(module.weight, "q8_0")
            module.int8, module._int8_key = native_head.Int8Weight(blocks), module._weight_key()
            module.half_weight = module.blocks = None
            count += 1
    return count


def move_streamed_weights_to_huge_pages(model: nn.Module) -> int:
    """Move what every PackedLinear of `model` streams in its few-row calls (its GGUF blocks, its fp16 copy, its int8
    products' screen and scales) into one mapping on 2 MiB pages (lab/huge_pages.py), in module order, i.e. the order
    a forward reads them. The same values, so outputs are unchanged; a copy made stale by a changed weight stays
    stale. Returns the bytes moved."""
    slots = [(owner, name) for module in model.modules() if type(module) is PackedLinear
             for owner, names in ((module, ("blocks", "half_weight")), (module.int8, ("screen", "scales")))
             if owner is not None for name in names if getattr(owner, name) is not None]
    if not slots:
        return 0
    moved = huge_pages.move([getattr(owner, name) for owner, name in slots])
    for (owner, name), tensor in zip(slots, moved):
        setattr(owner, name, tensor)
    return sum(t.numel() * t.element_size() for t in moved)


def _is_cpu_fp32(weight: torch.Tensor) -> bool:
    return weight.is_cpu and weight.dtype == torch.float32


def _exact_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """The GGUF blocks (Q4_1, else Q8_0) whose values `weight` exactly is, or None (weight_blocks.find_blocks)."""
    if not _is_cpu_fp32(weight):
        return None
    return next((found for fmt in weight_blocks.FORMATS
                 if (found := weight_blocks.find_blocks(weight, fmt)) is not None), None)


def _give_blocks(module: PackedLinear, blocks: torch.Tensor, tiles: bool) -> bool:
    """`module`'s few-row calls stream `blocks`, in AMX tile order with `tiles` where they fit (native_tiles.pack);
    whether they went as tiles."""
    packed = native_tiles.pack(blocks) if tiles else None
    module.blocks, module._blocks_key = (blocks if packed is None else packed), module._weight_key()
    return packed is not None


def unpack_linear_weights(model: nn.Module) -> int:
    """Undo pack_linear_weights (every linear back to MKL's F.linear); returns how many. For A/B runs."""
    count = 0
    for module in model.modules():
        if type(module) is PackedLinear:
            module.__class__ = nn.Linear
            for name in ("packed", "backend", "_packed_key", "half_weight", "_half_key", "blocks", "_blocks_key",
                         "block_max_rows", "int8", "_int8_key"):
                module.__dict__.pop(name, None)
            count += 1
    return count
