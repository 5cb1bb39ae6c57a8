"""Static-batching sweep (conf/experiment/static_batching.yaml): aggregate vs per-user tokens/s and
TTFT/TPOT vs batch size, the waste of padding and finished rows, a markdown table and the knee.

    python experiments/static_batching.py outputs/multirun/<day>/static_batching_<time> [--out docs/figures]

The knee comes from fitting the decode step to step_ms = fixed + per_row * B: `fixed` is what a step
costs whatever the batch (streaming every weight once, per-step overheads), `per_row` the matmul FLOPs
of one more row. Below knee = fixed / per_row a step is dominated by the weight traffic (memory-bound:
rows ride almost free, aggregate tok/s grows ~B); above it by compute (compute-bound: the step grows
~B, aggregate tok/s flattens at the compute roof). Cross-check, the ridge: prefill tok/s (the compute
roof) / batch-1 decode tok/s (the memory roof). Owns: reading the sweep's results.json files and drawing. Ignores: measuring.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen first

sys.path.insert(0, str(Path(__file__).resolve().parent))  # NOTE: experiments/ is a folder of scripts
from plots import Job, load_sweep, save_figure  # noqa: E402


def markdown_table(rows: list[dict[str, Any]], columns: dict[str, str]) -> str:
    """rows of {key: value} -> a markdown table with `columns` {key: header}; floats get 3 significant digits."""
    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(key, "")) for key in columns) + " |" for row in rows]
    return "\n".join(lines)


def log2_axis(ax: Any, values: list[int], label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.set_xlabel(label)
    ax.grid(True, alpha=0.3)


def job_row(job: Job) -> dict[str, Any]:
    r = job.results
    batch = int(r["config"]["engine"]["batch_size"])
    decode_steps = max(r.get("phase/decode_steps", 0), 1)
    step_ms = 1000 * r.get("phase/decode_s", 0.0) / decode_steps
    return {"batch_size": batch, "completed": r["completed"], "failed": r["failed"],
            "output_tok_s": r["output_throughput"],
            "decode_tok_s": batch * 1000 / step_ms if step_ms else float("nan"),
            "user_tok_s": 1000 / r["mean_tpot_ms"] if r["mean_tpot_ms"] else float("nan"),
            "ttft_ms": r["mean_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
            "tpot_ms": r["mean_tpot_ms"], "p99_tpot_ms": r["p99_tpot_ms"], "step_ms": step_ms,
            "prefill_tok_s": r.get("phase/prefill_tokens", 0) / max(r.get("phase/prefill_s", 0.0), 1e-9),
            "padding_share": r.get("batch/padding_tokens", 0) / max(r.get("batch/computed_token_slots", 0), 1),
            "finished_share": r.get("batch/wasted_token_slots", 0) / max(r.get("batch/computed_token_slots", 0), 1),
            "waste_fraction": r.get("batch/waste_fraction", float("nan")),
            "peak_rss_mb": r.get("memory/peak_rss_mb", r.get("peak_memory_mb", float("nan"))),
            "growth_mb": r.get("memory/peak_rss_mb", float("nan")) - r.get("memory/start_rss_mb", float("nan"))}


def fit_step(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Least-squares (fixed_ms, per_row_ms) of step_ms = fixed + per_row * batch_size."""
    per_row, fixed = np.polyfit([r["batch_size"] for r in rows], [r["step_ms"] for r in rows], 1)
    return float(fixed), float(per_row)


def find_knee(rows: list[dict[str, Any]]) -> float | None:
    """fixed / per_row: the batch size at which a step's compute equals its fixed (weight-streaming) cost."""
    fixed, per_row = fit_step(rows)
    return fixed / per_row if fixed > 0 and per_row > 0 else None


def ridge(rows: list[dict[str, Any]]) -> float:
    """Compute roof (median prefill tok/s) over the memory roof (smallest batch's decode tok/s)."""
    return float(np.median([r["prefill_tok_s"] for r in rows])) / rows[0]["decode_tok_s"]


