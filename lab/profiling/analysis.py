"""Reading a finished torch.profiler run: top ops, CPU vs device time, kernels, memory by op, host-device
synchronisations with their call sites, device idle gaps, and the time inside each labelled range.

Owns: numbers and tables derived from profiler events. Ignores: how the run was driven.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "cudaEventSynchronize", "aten::nonzero", "aten::tolist")
RANGE_NAMES = ("schedule", "prepare_inputs", "prefill", "decode", "mixed", "attention", "sample", "draft", "verify")


def _call_site(event: Any) -> str:
    """The innermost Python frame outside torch that led to `event` (needs with_stack=True)."""
    parent = event.cpu_parent
    while parent is not None:
        name = parent.name
        if ".py(" in name and "/torch/" not in name and "site-packages" not in name:
            return name
        parent = parent.cpu_parent
    return "<unknown: enable with_stack>"


def sync_counts(events: list[Any]) -> dict[str, Any]:
    syncs = [e for e in events if e.name in SYNC_OPS]
    sites = Counter(f"{e.name} <- {_call_site(e)}" for e in syncs)
    return {"total": len(syncs), "by_op": dict(Counter(e.name for e in syncs)),
            "call_sites": dict(sites.most_common(15))}


def range_breakdown(events: list[Any]) -> dict[str, dict[str, float]]:
    """Wall time (ms) and call count of every labelled range."""
    out: dict[str, dict[str, float]] = {}
    for event in events:
        if event.name in RANGE_NAMES:
            entry = out.setdefault(event.name, {"total_ms": 0.0, "count": 0})
            entry["total_ms"] += event.cpu_time_total / 1000
            entry["count"] += 1
    return out


def device_idle(events: list[Any]) -> dict[str, float] | None:
    """Share of the profiled window with no device kernel running (None without device events)."""
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type.name == "CUDA" and e.device_time_total > 0 and not e.is_user_annotation)
    if not kernels:
        return None
    busy, current_start, current_end = 0.0, kernels[0][0], kernels[0][1]
    for start, end in kernels[1:]:
        if start > current_end:
            busy += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    busy += current_end - current_start
    window = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    return {"window_ms": window / 1000, "busy_ms": busy / 1000, "idle_ms": (window - busy) / 1000,
            "idle_share": (window - busy) / window if window else 0.0}


def totals(averages: Any) -> dict[str, float]:
    self_cpu = sum(a.self_cpu_time_total for a in averages)
    self_device = sum(getattr(a, "self_device_time_total", 0) for a in averages)
    return {"self_cpu_total_ms": self_cpu / 1000, "self_device_total_ms": self_device / 1000}


def top_ops(averages: Any, key: str, limit: int) -> list[dict[str, Any]]:
    rows = sorted(averages, key=lambda a: getattr(a, key, 0), reverse=True)[:limit]
    return [{"op": a.key, "calls": a.count, "self_cpu_ms": a.self_cpu_time_total / 1000,
             "cpu_total_ms": a.cpu_time_total / 1000, "self_device_ms": getattr(a, "self_device_time_total", 0) / 1000,
             "self_cpu_mem_mb": a.self_cpu_memory_usage / 2**20,
             "self_device_mem_mb": getattr(a, "self_device_memory_usage", 0) / 2**20} for a in rows]


def summarize_profile(prof: Any, limit: int = 15) -> dict[str, Any]:
    events = list(prof.events())
    averages = prof.key_averages()
    return {"totals": totals(averages), "top_self_cpu": top_ops(averages, "self_cpu_time_total", limit),
            "top_self_device": top_ops(averages, "self_device_time_total", limit),
            "top_cpu_memory": top_ops(averages, "self_cpu_memory_usage", limit),
            "syncs": sync_counts(events), "ranges": range_breakdown(events), "device_idle": device_idle(events)}


def format_summary(summary: dict[str, Any], limit: int = 8) -> str:
    lines = ["=== profile summary ===", f"self CPU total {summary['totals']['self_cpu_total_ms']:.1f} ms, "
             f"self device total {summary['totals']['self_device_total_ms']:.1f} ms"]
    lines.append("ranges: " + ", ".join(f"{k} {v['total_ms']:.1f} ms x{int(v['count'])}"
                                        for k, v in summary["ranges"].items()))
    lines.append("top ops by self CPU time:")
    lines += [f"  {r['op'][:48]:<48} {r['self_cpu_ms']:9.2f} ms  x{r['calls']}"
              for r in summary["top_self_cpu"][:limit]]
    syncs = summary["syncs"]
    lines.append(f"host syncs: {syncs['total']} {syncs['by_op']}")
    lines += [f"  {site} x{n}" for site, n in list(syncs["call_sites"].items())[:3]]
    if summary["device_idle"]:
        idle = summary["device_idle"]
        lines.append(f"device idle {idle['idle_ms']:.1f} ms of {idle['window_ms']:.1f} ms ({idle['idle_share']:.0%})")
    return "\n".join(lines)
