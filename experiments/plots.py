"""Sweep plots: read a Hydra multirun dir and draw PNGs (matplotlib, Agg) plus a markdown summary table.

    python experiments/plots.py outputs/multirun/2025-01-01/12-00-00 [--out DIR]

Each job subdir holds results.json, requests.jsonl and .hydra/overrides.yaml; jobs with error.json are
skipped and listed. The swept parameters are the config keys whose values differ between jobs (a config
group such as `engine` counts as one parameter, named by its `name`). Owns: reading result files and
drawing. Ignores: how the numbers were measured (lab.metrics).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen first
from matplotlib import ticker  # noqa: E402
import numpy as np  # noqa: E402

from lab.sweep_callback import job_failure  # noqa: E402

LATENCIES = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2el_ms", "E2EL (ms)"))
# Memory panels: the first key present in every job of each tuple, as (results.json key, label, scale).
# NOTE: util/rss_mb_max is measured per job; peak_memory_mb (ru_maxrss) only grows over a sweep whose jobs
# share one process (the basic and joblib launchers), so it is the fallback.
MEMORY = ((("peak_mem_allocated_mb", "peak CUDA allocated (MB)", 1.0),),
          (("util/rss_mb_max", "peak RSS, sampled (MB)", 1.0), ("peak_memory_mb", "peak RSS, process (MB)", 1.0)),
          (("kv/peak_used_bytes", "KV cache used (MB)", 2**-20),))


@dataclass(slots=True)
class Job:
    path: Path
    results: dict[str, Any]
    requests: list[dict[str, Any]]
    overrides: list[str]
    params: dict[str, Any] = field(default_factory=dict)  # swept parameter -> value

    def label(self, keys: Iterable[str], default: str | None = None) -> str:
        """"engine=ar, input_len=32"; `default` (else "job <num>") when `keys` is empty."""
        text = ", ".join(f"{short(k)}={self.params[k]}" for k in keys)
        return text or (default if default is not None else f"job {self.path.name.split('_')[0]}")


@dataclass(slots=True)
class SweepPlots:
    paths: list[Path]
    skipped: list[Path]
    swept: list[str]


def short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def is_length_key(key: str) -> bool:
    return short(key).endswith("_len") or short(key) == "max_tokens"


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
    return out


def swept_params(configs: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Config keys whose values differ between jobs -> one value per job."""
    flat = [_flatten(c) for c in configs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    varying = {k: [f.get(k) for f in flat] for k in keys if len({repr(f.get(k)) for f in flat}) > 1}
    params: dict[str, list[Any]] = {}
    for key, values in varying.items():
        parts = key.split(".")
        # NOTE: a swept config group (engine=ar,hf) is one parameter, nested keys included (engine.proposer.*)
        groups = [".".join(parts[:i]) for i in range(1, len(parts))]
        group = next((g for g in groups if f"{g}.name" in varying), None)
        if group:
            key, values = group, varying[f"{group}.name"]
        if key not in params and all(values != v for v in params.values()):  # seed and workload.seed: one
            params[key] = values
    return params


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_sweep(sweep_dir: Path) -> tuple[list[Job], list[Path]]:
    """(finished jobs with their swept params, skipped job dirs: error.json or no results.json)."""
    jobs, skipped = [], []
    sweep_dir = Path(sweep_dir)
    # NOTE: recursive: an override such as engine/proposer=ngram puts a "/" into Hydra's job dir name
    subdirs = {p.parent for name in (".hydra", "results.json", "error.json")
               for p in sweep_dir.rglob(name)} - {sweep_dir}

    def job_order(path: Path) -> tuple[float, str]:
        number = path.relative_to(sweep_dir).parts[0].split("_")[0]
        return (int(number) if number.isdigit() else math.inf, str(path))

    for path in sorted(subdirs, key=job_order):
        if job_failure(path) is not None:
            skipped.append(path)
            continue
        overrides_file = path / ".hydra" / "overrides.yaml"
        overrides = [line.removeprefix("- ").strip() for line in overrides_file.read_text().splitlines()
                     if line.startswith("- ")] if overrides_file.is_file() else []
        jobs.append(Job(path, json.loads((path / "results.json").read_text()), _read_jsonl(path / "requests.jsonl"),
                        overrides))
    for key, values in swept_params([j.results.get("config", {}) for j in jobs]).items():
        for job, value in zip(jobs, values):
            job.params[key] = value
    return jobs, skipped


def _is_numeric(jobs: list[Job], key: str) -> bool:
    return all(isinstance(j.params[key], (int, float)) and not isinstance(j.params[key], bool) for j in jobs)


def _colors(labels: Iterable[str]) -> dict[str, Any]:
    unique = list(dict.fromkeys(labels))
    cmap = plt.get_cmap("tab10" if len(unique) <= 10 else "tab20")
    return {label: cmap(i % cmap.N) for i, label in enumerate(unique)}


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write (PNG, 110 dpi) and close a figure; returns the path. Every sweep script saves through it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _tpot(record: dict[str, Any]) -> float | None:
    if record.get("tpot_ms") is not None:
        return record["tpot_ms"]
    n, ttft, e2el = record.get("output_len", 0), record.get("ttft_ms"), record.get("e2el_ms")
    return (e2el - ttft) / (n - 1) if n > 1 and ttft is not None and e2el is not None else None


def _mean_context(record: dict[str, Any]) -> float | None:
    if record.get("prompt_len") is None or record.get("output_len") is None:
        return None
    return record["prompt_len"] + record["output_len"] / 2


def plot_latency_cdfs(jobs: list[Job], swept: list[str], out: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = _colors(j.label(swept) for j in jobs)
    for ax, (key, title) in zip(axes, LATENCIES):
        for job in jobs:
            values = np.sort([v for r in job.requests if (v := _tpot(r) if key == "tpot_ms" else r.get(key)) is not None])
            if len(values):
                ax.step(np.r_[values[0], values], np.arange(len(values) + 1) / len(values), where="post",
                        color=colors[job.label(swept)], label=job.label(swept))
        ax.set(xlabel=title, ylabel="fraction of requests", title=f"{title.split()[0]} CDF", xscale="log")
        # NOTE: matplotlib's default log ticks either overlap or vanish within one decade; label 1-2-5 steps
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return save_figure(fig, out / "latency_cdf.png")


def plot_throughput(jobs: list[Job], swept: list[str], out: Path) -> list[Path]:
    """Throughput against each numeric swept parameter, one line per combination of the others."""
    metrics = (("output_throughput", "output tok/s"), ("total_token_throughput", "total tok/s"))
    numeric = [k for k in swept if _is_numeric(jobs, k)]
    if not numeric:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        labels = [j.label(swept) for j in jobs]
        for ax, (key, title) in zip(axes, metrics):
            ax.bar(range(len(jobs)), [j.results.get(key, np.nan) for j in jobs])
            ax.set_xticks(range(len(jobs)), labels, rotation=45, ha="right", fontsize=7)
            ax.set(ylabel=title, title=title)
        return [save_figure(fig, out / "throughput.png")]
    paths = []
    for x_key in numeric:
        others = [k for k in swept if k != x_key]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        for ax, (key, title) in zip(axes, metrics):
            _lines(ax, jobs, others, lambda j: j.params[x_key], lambda j, key=key: j.results.get(key, np.nan))
            ax.set(xlabel=short(x_key), ylabel=title, title=f"{title} vs {short(x_key)}")
        axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        paths.append(save_figure(fig, out / f"throughput_vs_{short(x_key)}.png"))
    return paths


def _lines(ax: Any, jobs: list[Job], series: list[str], x: Callable[[Job], float], y: Callable[[Job], float]) -> None:
    """One marker line per series (jobs sharing the values of `series`), a point per job."""
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.label(series, "all"), []).append(job)
    colors = _colors(groups)
    for label, members in groups.items():
        members = sorted(members, key=x)
        ax.plot([x(j) for j in members], [y(j) for j in members], "o-", color=colors[label], label=label)
    ax.grid(alpha=0.3)


def _scatter_by_series(ax: Any, jobs: list[Job], series: list[str], xy: Callable[[dict[str, Any]], tuple]) -> None:
    colors = _colors(j.label(series, "all") for j in jobs)
    seen: set[str] = set()
    for job in jobs:
        label = job.label(series, "all")
        points = [p for r in job.requests if None not in (p := xy(r))]
        if points:
            xs, ys = zip(*points)
            ax.scatter(xs, ys, s=18, alpha=0.7, color=colors[label], label=None if label in seen else label)
            seen.add(label)
    ax.grid(alpha=0.3)


def plot_length_effects(jobs: list[Job], swept: list[str], out: Path) -> list[Path]:
    """TTFT vs prompt length; TPOT and per-token ITL vs context; coloured by the swept non-length keys."""
    series = [k for k in swept if not is_length_key(k)]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    _scatter_by_series(ax, jobs, series, lambda r: (r.get("prompt_len"), r.get("ttft_ms")))
    ax.set(xlabel="prompt length (tokens)", ylabel="TTFT (ms)", title="TTFT vs prompt length")
    ax.legend(fontsize=8)
    paths = [save_figure(fig, out / "ttft_vs_prompt_len.png")]

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    _scatter_by_series(left, jobs, series, lambda r: (_mean_context(r), _tpot(r)))
    left.set(xlabel="mean context while decoding: prompt + output/2 (tokens)", ylabel="TPOT (ms)",
             title="TPOT vs context (one point per request)")
    left.legend(fontsize=8)
    colors = _colors(j.label(series, "all") for j in jobs)
    for job in jobs:
        by_context: dict[int, list[float]] = {}
        for r in job.requests:
            for i, itl in enumerate(r.get("itl_ms") or []):
                by_context.setdefault(r["prompt_len"] + i + 1, []).append(itl)
        if by_context:
            xs = sorted(by_context)
            right.plot(xs, [np.median(by_context[x]) for x in xs], lw=0.8, alpha=0.8,
                       color=colors[job.label(series, "all")])
    right.set(xlabel="context length at the decode step (tokens)", ylabel="ITL (ms, median over requests)",
              title="decode step time vs context")
    right.grid(alpha=0.3)
    paths.append(save_figure(fig, out / "tpot_vs_context.png"))
    return paths


def _first_present(jobs: list[Job], options: tuple[tuple[str, str, float], ...]) -> tuple[str, str, float] | None:
    return next((m for m in options if all(isinstance(j.results.get(m[0]), (int, float)) for j in jobs)), None)


def _max_context(job: Job) -> int:
    return max(r.get("prompt_len", 0) + r.get("output_len", 0) for r in job.requests)


def plot_memory(jobs: list[Job], swept: list[str], out: Path) -> Path | None:
    """Peak memory per job against the job's longest sequence (prompt + output tokens)."""
    present = [m for options in MEMORY if (m := _first_present(jobs, options)) is not None]
    if not present or not all(j.requests for j in jobs):
        return None
    series = [k for k in swept if not is_length_key(k)]
    fig, axes = plt.subplots(1, len(present), figsize=(5.5 * len(present), 4.2), squeeze=False)
    for ax, (key, title, scale) in zip(axes[0], present):
        measured = [j for j in jobs if j.results[key] > 0]  # NOTE: 0 = not tracked (hf keeps its own KV cache)
        _lines(ax, measured, series, _max_context, lambda j, key=key, scale=scale: j.results[key] * scale)
        ax.set(xlabel="longest sequence in the job (tokens)", ylabel=title, title=title)
        ax.legend(fontsize=7)
    return save_figure(fig, out / "memory_vs_length.png")


def summary_table(jobs: list[Job], swept: list[str]) -> str:
    """A markdown table: swept parameters, throughput and median latencies per job."""
    cols = [("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT p50 ms"), ("median_tpot_ms", "TPOT p50 ms"),
            ("median_e2el_ms", "E2EL p50 ms"), ("util/rss_mb_max", "RSS max MB")]
    cols = [c for c in cols if any(c[0] in j.results for j in jobs)]
    lines = ["| " + " | ".join([short(k) for k in swept] + [t for _, t in cols]) + " |",
             "|" + "---|" * (len(swept) + len(cols))]
    for job in jobs:
        values = [f"{job.results[k]:.1f}" if isinstance(job.results.get(k), (int, float)) else "-" for k, _ in cols]
        lines.append("| " + " | ".join([str(job.params[k]) for k in swept] + values) + " |")
    return "\n".join(lines) + "\n"


def failed_jobs_section(sweep_dir: Path, skipped: list[Path]) -> str:
    """summary.md's list of the jobs left out: each job dir (relative to the sweep) with its error."""
    if not skipped:
        return ""
    lines = ["", f"Failed jobs ({len(skipped)}, not in the table above):", ""]
    lines += [f"- `{p.relative_to(sweep_dir) if p.is_relative_to(sweep_dir) else p}`: "
              f"{(job_failure(p) or 'no results.json').splitlines()[0]}" for p in skipped]
    return "\n".join(lines) + "\n"


def plot_sweep(sweep_dir: Path, out_dir: Path | None = None) -> SweepPlots:
    """Every plot for a sweep dir (default out: SWEEP_DIR/plots), plus summary.md there (failed jobs listed)."""
    sweep_dir = Path(sweep_dir)
    jobs, skipped = load_sweep(sweep_dir)
    out = Path(out_dir) if out_dir else sweep_dir / "plots"
    if not jobs:
        return SweepPlots([], skipped, [])
    out.mkdir(parents=True, exist_ok=True)
    swept = list(jobs[0].params)
    paths = [plot_latency_cdfs(jobs, swept, out), *plot_throughput(jobs, swept, out),
             *plot_length_effects(jobs, swept, out)]
    if (memory := plot_memory(jobs, swept, out)) is not None:
        paths.append(memory)
    (table := out / "summary.md").write_text(summary_table(jobs, swept) + failed_jobs_section(sweep_dir, skipped))
    return SweepPlots([*paths, table], skipped, swept)


def report(result: SweepPlots) -> str:
    lines = [f"plots: {p}" for p in result.paths]
    lines += [f"skipped (failed or unfinished): {p}" for p in result.skipped]
    return "\n".join(lines or ["no finished jobs to plot"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="default: SWEEP_DIR/plots")
    args = parser.parse_args(argv)
    result = plot_sweep(args.sweep_dir, args.out)
    print(report(result))
    return 0 if result.paths else 1


if __name__ == "__main__":
    raise SystemExit(main())