def plot_throughput(rows: list[dict[str, Any]], knee: float | None, out: Path) -> Path:
    batches = [r["batch_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(batches, [r["output_tok_s"] for r in rows], "o-", label="aggregate output tok/s (end to end)")
    ax.plot(batches, [r["decode_tok_s"] for r in rows], "s--", label="aggregate decode tok/s (B / step time)")
    ax.set_ylabel("aggregate tokens/s")
    user = ax.twinx()
    user.plot(batches, [r["user_tok_s"] for r in rows], "^-", color="tab:red", label="per-user tok/s (1 / TPOT)")
    user.set_ylabel("per-user tokens/s", color="tab:red")
    if knee is not None:
        ax.axvline(knee, color="gray", linestyle=":", label=f"knee (B~{knee:.0f}, from the step fit)")
    log2_axis(ax, batches, "batch size")
    lines = ax.get_legend_handles_labels()[0] + user.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="upper left")
    ax.set_title("Static batching: aggregate vs per-user throughput")
    return save_figure(fig, out / "static_throughput.png")


def plot_latency(rows: list[dict[str, Any]], out: Path) -> Path:
    batches = [r["batch_size"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (name, title) in zip(axes, (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"))):
        ax.plot(batches, [r[name] for r in rows], "o-", label="mean")
        ax.plot(batches, [r[f"p99_{name}"] for r in rows], "x--", label="p99")
        ax.set_yscale("log")
        ax.set_ylabel(title)
        log2_axis(ax, batches, "batch size")
        ax.legend(fontsize=8)
    fixed, per_row = fit_step(rows)
    axes[1].plot(batches, [fixed + per_row * b for b in batches], ":", color="gray",
                 label=f"step fit {fixed:.0f} + {per_row:.1f} x B ms")
    axes[1].legend(fontsize=8)
    fig.suptitle("Static batching: latency vs batch size")
    return save_figure(fig, out / "static_latency.png")


def plot_waste(rows: list[dict[str, Any]], out: Path) -> Path:
    labels = [str(r["batch_size"]) for r in rows]
    padding = [r["padding_share"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, padding, color="tab:gray", label="prefill padding")
    ax.bar(labels, [r["finished_share"] for r in rows], bottom=padding, color="tab:red",
           label="decode slots of finished rows")
    ax.set_xlabel("batch size")
    ax.set_ylabel("share of computed token slots")
    ax.legend(fontsize=8)
    ax.set_title("Static batching waste")
    return save_figure(fig, out / "static_waste.png")


COLUMNS = {"batch_size": "B", "completed": "done", "output_tok_s": "aggregate tok/s",
           "decode_tok_s": "decode tok/s", "user_tok_s": "per-user tok/s", "ttft_ms": "TTFT ms",
           "tpot_ms": "TPOT ms", "step_ms": "decode step ms", "prefill_tok_s": "prefill tok/s",
           "waste_fraction": "waste", "peak_rss_mb": "peak RSS MB",
           "growth_mb": "RSS growth MB"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default <sweep>/plots)")
    args = parser.parse_args(argv)
    jobs, skipped = load_sweep(args.sweep_dir)
    for path in skipped:
        print(f"skipped (error.json or no results.json): {path}")
    if not jobs:
        print(f"no finished jobs under {args.sweep_dir}", file=sys.stderr)
        return 1
    rows = sorted((job_row(job) for job in jobs), key=lambda r: r["batch_size"])
    out = args.out or args.sweep_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    knee = find_knee(rows)
    paths = [plot_throughput(rows, knee, out), plot_latency(rows, out), plot_waste(rows, out)]
    print(markdown_table(rows, COLUMNS))
    fixed, per_row = fit_step(rows)
    knee_text = "none (no fixed cost in the fit)" if knee is None else f"B~{knee:.1f}"
    print(f"\ndecode step fit: {fixed:.0f} ms + {per_row:.1f} ms x B; knee {knee_text}; "
          f"ridge (prefill tok/s / B={rows[0]['batch_size']} decode tok/s): {ridge(rows):.1f}")
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
