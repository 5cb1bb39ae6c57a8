"""Speculative-decoding sweep (conf/experiment/spec_sweep.yaml): acceptance (rate, length tau, per position),
speedup vs k and vs concurrency per proposer, and what a speculative step costs and buys relative to a
plain step (draft vs verify), as PNGs (matplotlib, Agg) plus a markdown table on stdout.

    python experiments/spec_sweep.py <sweep dir> [<sweep dir> ...] [--out docs/figures]

Several sweep dirs of the same experiment are combined: each setting's numbers are the median over runs.

Every job ran its own k=0 baseline first on the same requests (engine.measure_speedup), so each speedup
is a ratio measured within one process. Owns: reading the jobs' results.json and drawing. Ignores: measuring.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen first

sys.path.insert(0, str(Path(__file__).resolve().parent))   # NOTE: the sibling helper, also when loaded by path
from plots import save_figure  # noqa: E402
from sweep_jobs import finished_jobs  # noqa: E402

PROPOSERS = {"NgramProposerConfig": "ngram", "SuffixProposerConfig": "suffix",
             "LayerSkipProposerConfig": "layerskip", "DraftModelProposerConfig": "draft_model",
             "EagleProposerConfig": "eagle", "DFlashProposerConfig": "dflash"}
COLUMNS = {"workload": "dataset", "proposer": "proposer", "k": "k", "concurrency": "conc.", "runs": "runs",
           "acceptance_rate": "accept %", "acceptance_length": "tau", "tokens_per_request_step": "tok/req/step",
           "baseline_tpot_ms": "TPOT k=0 (ms)", "tpot_ms": "TPOT (ms)", "speedup_tpot": "speedup TPOT",
           "speedup_e2e": "speedup e2e", "verify_step_cost": "verify step / k=0 step",
           "draft_step_cost": "draft / k=0 step", "same_output": "same output"}
KEY = ("workload", "proposer", "k", "concurrency")


def proposer_name(engine: dict[str, Any]) -> str:
    """The proposer, with what tells its variants apart: layerskip[<layers>], eagle/dflash[tree <W>] (a tree of
    drafts, conf/experiment/tree_sweep.yaml; `+tails`: DFlash's later drafts under every runner-up), dflash[tree of
    <N>] (a tree of the block's N likeliest paths), dflash[<S> steps] (denoising steps,
    conf/experiment/denoise_sweep.yaml)."""
    proposer = engine.get("proposer", {})
    name = PROPOSERS.get(str(proposer.get("_target_", "")).rsplit(".", 1)[-1], "?")
    if name == "layerskip":
        return f"layerskip[{proposer['num_layers']}]"
    width, steps = int(proposer.get("tree_width", 1)), int(proposer.get("denoise_steps", 1))
    variants = [f"tree {width}{'+tails' if proposer.get('tree_tails') else ''}"] if width > 1 else []
    variants += [f"tree of {proposer['tree_nodes']}"] if int(proposer.get("tree_nodes", 0)) else []
    variants += [f"{steps} steps"] if steps > 1 else []
    return f"{name}[{', '.join(variants)}]" if variants else name


def job_row(results: dict[str, Any]) -> dict[str, Any]:
    """One finished job's results.json -> the fields the plots and the table use.

    A speculative decode step (target forward over 1 + k tokens per request, then the draft) is timed
    against a plain step of the k=0 baseline (its TPOT: one token per request per step), so
    speedup ~ tokens per request per step / (verify_step_cost + draft_step_cost)."""
    config = results.get("config", {})
    engine = config.get("engine", {})
    k = int(results.get("spec/num_spec_tokens", engine.get("num_spec_tokens", 0)))
    concurrency = int(results.get("max_concurrency") or config.get("concurrency") or 1)
    baseline_step_ms = results.get("baseline/mean_tpot_ms", math.nan)
    decode_steps, draft_steps = results.get("phase/decode_steps", 0), results.get("phase/draft_steps", 0)
    tokens = results.get("total_output_tokens", 0)
    return {
        "workload": results.get("workload", "?"), "proposer": proposer_name(engine), "k": k,
        "concurrency": concurrency, "runs": 1,
        "acceptance_rate": results.get("spec_decode_acceptance_rate", math.nan),
        "acceptance_length": results.get("spec_decode_acceptance_length", math.nan),
        "per_position": [*results.get("spec_decode_per_position_acceptance_rates", []), *[math.nan] * k][:k],
        # NOTE: every request-step emits one target token, plus the drafts it accepted
        "tokens_per_request_step": tokens / max(1, tokens - results.get("spec_decode_accepted_tokens", 0)),
        "baseline_tpot_ms": baseline_step_ms, "tpot_ms": results.get("mean_tpot_ms", math.nan),
        "speedup_tpot": results.get("spec/speedup_tpot", math.nan),
        "speedup_e2e": results.get("spec/speedup_e2e", math.nan),
        "same_output": results.get("spec/same_output_as_baseline"),
        "verify_step_cost": 1e3 * results.get("phase/decode_s", math.nan) / max(1, decode_steps) / baseline_step_ms,
        "draft_step_cost": 1e3 * results.get("spec/draft_s", math.nan) / max(1, draft_steps) / baseline_step_ms,
    }


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Repeated settings (several sweep dirs) -> one row each: the median of every number, sorted."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[key] for key in KEY), []).append(row)
    out = []
    for group in groups.values():
        row = dict(group[0], runs=len(group), same_output=all(r["same_output"] is True for r in group))
        for name, value in group[0].items():
            if isinstance(value, float):
                row[name] = float(np.median([r[name] for r in group]))
        row["per_position"] = np.median([r["per_position"] for r in group], axis=0).tolist()
        out.append(row)
    return sorted(out, key=lambda r: tuple(r[key] for key in KEY))


def load_rows(sweep_dirs: list[Path]) -> tuple[list[dict[str, Any]], list[Path]]:
    """(a row per setting, medians over repeats; job dirs skipped because they failed or hold no results)."""
    finished, skipped = finished_jobs(sweep_dirs)
    rows = [job_row(results) for results in finished]
    return aggregate(rows), skipped


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
    return save_figure(fig, out / "spec_acceptance.png")


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
    return save_figure(fig, out / "spec_speedup.png")


def plot_step_cost(rows: list[dict[str, Any]], out: Path) -> Path:
    """Per decode step, relative to a plain (k=0) step at the same concurrency: verify + draft cost, and
    the tokens each request gains; speedup ~ their ratio. One bar per concurrency for each setting."""
    settings = list(dict.fromkeys((r["workload"], r["proposer"], r["k"]) for r in rows))
    concurrencies = sorted({r["concurrency"] for r in rows})
    by_key = {(r["workload"], r["proposer"], r["k"], r["concurrency"]): r for r in rows}
    width = 0.8 / len(concurrencies)
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.6 * len(settings)), 7), sharex=True)
    for i, concurrency in enumerate(concurrencies):
        xs = [j + (i - (len(concurrencies) - 1) / 2) * width for j in range(len(settings))]
        chosen = [by_key.get((*setting, concurrency)) for setting in settings]
        verify = [r["verify_step_cost"] if r else math.nan for r in chosen]
        draft = [r["draft_step_cost"] if r else math.nan for r in chosen]
        color = plt.get_cmap("tab10")(i)
        axes[0].bar(xs, verify, width, color=color, label=f"verify, concurrency {concurrency}")
        axes[0].bar(xs, draft, width, bottom=verify, color=color, alpha=0.4, hatch="//",
                    label=f"draft, concurrency {concurrency}")
        axes[1].bar(xs, [r["tokens_per_request_step"] if r else math.nan for r in chosen], width, color=color,
                    label=f"concurrency {concurrency}")
    axes[0].set(ylabel="step time / k=0 step time", title="cost of a speculative decode step (k=0 step = 1)")
    axes[1].set(ylabel="tokens per request per step", title="what a step buys (k=0 step = 1 token)")
    for ax in axes:
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_xticks(range(len(settings)), [f"{w} {p} k={k}" for w, p, k in settings], rotation=60, fontsize=7)
    return save_figure(fig, out / "spec_step_cost.png")


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
    for path in (plot_acceptance(rows, out), plot_speedup(rows, out), plot_step_cost(rows, out)):
        print(f"wrote {path}")
    print(markdown_table(rows))
    for path in skipped:
        print(f"skipped {path} (failed or no results)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
