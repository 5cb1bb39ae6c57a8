"""Naive-concurrency sweep (conf/experiment/naive_concurrency.yaml): latency percentiles, aggregate
throughput and peak memory vs N for `concurrent` (threads and/or processes) and `static` at the same N,
on one plot each; a markdown table; and the largest N that fits a memory budget for a context length.

    python experiments/naive_concurrency.py <sweep dir> [<sweep dir> ...] [--out docs/figures]
                                            [--budget-mb 1024 --context-len 2048]

Largest N: from the engine's own admission estimate (weights + KV bytes/token x context per request,
lab.engines.concurrent.max_requests_within_budget) and from a line fitted to the measured RSS growth vs N
(see `largest_n`: a fixed overhead per request plus its KV rescaled to `--context-len`). Owns: reading the sweeps' results.json files and drawing. Ignores: measuring.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # NOTE: experiments/ is a folder of scripts
from plots import Job, load_sweep, save_figure  # noqa: E402
from static_batching import log2_axis, markdown_table, plt  # noqa: E402

from lab.engines.concurrent import max_requests_within_budget  # noqa: E402

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL"))
STYLES = {"static": ("tab:blue", "o"), "concurrent (thread)": ("tab:orange", "s"),
          "concurrent (process)": ("tab:green", "^")}


def job_row(job: Job) -> dict[str, Any]:
    r, config = job.results, job.results["config"]
    engine = config["engine"]
    series = "static" if engine["name"] == "static" else f"{engine['name']} ({engine.get('mode', 'thread')})"
    n = config.get("concurrency") or engine.get("batch_size") or engine.get("num_workers")
    row = {"series": series, "n": int(n), "completed": r["completed"], "failed": r["failed"],
           "output_tok_s": r["output_throughput"], "rejected": r.get("concurrent/num_rejected", 0),
           "peak_rss_mb": r.get("memory/peak_rss_mb", r.get("peak_memory_mb", float("nan"))),
           "start_rss_mb": r.get("memory/start_rss_mb", float("nan")),
           "kv_mb": r.get("kv/peak_reserved_bytes", float("nan")) / 2**20,
           "estimated_mb": r.get("memory/peak_estimated_mb", float("nan")),
           "weights_mb": r.get("memory/weights_mb", r.get("weight_bytes", 0) / 2**20),
           "kv_mb_per_token": r.get("kv/bytes_per_token", 0) / 2**20,
           "context_len": (r["total_input_tokens"] + r["total_output_tokens"]) / max(r["completed"], 1)}
    row["growth_mb"] = row["peak_rss_mb"] - row["start_rss_mb"]
    for name, _ in LATENCIES:
        row[f"p50_{name}_ms"], row[f"p99_{name}_ms"] = r[f"p50_{name}_ms"], r[f"p99_{name}_ms"]
    return row


def by_series(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: (r["series"], r["n"])):
        out.setdefault(row["series"], []).append(row)
    return out


def _plot_series(ax: Any, groups: dict[str, list[dict[str, Any]]], key: str, label: str = "",
                 linestyle: str = "-") -> None:
    for series, rows in groups.items():
        color, marker = STYLES.get(series, ("tab:gray", "x"))
        ax.plot([r["n"] for r in rows], [r[key] for r in rows], marker=marker, color=color,
                linestyle=linestyle, label=f"{series}{label}")


def plot_latency(groups: dict[str, list[dict[str, Any]]], ns: list[int], out: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (name, title) in zip(axes, LATENCIES):
        _plot_series(ax, groups, f"p50_{name}_ms", " p50")
        _plot_series(ax, groups, f"p99_{name}_ms", " p99", linestyle="--")
        ax.set_yscale("log")
        ax.set_ylabel(f"{title} (ms)")
        log2_axis(ax, ns, "N concurrent requests")
    axes[0].legend(fontsize=7)
    fig.suptitle("Latency vs N: naive concurrency vs static batching")
    return save_figure(fig, out / "concurrency_latency.png")


def plot_throughput(groups: dict[str, list[dict[str, Any]]], ns: list[int], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _plot_series(ax, groups, "output_tok_s")
    ax.set_ylabel("aggregate output tokens/s")
    log2_axis(ax, ns, "N concurrent requests")
    ax.legend(fontsize=8)
    ax.set_title("Aggregate throughput vs N")
    return save_figure(fig, out / "concurrency_throughput.png")


def plot_memory(groups: dict[str, list[dict[str, Any]]], ns: list[int], out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    _plot_series(axes[0], groups, "peak_rss_mb", " peak RSS")
    axes[0].set_title("Peak RSS of the run (parent + forked workers' growth)")
    _plot_series(axes[1], groups, "growth_mb", " peak RSS - RSS at run start")
    _plot_series(axes[1], groups, "kv_mb", " KV reserved (admission estimate)", linestyle=":")
    axes[1].set_title("What the run added")
    for ax in axes:
        ax.set_ylabel("MB")
        log2_axis(ax, ns, "N concurrent requests")
        ax.legend(fontsize=7)
    fig.suptitle("Memory vs N (weights are in both engines' base; the workers share them)")
    return save_figure(fig, out / "concurrency_memory.png")


def largest_n(rows: list[dict[str, Any]], budget_mb: float, context_len: int) -> dict[str, dict[str, Any]]:
    """Per series: largest N within `budget_mb` for `context_len`-token requests, estimated and measured.

    Measured: RSS = base + N * (overhead + KV(context)). base is the smallest RSS at a run's start (a
    process with the model loaded) plus the intercept of the growth fitted over the sweep's N; the
    overhead (activations, stacks, a process's private pages) is the slope less the sweep's own KV.
    """
    out = {}
    fresh_mb = min(r["start_rss_mb"] for r in rows)
    for series, group in by_series(rows).items():
        first = group[0]
        kv_mb_per_token = first["kv_mb_per_token"]
        fit: dict[str, Any] = {"estimate": max_requests_within_budget(budget_mb, first["weights_mb"],
                                                                      kv_mb_per_token, context_len)}
        ok = [r for r in group if r["growth_mb"] == r["growth_mb"] and not r["rejected"]]
        if len(ok) >= 2:
            slope, intercept = np.polyfit([r["n"] for r in ok], [r["growth_mb"] for r in ok], 1)
            overhead = max(0.0, slope - kv_mb_per_token * first["context_len"])
            per_request, base = overhead + kv_mb_per_token * context_len, fresh_mb + max(intercept, 0.0)
            fit.update(measured=max(0, int((budget_mb - base) // per_request)), base_mb=base,
                       per_request_mb=per_request, overhead_mb=overhead)
        out[series] = fit
    return out


COLUMNS = {"series": "engine", "n": "N", "completed": "done", "failed": "failed", "output_tok_s": "tok/s",
           "p50_ttft_ms": "TTFT p50", "p99_ttft_ms": "TTFT p99", "p50_tpot_ms": "TPOT p50",
           "p99_tpot_ms": "TPOT p99", "p99_e2el_ms": "E2EL p99", "peak_rss_mb": "peak RSS MB",
           "growth_mb": "RSS growth MB", "estimated_mb": "weights+KV MB", "rejected": "rejected"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dirs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default <first sweep>/plots)")
    parser.add_argument("--budget-mb", type=float, default=1024.0)
    parser.add_argument("--context-len", type=int, default=2048, help="prompt + output tokens per request")
    args = parser.parse_args(argv)
    rows = []
    for sweep_dir in args.sweep_dirs:
        jobs, skipped = load_sweep(sweep_dir)
        for path in skipped:
            print(f"skipped (error.json or no results.json): {path}")
        rows += [job_row(job) for job in jobs]
    if not rows:
        print("no finished jobs", file=sys.stderr)
        return 1
    out = args.out or args.sweep_dirs[0] / "plots"
    out.mkdir(parents=True, exist_ok=True)
    groups, ns = by_series(rows), sorted({r["n"] for r in rows})
    paths = [plot_latency(groups, ns, out), plot_throughput(groups, ns, out), plot_memory(groups, ns, out)]
    print(markdown_table([r for g in groups.values() for r in g], COLUMNS))
    print(f"\nlargest N within {args.budget_mb:g} MB at {args.context_len} tokens per request:")
    for series, fit in largest_n(rows, args.budget_mb, args.context_len).items():
        measured = (f"; measured RSS fit: {fit['measured']} ({fit['base_mb']:.0f} MB + {fit['per_request_mb']:.1f} MB"
                    f" per request, {fit['overhead_mb']:.1f} MB of it beyond KV)" if "measured" in fit else "")
        print(f"  {series}: admission estimate {fit['estimate']}{measured}")
    rejected = [r for r in rows if r["rejected"]]
    for r in rejected:
        print(f"  {r['series']} N={r['n']}: {r['rejected']} rejected (memory budget)")
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
