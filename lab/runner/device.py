"""Device and dtype resolution, and memory readings (CPU RSS; CUDA allocator peaks).

Owns: `auto` defaults (CUDA when present, bf16 there, fp32 on CPU). Ignores: models.
"""

from __future__ import annotations

import resource

import torch

from lab.errors import LabError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LabError(f"model.device={name} but CUDA is not available here", "use model.device=auto or cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise LabError(f"unknown model.dtype {name!r}", f"use one of: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def avoid_per_shape_attention_plans(device: torch.device) -> None:
    """On CUDA, take cuDNN's fused attention out of scaled_dot_product_attention's choices, process-wide.

    NOTE: cuDNN builds an execution plan on the host for every new attention shape: 2.8 ms a call on the H200
    (session 33's profile of an eager k = 7 verify step: 31 calls, 86 ms of a 101 ms step, against 18.9 ms for a
    plain step). Eager steps change shape every step (context length, verify width), so they paid it in every
    layer. The other backends need no plan. Graph capture turns cuDNN back on (lab/runner/cuda_graphs.py: capture):
    a graph builds its plans once and its replays keep cuDNN's kernels."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cuda_memory_mb(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    return {"peak_mem_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_mem_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}
