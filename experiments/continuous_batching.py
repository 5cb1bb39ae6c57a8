"""Continuous-batching sweep (conf/experiment/continuous_batching.yaml): static vs cb_rebuild vs cb_slots vs
cb_paged vs hf_cb per workload: output throughput, TTFT/TPOT percentiles, rebuild count and time, KV
reserved vs used per token, and the concurrent requests a fixed KV budget holds. PNGs and a markdown table.

    python experiments/continuous_batching.py outputs/multirun/<day>/continuous_batching_<time> [--out docs/figures]

Definitions (each from one job's results.json):
- `cpu_tok_s`: output tokens / (mean process CPU % x duration): throughput per CPU-second, which compares jobs
  run at different machine loads better than the wall-clock `output_throughput` (both are reported).
- `reserved_per_used`: KV bytes reserved / bytes holding live tokens: the time average over steps where the
  engine keeps it (`kv/reserved_per_used_token`, the continuous engines), else at the peak.
- `kv_per_request_mb`: KV reserved per running request at the peak (peak reserved / rows then running), and
  `max_requests_in_budget`: how many such requests the budget (--budget-mb) holds.
Owns: reading the sweep and drawing. Ignores: measuring.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen first

sys.path.insert(0, str(Path(__file__).resolve().parent))  # NOTE: experiments/ is a folder of scripts
from plots import Job, load_sweep, save_figure  # noqa: E402
from static_batching import markdown_table  # noqa: E402

ENGINES = ("static", "cb_rebuild", "cb_slots", "cb_paged", "hf_cb")
COLORS = dict(zip(ENGINES, ("#7f7f7f", "#ff7f0e", "#2ca02c", "#1f77b4", "#d62728")))
COLUMNS = {"workload": "workload", "engine": "engine", "completed": "done", "output_tok_s": "out tok/s (wall)",
           "cpu_tok_s": "out tok/s per CPU-s", "p50_ttft_ms": "TTFT p50 ms", "p99_ttft_ms": "TTFT p99 ms",
           "p50_tpot_ms": "TPOT p50 ms", "p99_tpot_ms": "TPOT p99 ms", "rebuild_count": "rebuilds",
           "rebuild_share": "rebuild share", "reserved_per_used": "KV reserved/used",
           "kv_per_request_mb": "KV MB/request", "max_requests_in_budget": "max req in budget"}


def running_rows(results: dict[str, Any]) -> int:
    """Requests running together at the peak: the scheduler's count, else the engine's batch limit."""
    engine = results.get("config", {}).get("engine", {})
    limit = engine.get("batch_size") or engine.get("max_num_seqs") or results.get("sched/max_running") or 1
    return int(results.get("sched/max_running") or min(int(limit), int(results.get("num_prompts") or limit)))


def job_row(results: dict[str, Any], budget_mb: float) -> dict[str, Any]:
    r = results
    reserved, used = r.get("kv/peak_reserved_bytes", 0), r.get("kv/peak_used_bytes", 0)
    ratio = r.get("kv/reserved_per_used_token") or (reserved / used if used else float("nan"))
    per_request = reserved / running_rows(r) / 2**20 if reserved else float("nan")
    cpu_s = r.get("util/cpu_percent_mean", 0.0) / 100 * r.get("duration", 0.0)
    return {"workload": r.get("workload", "?"), "engine": r.get("engine", "?"), "completed": r.get("completed", 0),
            "output_tok_s": r.get("output_throughput", float("nan")),
            "cpu_tok_s": r["total_output_tokens"] / cpu_s if cpu_s else float("nan"),
            **{k: r.get(k, float("nan")) for k in ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")},
            "rebuild_count": r.get("rebuild/count", 0), "rebuild_s": r.get("rebuild/total_s", 0.0),
            "rebuild_share": r.get("rebuild/share", 0.0), "reserved_per_used": ratio,
            "kv_per_request_mb": per_request,
            "max_requests_in_budget": int(budget_mb // per_request) if per_request == per_request else float("nan"),
            "preemptions": r.get("sched/num_preemptions", 0)}


def collect(jobs: list[Job], budget_mb: float) -> list[dict[str, Any]]:
    rows = [job_row(job.results, budget_mb) for job in jobs]
    order = {name: i for i, name in enumerate(ENGINES)}
    return sorted(rows, key=lambda row: (row["workload"], order.get(row["engine"], len(order))))


def ratios(rows: list[dict[str, Any]], key: str = "cpu_tok_s") -> dict[str, dict[str, float]]:
    """Per workload, cb_paged's `key` over each other engine's."""
    out: dict[str, dict[str, float]] = {}
    for workload in sorted({row["workload"] for row in rows}):
        values = {row["engine"]: row[key] for row in rows if row["workload"] == workload}
        if "cb_paged" in values:
            out[workload] = {e: values["cb_paged"] / v for e, v in values.items() if e != "cb_paged" and v and v == v}
    return out


def _bars(ax: Any, rows: list[dict[str, Any]], key: str, label: str) -> None:
    """Grouped bars: one group per workload, one bar per engine."""
    workloads = sorted({row["workload"] for row in rows})
    engines = [e for e in ENGINES if any(row["engine"] == e for row in rows)]
    width = 0.8 / max(1, len(engines))
    for i, engine in enumerate(engines):
        values = [next((row[key] for row in rows if row["workload"] == w and row["engine"] == engine), 0.0)
                  for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=engine, color=COLORS[engine])
    ax.set_xticks([x + width * (len(engines) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel(label)
    ax.grid(True, axis="y", alpha=0.3)


def plot_throughput(rows: list[dict[str, Any]], out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _bars(axes[0], rows, "output_tok_s", "output tok/s (wall clock)")
    _bars(axes[1], rows, "cpu_tok_s", "output tok/s per CPU-second")
    axes[0].legend(fontsize=8)
    fig.suptitle("Output throughput at the same max batch")
    return save_figure(fig, out / "cb_throughput.png")


def plot_latency(rows: list[dict[str, Any]], out: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, label) in zip(axes.flat, (("p50_ttft_ms", "TTFT p50 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
                                           ("p50_tpot_ms", "TPOT p50 (ms)"), ("p99_tpot_ms", "TPOT p99 (ms)"))):
        _bars(ax, rows, key, label)
        ax.set_yscale("log")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Latency percentiles")
    return save_figure(fig, out / "cb_latency.png")


def plot_kv(rows: list[dict[str, Any]], budget_mb: float, out: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    _bars(axes[0], rows, "reserved_per_used", "KV reserved / used (per token)")
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[0].set_yscale("log")
    _bars(axes[1], rows, "kv_per_request_mb", "KV reserved per running request (MB)")
    _bars(axes[2], rows, "max_requests_in_budget", f"requests a {budget_mb:.0f} MB KV budget holds")
    axes[0].legend(fontsize=8)
    fig.suptitle("KV memory: reservation vs use (the fragmentation paging removes)")
    return save_figure(fig, out / "cb_kv_memory.png")


def plot_rebuild(rows: list[dict[str, Any]], out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    _bars(axes[0], rows, "rebuild_count", "rebuilds (count)")
    _bars(axes[1], rows, "rebuild_share", "share of run time rebuilding")
    axes[0].legend(fontsize=8)
    fig.suptitle("Cache rebuilds: cb_rebuild re-lays out its padded cache on every join/leave; 2D/2E never do")
    return save_figure(fig, out / "cb_rebuild.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="PNG folder (default: <sweep_dir>/plots)")
    parser.add_argument("--budget-mb", type=float, default=1024.0, help="KV budget for max_requests_in_budget")
    args = parser.parse_args(argv)
    jobs, skipped = load_sweep(args.sweep_dir)
    if not jobs:
        print(f"no finished jobs in {args.sweep_dir}", file=sys.stderr)
        return 1
    out = args.out or args.sweep_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    rows = collect(jobs, args.budget_mb)
    paths = [plot_throughput(rows, out), plot_latency(rows, out), plot_kv(rows, args.budget_mb, out),
             plot_rebuild(rows, out)]
    print(markdown_table(rows, COLUMNS))
    for workload, values in ratios(rows).items():
        print(f"cb_paged vs others on {workload} (per CPU-s): " + ", ".join(f"{e} {v:.2f}x" for e, v in values.items()))
    for path in skipped:
        print(f"skipped (failed or unfinished): {path}")
    for path in paths:
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
