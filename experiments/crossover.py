"""The speculation crossover (conf/experiment/crossover*.yaml): speedup over AR vs concurrency (or prompt
length) per method and dataset, and where each method's speedup falls below 1.0.

    python experiments/crossover.py outputs/multirun/<day>/crossover_<time> [more sweep dirs] [--out DIR]

Writes <out>/crossover.json (rows, crossover points, failed jobs), <out>/crossover.png, and prints a markdown table.
On the concurrency axis each method also gets `pays_up_to`: the most requests at which drafting still paid,
the value for `engine.disable_by_batch_size` (no drafts above it; lab/spec/schedule.py).
Every job ran its own AR baseline on the same requests (engine.measure_speedup, turns by steps where every request
arrives at once, else ABBA turns over engine.speedup_rounds chunks), so each speedup is a ratio measured in one
process. Jobs whose engine drafted nothing (engine=dflash_adaptive past 1 request) ran AR against AR: their spread
around 1.0 is the sweep's noise floor (`noise_floor`), and a speedup within it of 1.0 reads as AR's speed.
Owns: reading results.json, finding crossovers, drawing. Ignores: measuring.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen first

sys.path.insert(0, str(Path(__file__).resolve().parent))   # NOTE: the sibling helper, also when loaded by path
from sweep_jobs import finished_jobs  # noqa: E402

from lab.sweep_callback import job_failure  # noqa: E402

METHODS = {"speculative": "vanilla (suffix)", "eagle": "EAGLE", "dflash": "DFlash",
           "dflash_adaptive": "DFlash by batch size", "dflash_goodput": "DFlash, goodput policy",
           "dflash_graft": "suffix chain on a DFlash tree", "suffix_dflash_goodput": "suffix then DFlash, goodput"}
COLUMNS = {"workload": "dataset", "method": "method", "concurrency": "conc.", "prompt_len": "mean prompt",
           "baseline_tpot_ms": "AR TPOT (ms)", "tpot_ms": "TPOT (ms)", "speedup_tpot": "speedup TPOT",
           "speedup_e2e": "speedup e2e", "acceptance_length": "tau", "tokens_per_forward": "tok/fwd",
           "draft_share": "draft share", "same_output": "same output"}


def job_row(results: dict[str, Any]) -> dict[str, Any]:
    config = results.get("config", {})
    engine = config.get("engine", {})
    name = engine.get("name", "?")
    completed = max(1, results.get("completed", 0))
    draft_s, verify_s = results.get("spec/draft_s", 0.0), results.get("spec/verify_s", 0.0)
    return {
        "workload": results.get("workload", "?"), "method": METHODS.get(name, name),
        "concurrency": int(results.get("max_concurrency") or config.get("concurrency") or 1),
        "min_prompt_len": config.get("workload", {}).get("min_prompt_len"),
        "prompt_len": results.get("total_input_tokens", 0) / completed,
        "k": int(results.get("spec/num_spec_tokens", engine.get("num_spec_tokens", 0))),
        "baseline_tpot_ms": results.get("baseline/mean_tpot_ms", math.nan), "tpot_ms": results.get("mean_tpot_ms", math.nan),
        "speedup_tpot": results.get("spec/speedup_tpot", math.nan), "speedup_e2e": results.get("spec/speedup_e2e", math.nan),
        "acceptance_length": results.get("spec_decode_acceptance_length", math.nan),
        "tokens_per_forward": results.get("spec/tokens_per_target_forward", math.nan),
        "draft_share": draft_s / (draft_s + verify_s) if draft_s + verify_s else math.nan,
        "same_output": results.get("spec/same_output_as_baseline"),
        "drafted_nothing": results.get("spec_decode_num_drafts") == 0,
    }


def load_rows(sweep_dirs: list[Path]) -> tuple[list[dict[str, Any]], list[Path]]:
    finished, skipped = finished_jobs(sweep_dirs)
    rows = [job_row(results) for results in finished]
    rows.sort(key=lambda r: (r["workload"], r["method"], r["concurrency"], r["prompt_len"]))
    return rows, skipped


def axis_of(rows: list[dict[str, Any]]) -> str:
    """'prompt_len' when the sweep varied the prompt-length filter, else 'concurrency'."""
    return "prompt_len" if len({r["min_prompt_len"] for r in rows}) > 1 else "concurrency"


AT_AR_TOLERANCE = 0.02   # speedups this close to 1.0 are AR's speed within a cell's noise, at the least
NOISE_FLOOR_RMS = 2.0    # and so are those within this many of the A/A jobs' root mean square distance from 1.0


def noise_floor(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How far from 1.0 a speedup must be to differ from AR in this sweep, from its A/A jobs: the jobs whose engine
    drafted nothing measured AR against AR, so their distance from 1.0 is the noise of a cell (the machine, the job
    beside it). `tolerance`: NOISE_FLOOR_RMS times their root mean square distance, at least AT_AR_TOLERANCE (that
    alone without A/A jobs)."""
    speedups = [r["speedup_tpot"] for r in rows if r.get("drafted_nothing") and not math.isnan(r["speedup_tpot"])]
    if not speedups:
        return {"tolerance": AT_AR_TOLERANCE, "jobs": 0}
    rms = math.sqrt(sum((s - 1.0) ** 2 for s in speedups) / len(speedups))
    return {"tolerance": max(AT_AR_TOLERANCE, NOISE_FLOOR_RMS * rms), "jobs": len(speedups), "rms": rms,
            "min": min(speedups), "max": max(speedups)}


