"""What `train.matmul_precision` means on the device the target is on, and the block that applies it.

torch.set_float32_matmul_precision's three settings: `highest` keeps fp32 matrix products; `high` lets CUDA use TF32
tensor cores (a 10-bit mantissa; a CPU has no TF32, so there it is fp32); `medium` lets CUDA, and a CPU whose
oneDNN has bf16 kernels (AMX or AVX512-BF16), compute them from bf16 inputs with fp32 sums. Only the target's
features and the drafter's training run under it: the target's answers are generated before, in full fp32.

Owns: resolving the requested setting to the one that takes effect (`effective_precision`) and the block that sets
it (`float32_matmul_precision`).
Ignores: which products run where (lab/models/packed_linear.py yields to torch's under a reduced precision).

NOTE: measured on this project's CPU (2 threads, AMX): a (2048 x 576) @ (576 x 1536) product 274 GFLOP/s in fp32,
1450 at `medium`; SmolLM2's features 2.0x faster, a DFlash training step with cached features 1.3x (batch 16: 1.34 s
-> 1.03 s); docs/speculative.md, session 46.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch

MATMUL_PRECISIONS = ("highest", "high", "medium")   # torch.set_float32_matmul_precision's


def cpu_has_bf16_matmul() -> bool:
    """Whether torch's oneDNN runs bf16 products natively on this CPU (AMX-BF16 or AVX512-BF16)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def medium_rounds_products() -> bool:
    """Whether a CPU product under `medium` really takes bf16 inputs here: a probe at a drafter training's shape.
    oneDNN may report bf16 kernels (`cpu_has_bf16_matmul`) and torch still keep fp32 products: measured with torch
    2.13 on an AMD EPYC with AVX512-BF16 and no AMX (session 54), where `medium` only moves products from the packed
    kernels to torch's GEMM."""
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 576, generator=generator), torch.randn(576, 576, generator=generator)
    with float32_matmul_precision("highest"):
        exact = torch.nn.functional.linear(x, w)
    with float32_matmul_precision("medium"):
        reduced = torch.nn.functional.linear(x, w)
    return bool((reduced - exact).norm() / exact.norm() > 1e-4)   # bf16 inputs: 2.3e-3; fp32 sums reordered: ~4e-7


def effective_precision(requested: str, device: torch.device | str) -> tuple[str, str | None]:
    """(the setting that takes effect for a target on `device`, a line saying why it differs, or None)."""
    if requested not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul precision {requested!r}: expected one of {', '.join(MATMUL_PRECISIONS)}")
    if torch.device(device).type != "cpu" or requested == "highest":
        return requested, None
    if requested == "high":
        return "highest", ("train.matmul_precision=high is TF32, which a CPU has not: fp32 products "
                           "(train.matmul_precision=medium is bf16 on a CPU with AMX or AVX512-BF16)")
    if not cpu_has_bf16_matmul():
        return "highest", ("train.matmul_precision=medium: this CPU has no bf16 matrix unit (AMX or AVX512-BF16) "
                           "that torch's oneDNN uses, so products stay fp32")
    return requested, None


@contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    """torch.set_float32_matmul_precision for the block, the previous setting back afterwards."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
