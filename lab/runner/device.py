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


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cuda_memory_mb(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    return {"peak_mem_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_mem_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}