def noise_floor_line(floor: dict[str, Any]) -> str:
    if not floor["jobs"]:
        return (f"noise floor: every job here drafted, so none measured AR against AR; speedups within "
                f"{floor['tolerance']:.0%} of 1.0 read as AR's")
    return (f"noise floor: the {floor['jobs']} jobs that drafted nothing (AR against AR) read {floor['min']:.3f}-"
            f"{floor['max']:.3f}x, {floor['rms']:.1%} from 1.0 (root mean square), so speedups within "
            f"{floor['tolerance']:.1%} of 1.0 read as AR's speed")


def _listed(xs: list[float]) -> str:
    return ", ".join(f"{x:g}" for x in xs)


def crossover_point(xs: list[float], speedups: list[float], log_x: bool = True,
                    noise: float = AT_AR_TOLERANCE) -> dict[str, Any]:
    """Where speedup first falls below 1.0 along increasing x: interpolated (log2 x) between the last point
    at or above 1 and the first below; 'never helps' / 'always helps' when it does not cross. `pays_again_at`: the
    x past that fall where the speedup is back above 1.0 by more than a cell's `noise` (on a CPU, 16 requests' plain
    steps stream fp32 weights that 4 requests' read as GGUF blocks, so extra verify rows can be cheap again there).
    `within_noise`: the first cell below 1.0 is within `noise` of it (AR's speed as far as the sweep can tell)."""
    points = sorted((x, s) for x, s in zip(xs, speedups) if not math.isnan(s))
    if not points:
        return {"crossover": None, "status": "no data"}
    first_below = next((i for i, (_, s) in enumerate(points) if s < 1.0), None)
    again = [] if first_below is None else [x for x, s in points[first_below + 1:] if s > 1.0 + noise]
    said_again = f", above 1.0 again at {_listed(again)}" if again else ""
    if first_below is None:
        return {"crossover": None, "pays_again_at": again, "status": f"still above 1.0 at {points[-1][0]:g}"}
    x_below, s_below = points[first_below]
    within_noise = 1.0 - s_below <= noise
    said_noise = f" (within noise of 1.0 at {x_below:g})" if within_noise else ""
    if first_below == 0:
        return {"crossover": None, "never_helps": True, "pays_again_at": again, "within_noise": within_noise,
                "status": f"below 1.0 already at {x_below:g}{said_noise}{said_again}"}
    (x0, s0), (x1, s1) = points[first_below - 1], points[first_below]
    t0, t1 = (math.log2(x0), math.log2(x1)) if log_x else (x0, x1)
    at = t0 + (s0 - 1.0) / (s0 - s1) * (t1 - t0)
    # NOTE: a method that stops drafting past some batch size (engine=dflash_adaptive) sits at AR's speed
    # there, and the noise then "crosses" 1.0; say so rather than report it as a loss.
    holds = all(s >= 1.0 - noise for _, s in points[first_below:])
    return {"crossover": float(2 ** at if log_x else at), "holds_ar_after": holds, "pays_again_at": again,
            "within_noise": within_noise,
            "status": f"crosses between {x0:g} and {x1:g}"
                      + (", then within noise of AR" if holds and not again else said_noise) + said_again}


