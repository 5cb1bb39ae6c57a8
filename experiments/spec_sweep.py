"""Speculative-decoding sweep (conf/experiment/spec_sweep.yaml): acceptance (rate, length tau, per position),
speedup vs k and vs concurrency per proposer, and where a step's time goes (draft vs verify), as PNGs
(matplotlib, Agg) plus a markdown table on stdout.

    python experiments/spec_sweep.py outputs/multirun/<day>/spec_sweep_<time> [--out docs/figures]

Every job ran its own k=0 baseline first on the same requests (engine.measure_speedup), so each speedup
is a ratio measured within one process. Owns: reading the jobs' results.json and drawing. Ignores: measuring.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen first

PROPOSERS = {"NgramProposerConfig": "ngram", "LayerSkipProposerConfig": "layerskip",
             "DraftModelProposerConfig": "draft_model"}
COLUMNS = {"workload": "dataset", "proposer": "proposer", "k": "k", "concurrency": "conc.",
           "acceptance_rate": "accept %", "acceptance_length": "tau", "tokens_per_forward": "tok/fwd",
           "baseline_tpot_ms": "TPOT k=0 (ms)", "tpot_ms": "TPOT (ms)", "speedup_tpot": "speedup TPOT",
           "speedup_e2e": "speedup e2e", "draft_ms_per_token": "draft ms/tok", "verify_ms_per_token": "verify ms/tok",
           "same_output": "same output"}


def proposer_name(engine: dict[str, Any]) -> str:
    proposer = engine.get("proposer", {})
    name = PROPOSERS.get(str(proposer.get("_target_", "")).rsplit(".", 1)[-1], "?")
    return f"layerskip[{proposer['num_layers']}]" if name == "layerskip" else name


def job_row(results: dict[str, Any]) -> dict[str, Any]:
    """One finished job's results.json -> the fields the plots and the table use."""
    config = results.get("config", {})
    engine = config.get("engine", {})
    k = int(results.get("spec/num_spec_tokens", engine.get("num_spec_tokens", 0)))
    tokens = max(1, results.get("total_output_tokens", 0))
    return {
        "workload": results.get("workload", "?"), "proposer": proposer_name(engine), "k": k,
        "concurrency": int(results.get("max_concurrency") or config.get("concurrency") or 1),
        "acceptance_rate": results.get("spec_decode_acceptance_rate", math.nan),
        "acceptance_length": results.get("spec_decode_acceptance_length", math.nan),
        "per_position": [results.get(f"spec_decode_per_position_acceptance_rate/{i}", math.nan) for i in range(k)],
        "num_drafts": results.get("spec_decode_num_drafts", 0),
        "tokens_per_forward": results.get("spec/tokens_per_target_forward", math.nan),
        "baseline_tpot_ms": results.get("baseline/mean_tpot_ms", math.nan), "tpot_ms": results.get("mean_tpot_ms"),
        "speedup_tpot": results.get("spec/speedup_tpot", math.nan),
        "speedup_e2e": results.get("spec/speedup_e2e", math.nan),
        "same_output": results.get("spec/same_output_as_baseline"),
        "draft_ms_per_token": 1e3 * results.get("spec/draft_s", math.nan) / tokens,
        "verify_ms_per_token": 1e3 * results.get("spec/verify_s", math.nan) / tokens,
        "baseline_ms_per_token": results.get("baseline/duration", math.nan) * 1e3 / tokens,
    }


def load_rows(sweep_dirs: list[Path]) -> tuple[list[dict[str, Any]], list[Path]]:
    """(a row per finished job, sorted; job dirs skipped because they failed or hold no results)."""
    rows, skipped = [], []
    for sweep_dir in sweep_dirs:
        for path in sorted(p for p in Path(sweep_dir).iterdir() if p.is_dir()):
            results_file = path / "results.json"
            results = json.loads(results_file.read_text()) if results_file.is_file() else {}
            if (path / "error.json").exists() or not results or results.get("failed_job"):
                skipped.append(path)
                continue
            rows.append(job_row(results))
    rows.sort(key=lambda r: (r["workload"], r["proposer"], r["concurrency"], r["k"]))
    return rows, skipped


