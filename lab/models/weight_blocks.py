"""Weights that are exactly GGUF block values, streamed as blocks: the same fp32 numbers in a fifth of the bytes.

The bundled SmolLM2 is a Q4_1 GGUF: every projection of its decoder layers is stored in blocks of 32 weights
w = d * q + m (q a 4-bit integer, d and m fp16) and its embedding (the tied LM head) in Q8_0 blocks w = d * q
(q an 8-bit integer). lab.models.sources dequantizes them once into fp32, so the model we run, and the HF
model we compare against, holds exactly those values. A batch-1 decode streams every weight from DRAM once per
token, so its speed is the speed at which the weights are read (docs/benchmarks.md); reading the blocks instead
of their fp32 expansion reads 0.75 / 1.125 bytes a weight instead of 4, and the native GEMV
(lab/models/native_gemv.py) widens each block in registers to the very fp32 values the expansion holds: with an
fp16 d (and m) and |q| <= 127, d * q is exact in fp32 and one FMA rounds d * q + m once, as the dequantizer
did. The products and sums then run in the fp32 GEMV's order: logits are bit-identical to the fp32 weights'.

A target's weights are never quantized here: `find_blocks` recovers the blocks a weight already is, and returns
None when any block of it is not exactly such values (a random-init or bf16-trained model), which then stays fp32.
`round_to_q4_1` / `round_to_q8_0` do quantize, llama.cpp's way, for tests that need a model made of blocks, and
`quantize_q8_0` / `quantize_q4_1` for drafters (packed_linear.use_draft_blocks), whose every draft the target
verifies.

Layouts (one row of blocks per output row, the input dim a multiple of 32), as the kernel reads them:
- Q4_1: uint8 (out, in / 32 * 24): per block d (fp32), m (fp32), 16 bytes whose byte j holds q[j] in its low
  nibble and q[j + 16] in its high one (GGUF's order);
- Q8_0: int8 (out, in / 32 * 36): per block d (fp32), then q[0..31].

Owns: recovering, packing and unpacking blocks. Ignores: which module streams them (PackedLinear).
"""

from __future__ import annotations

from typing import Literal

import torch

BLOCK = 32
Q4_1_BYTES = 24
Q8_0_BYTES = 36
BlockFormat = Literal["q4_1", "q8_0"]
FORMATS: tuple[BlockFormat, ...] = ("q4_1", "q8_0")
# NOTE: the fp16 d a quantizer stored is (max - min) / 15 (Q4_1) or amax / 127 (Q8_0) rounded once; the
# recovered ratio can land an ulp or two off it, so its fp16 neighbours are tried too.
_ULP_STEPS = (0, 1, -1, 2, -2)


def block_format(blocks: torch.Tensor) -> BlockFormat:
    """The format a packed tensor holds, from its dtype (the kernel's convention)."""
    if blocks.dtype == torch.uint8:
        return "q4_1"
    if blocks.dtype == torch.int8:
        return "q8_0"
    raise ValueError(f"not a block tensor: dtype {blocks.dtype} (uint8 = Q4_1, int8 = Q8_0)")


def block_bytes(fmt: BlockFormat) -> int:
    return Q4_1_BYTES if fmt == "q4_1" else Q8_0_BYTES


def _half_neighbour(d: torch.Tensor, steps: int) -> torch.Tensor:
    """d (fp16 values held in fp32, >= 0) moved `steps` fp16 ulps; 0 stays 0."""
    bits = d.to(torch.float16).view(torch.int16).to(torch.int32) + steps
    moved = bits.clamp(0, 0x7BFF).to(torch.int16).view(torch.float16).to(torch.float32)
    return torch.where(d > 0, moved, d)