def series(rows: list[dict[str, Any]], axis: str) -> dict[tuple, list[dict[str, Any]]]:
    """Rows grouped into lines: (dataset, method) or, on the prompt-length axis, (dataset, method, concurrency)."""
    out: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["workload"], row["method"]) + ((row["concurrency"],) if axis == "prompt_len" else ())
        out.setdefault(key, []).append(row)
    for line in out.values():
        line.sort(key=lambda r: r[axis])
    return out


def crossovers(rows: list[dict[str, Any]], axis: str, noise: float = AT_AR_TOLERANCE) -> list[dict[str, Any]]:
    result = []
    for key, line in series(rows, axis).items():
        point = crossover_point([r[axis] for r in line], [r["speedup_tpot"] for r in line], log_x=axis == "concurrency",
                                noise=noise)
        result.append({"workload": key[0], "method": key[1], **({"concurrency": key[2]} if len(key) > 2 else {}),
                       "axis": axis, **point,
                       "best_speedup_tpot": max((r["speedup_tpot"] for r in line), default=math.nan),
                       **({"pays_up_to": pays_up_to(point)} if axis == "concurrency" else {})})
    return result


def pays_up_to(point: dict[str, Any]) -> int | None:
    """The most requests in flight at which drafting still paid: the setting for the engine's
    `disable_by_batch_size` (lab/spec/schedule.py); 0 = it never paid, None = it paid at every tested size."""
    if point["crossover"] is not None:
        return int(math.floor(point["crossover"]))
    return 0 if point.get("never_helps") else None


def plot(rows: list[dict[str, Any]], axis: str, out: Path, noise: float = AT_AR_TOLERANCE) -> Path:
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for key, line in series([r for r in rows if r["workload"] == workload], axis).items():
            label = key[1] + (f", concurrency {key[2]}" if len(key) > 2 else "")
            ax.plot([r[axis] for r in line], [r["speedup_tpot"] for r in line], marker="o", label=label)
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="AR (no speculation)")
        ax.axhspan(1.0 - noise, 1.0 + noise, color="gray", alpha=0.15, label=f"AR within the noise (+-{noise:.1%})")
        if axis == "concurrency":
            ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrency (requests in flight)" if axis == "concurrency" else "mean prompt length (tokens)",
               ylabel="TPOT speedup over AR (same job)", title=f"{workload}: where speculation stops helping")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "crossover.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown_table(rows: list[dict[str, Any]], points: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row.get(key, "")) for key in COLUMNS) + " |" for row in rows]
    by_batch = any("pays_up_to" in p for p in points)
    lines += ["", "| dataset | method | crossover (speedup < 1.0) | best TPOT speedup |"
              + (" drafts pay up to (requests) |" if by_batch else ""), "|---|---|---|---|" + ("---|" if by_batch else "")]
    for p in points:
        where = f"{p['crossover']:.3g} ({p['status']})" if p["crossover"] else p["status"]
        method = p["method"] + (f", concurrency {p['concurrency']}" if "concurrency" in p else "")
        again = f" (and at {_listed(p['pays_again_at'])})" if p.get("pays_again_at") else ""
        pays = (" all tested |" if p["pays_up_to"] is None else f" {p['pays_up_to']}{again} |") if by_batch else ""
        lines.append(f"| {p['workload']} | {method} | {where} | {cell(p['best_speedup_tpot'])} |{pays}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="default: <first sweep dir>/crossover")
    args = parser.parse_args(argv)
    rows, skipped = load_rows(args.sweep_dirs)
    failed = [{"job": str(path), "error": (job_failure(path) or "no results.json").splitlines()[0]} for path in skipped]
    for job in failed:
        print(f"skipped {job['job']}: {job['error']}")
    if not rows:
        print(f"no finished jobs in {', '.join(map(str, args.sweep_dirs))}")
        return 1
    axis = axis_of(rows)
    floor = noise_floor(rows)
    points = crossovers(rows, axis, floor["tolerance"])
    out = args.out or args.sweep_dirs[0] / "crossover"
    out.mkdir(parents=True, exist_ok=True)
    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    (out / "crossover.json").write_text(json.dumps({"axis": axis, "noise_floor": floor, "crossovers": points,
                                                    "rows": clean, "failed_jobs": failed}, indent=2,
                                                   default=lambda v: None if isinstance(v, float) and np.isnan(v) else v))
    print(f"wrote {plot(rows, axis, out, floor['tolerance'])} and {out / 'crossover.json'}")
    print(markdown_table(rows, points))
    print(noise_floor_line(floor))
    if failed:
        print(f"{len(failed)} failed jobs are not in the table (crossover.json: failed_jobs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
