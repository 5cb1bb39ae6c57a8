"""PlotsCallback: a Hydra callback that draws a sweep's plots (experiments/plots.py) when a multirun ends;
AnalysisCallback runs an experiment's own analysis script (its `main([sweep_dir])`) the same way;
FailedJobsCallback lists the jobs that failed, last, and leaves them in SWEEP_FAILURES for the exit code.

    hydra:
      callbacks:
        plots:
          _target_: lab.sweep_callback.PlotsCallback

Owns: finding the sweep dir and the plotting script, and reporting where the plots went. Ignores: what is
plotted. Imports hydra for the Callback base class (as do lab/run.py and lab/hydra_job.py).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

import lab

SCRIPT = Path("experiments") / "plots.py"
# NOTE: (job dir, error) of the last multirun's failed jobs; lab.hydra_job turns a non-empty list into exit code 1
SWEEP_FAILURES: list[tuple[Path, str]] = []


def load_plots_module(script: str | Path | None = None, module_name: str = "lab_sweep_plots") -> ModuleType:
    """experiments/plots.py (or `script`) as a module: next to the lab package, else under the cwd."""
    # NOTE: experiments/ is not an installed package, so it is loaded from its file.
    relative = Path(script) if script else SCRIPT
    candidates = [relative] if relative.is_absolute() else [Path(lab.__file__).resolve().parents[1] / relative,
                                                             Path.cwd() / relative]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no analysis script at {', '.join(map(str, candidates))}")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up in sys.modules
    spec.loader.exec_module(module)
    return module


class PlotsCallback(Callback):
    def __init__(self, out_dir: str | None = None, script: str | None = None) -> None:
        self.out_dir = out_dir
        self.script = script

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            plots = load_plots_module(self.script)
            result = plots.plot_sweep(sweep_dir, Path(self.out_dir) if self.out_dir else None)
        except Exception as exc:  # noqa: BLE001 - the sweep's results are already on disk
            print(f"warning: sweep plots for {sweep_dir} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return
        print(plots.report(result))


class AnalysisCallback(Callback):
    """Runs `script`'s main([sweep_dir]) after the multirun; a failure is reported, never raised."""

    def __init__(self, script: str) -> None:
        self.script = script

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            load_plots_module(self.script, f"lab_analysis_{Path(self.script).stem}").main([str(sweep_dir)])
        except Exception as exc:  # noqa: BLE001 - the sweep's results are already on disk
            print(f"warning: analysis {self.script} of {sweep_dir} failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def job_failure(job_dir: Path) -> str | None:
    """Why a job failed (its error.json's message), or None when it finished."""
    error_file, results_file = job_dir / "error.json", job_dir / "results.json"
    if error_file.is_file():
        try:
            return str(json.loads(error_file.read_text()).get("error", "see error.json"))
        except (OSError, ValueError, AttributeError):
            return "see error.json"
    return None if results_file.is_file() else "no results.json: the job did not finish"


def sweep_failures(sweep_dir: Path) -> tuple[int, list[tuple[Path, str]]]:
    """(number of jobs, (job dir, error) of each failed one). A job dir is wherever Hydra wrote `.hydra/`."""
    job_dirs = sorted({p.parent for p in Path(sweep_dir).rglob(".hydra")} - {Path(sweep_dir)})
    failures = [(job_dir, error) for job_dir in job_dirs if (error := job_failure(job_dir)) is not None]
    return len(job_dirs), failures


class FailedJobsCallback(Callback):
    """After the multirun (and, registered first, after every other callback): one line per failed job on stderr.
    A failing job does not stop the sweep; this makes sure it is not missed either."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        SWEEP_FAILURES.clear()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        num_jobs, failures = sweep_failures(Path(str(config.hydra.sweep.dir)))
        SWEEP_FAILURES[:] = failures
        if failures:
            lines = [f"{len(failures)} of {num_jobs} jobs failed (exit code 1; the other jobs' results stand):"]
            lines += [f"  {job_dir}: {error.splitlines()[0]}" for job_dir, error in failures]
            print("\n".join(lines), file=sys.stderr)