def _series(rows: list[dict[str, Any]], **fixed: Any) -> dict[str, list[dict[str, Any]]]:
    """Rows matching `fixed`, grouped by (dataset, proposer) into series."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if all(row[key] == value for key, value in fixed.items()):
            out.setdefault(f"{row['workload']} / {row['proposer']}", []).append(row)
    return out


def _line(ax: Any, groups: dict[str, list[dict[str, Any]]], x: str, y: str) -> None:
    for label, group in groups.items():
        group = sorted(group, key=lambda r: r[x])
        ax.plot([r[x] for r in group], [r[y] for r in group], marker="o", label=label)
    ax.grid(True, alpha=0.3)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_acceptance(rows: list[dict[str, Any]], out: Path) -> Path:
    """Acceptance rate and tau vs k at concurrency 1; per-position acceptance at the largest k."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    lowest = min(r["concurrency"] for r in rows)
    groups = _series(rows, concurrency=lowest)
    _line(axes[0], groups, "k", "acceptance_rate")
    axes[0].set(xlabel="k (num_spec_tokens)", ylabel="acceptance rate (%)", title="draft tokens accepted")
    _line(axes[1], groups, "k", "acceptance_length")
    axes[1].set(xlabel="k (num_spec_tokens)", ylabel="tau = 1 + accepted / drafts", title="acceptance length")
    for label, group in groups.items():
        longest = max(group, key=lambda r: r["k"])
        axes[2].plot(range(1, longest["k"] + 1), longest["per_position"], marker="o", label=f"{label} (k={longest['k']})")
    axes[2].set(xlabel="draft position", ylabel="accepted share of drafts", title="per-position acceptance")
    axes[2].grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"Acceptance (concurrency {lowest})")
    return _save(fig, out / "spec_acceptance.png")


def plot_speedup(rows: list[dict[str, Any]], out: Path) -> Path:
    """TPOT speedup vs k (lowest concurrency) and vs concurrency (each proposer's best k at batch 1)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    lowest = min(r["concurrency"] for r in rows)
    _line(axes[0], _series(rows, concurrency=lowest), "k", "speedup_tpot")
    axes[0].set(xlabel="k (num_spec_tokens)", ylabel="TPOT speedup vs k=0", title=f"speedup vs k (concurrency {lowest})")
    for label, group in _series(rows).items():
        at_lowest = [r for r in group if r["concurrency"] == lowest] or group
        best_k = max(at_lowest, key=lambda r: r["speedup_tpot"])["k"]
        chosen = sorted((r for r in group if r["k"] == best_k), key=lambda r: r["concurrency"])
        axes[1].plot([r["concurrency"] for r in chosen], [r["speedup_tpot"] for r in chosen], marker="o",
                     label=f"{label} (k={best_k})")
    axes[1].set(xlabel="concurrency (requests in flight)", ylabel="TPOT speedup vs k=0", title="speedup vs concurrency")
    concurrencies = sorted({r["concurrency"] for r in rows})
    axes[1].set_xscale("log", base=2)
    axes[1].set_xticks(concurrencies, [str(c) for c in concurrencies])
    for ax in axes:
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out / "spec_speedup.png")


def plot_time_split(rows: list[dict[str, Any]], out: Path) -> Path:
    """Per output token: draft ms and verify ms with speculation, next to the k=0 baseline's ms."""
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(rows)), 4))
    labels = [f"{r['workload'][:5]} {r['proposer']} k{r['k']} c{r['concurrency']}" for r in rows]
    xs = range(len(rows))
    verify = [r["verify_ms_per_token"] for r in rows]
    ax.bar(xs, verify, label="verify (target forwards)", color="tab:blue")
    ax.bar(xs, [r["draft_ms_per_token"] for r in rows], bottom=verify, label="draft", color="tab:orange")
    ax.scatter(xs, [r["baseline_ms_per_token"] for r in rows], color="black", marker="_", s=200, zorder=3,
               label="k=0 baseline (wall ms / token)")
    ax.set_xticks(list(xs), labels, rotation=75, fontsize=7)
    ax.set_ylabel("ms per output token")
    ax.set_title("Where the time goes: draft vs verify, per output token")
    ax.legend(fontsize=7)
    return _save(fig, out / "spec_time_split.png")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row.get(key, "")) for key in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: <first sweep dir>/plots)")
    args = parser.parse_args(argv)
    rows, skipped = load_rows(args.sweep_dirs)
    if not rows:
        print(f"no finished jobs in {', '.join(map(str, args.sweep_dirs))}")
        return 1
    out = args.out or args.sweep_dirs[0] / "plots"
    out.mkdir(parents=True, exist_ok=True)
    for path in (plot_acceptance(rows, out), plot_speedup(rows, out), plot_time_split(rows, out)):
        print(f"wrote {path}")
    print(markdown_table(rows))
    for path in skipped:
        print(f"skipped {path} (failed or no results)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