def _recover(w: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """w (out, in) -> (d, m, q) with w == d * q + m exactly (m = 0 for Q8_0; d (out, nb, 1) an fp16 value), or
    None. q (out, nb, 32) float, integral."""
    out, inn = w.shape
    blocks = w.reshape(out, inn // BLOCK, BLOCK)
    if fmt == "q4_1":
        m = blocks.amin(-1, keepdim=True)
        first = (blocks.amax(-1, keepdim=True) - m) / 15
        lo, hi = 0.0, 15.0
    else:
        m = torch.zeros_like(blocks[..., :1])
        first = blocks.abs().amax(-1, keepdim=True) / 127
        lo, hi = -127.0, 127.0
    first = first.to(torch.float16).to(torch.float32)
    best_d = torch.zeros_like(first)
    best_q = torch.zeros_like(blocks)
    solved = torch.zeros(first.shape, dtype=torch.bool)
    for steps in _ULP_STEPS:
        d = _half_neighbour(first, steps)
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.where(d > 0, ((blocks - m) / safe).round().clamp(lo, hi), torch.zeros_like(blocks))
        # NOTE: bitwise, so a -0.0 the kernel would widen to +0.0 is not taken for the same value
        exact = ((d * q + m).view(torch.int32) == blocks.view(torch.int32)).all(-1, keepdim=True) & ~solved
        best_d = torch.where(exact, d, best_d)
        best_q = torch.where(exact, q, best_q)
        solved |= exact
        if bool(solved.all()):
            return best_d, m, best_q
        if steps == 0 and float(solved.float().mean()) < 0.5:
            return None                 # NOTE: not this format (or not blocks at all): the neighbours won't fix it
    return None


def find_blocks(weight: torch.Tensor, fmt: BlockFormat) -> torch.Tensor | None:
    """The packed blocks (module docstring) whose values are exactly `weight` (out, in) fp32, or None where the
    input dim is not a multiple of 32 or any block is not exactly d * q + m with fp16 d, m (Q4_1) / d * q (Q8_0)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    w = weight.detach().to("cpu")
    found = _recover(w, fmt)
    if found is None:
        return None
    d, m, q = found
    if fmt == "q4_1" and not bool((m.to(torch.float16).to(torch.float32) == m).all()):
        return None                     # NOTE: an fp32 min is not a GGUF block, even if the values fit
    return pack(d, m, q, fmt)


def pack(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """d, m (out, nb, 1) fp32, q (out, nb, 32) integral -> the packed layout (module docstring)."""
    out, nb, _ = q.shape
    scale_bytes = d.contiguous().view(torch.uint8).reshape(out, nb, 4)
    if fmt == "q4_1":
        qi = q.to(torch.uint8)
        nibbles = qi[..., :16] | (qi[..., 16:] << 4)                               # (out, nb, 16)
        min_bytes = m.contiguous().view(torch.uint8).reshape(out, nb, 4)
        return torch.cat([scale_bytes, min_bytes, nibbles], -1).reshape(out, nb * Q4_1_BYTES).contiguous()
    qi = q.to(torch.int8).view(torch.uint8)
    return torch.cat([scale_bytes, qi], -1).reshape(out, nb * Q8_0_BYTES).view(torch.int8).contiguous()


def unpack(blocks: torch.Tensor) -> torch.Tensor:
    """The packed blocks -> the fp32 weight (out, in) they hold (d * q + m, rounded once, as the kernel)."""
    fmt = block_format(blocks)
    out = blocks.shape[0]
    raw = blocks.view(torch.uint8).reshape(out, -1, block_bytes(fmt))
    d = raw[..., :4].contiguous().view(torch.float32)                                    # (out, nb, 1)
    if fmt == "q4_1":
        m = raw[..., 4:8].contiguous().view(torch.float32)
        nibbles = raw[..., 8:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], -1).to(torch.float32)
        return (d * q + m).reshape(out, -1)
    q = raw[..., 4:].contiguous().view(torch.int8).to(torch.float32)
    return (d * q).reshape(out, -1)


def _q4_1_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` (out, in) -> Q4_1's d, m (out, nb, 1; fp16 values in fp32) and q (out, nb, 32; integral in fp32),
    llama.cpp's rounding: d = (max - min) / 15 and m = min stored fp16, q = round((w - min) / d) in 0..15."""
    out, inn = weight.shape
    blocks = weight.detach().to(torch.float32).reshape(out, inn // BLOCK, BLOCK)
    low = blocks.amin(-1, keepdim=True)
    d = ((blocks.amax(-1, keepdim=True) - low) / 15).to(torch.float16).to(torch.float32)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((blocks - low) * inv).round().clamp(0, 15)
    return d, low.to(torch.float16).to(torch.float32), q


def round_to_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in) quantized to Q4_1 the way llama.cpp does (d = (max - min) / 15, d and min stored fp16)
    and dequantized back to fp32: a weight made of blocks. Lossy: for building test models."""
    d, m, q = _q4_1_parts(weight)
    return (d * q + m).reshape(weight.shape)


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (out, in) rounded to Q4_1 as `round_to_q4_1` does, as packed blocks, or None where the input dim is
    not a multiple of 32. Lossy (half a step of 1/15 of a block's range): for a drafter's head, whose every draft
    the target verifies (packed_linear.use_draft_blocks)."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    return pack(*_q4_1_parts(weight.detach().to("cpu")), "q4_1")


def _q8_0_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (out, in) -> Q8_0's d (out, nb, 1; an fp16 value in fp32) and q (out, nb, 32; integral in fp32),
    llama.cpp's rounding: d = amax / 127 stored fp16, q = round(w / d)."""
    out, inn = weight.shape
    blocks = weight.detach().to(torch.float32).reshape(out, inn // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).to(torch.float16).to(torch.float32)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = (blocks * inv).round().clamp(-127, 127) + 0.0           # NOTE: + 0.0: an integer q has no -0.0
    return d, q


def round_to_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in) quantized to Q8_0 as llama.cpp does (d = amax / 127 stored fp16) and dequantized."""
    d, q = _q8_0_parts(weight)
    return (d * q).reshape(weight.shape)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (out, in) rounded to Q8_0 as `round_to_q8_0` does, as packed blocks (the module docstring's
    layout), or None where the input dim is not a multiple of 32. Lossy (~0.2 % of a block's largest weight):
    for drafters, whose drafts the target verifies."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    d, q = _q8_0_parts(weight.detach().to("cpu"))
    return pack(d, torch.zeros_like(d), q, "q8_0")


def quantize(weight: torch.Tensor, fmt: BlockFormat) -> torch.Tensor | None:
    """`weight` (out, in) rounded to `fmt` as packed blocks (quantize_q4_1 / quantize_q8_0), or None off the 32-grid."""
    return quantize_q4_1(weight) if fmt == "q4_1" else quantize_q8_0(weight)
