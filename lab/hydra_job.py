"""How a Hydra job and a console script end: what a failed job leaves in its dir, and the exit codes, the same for
`lab`, `lab-serve`, `lab-bench-serve` and `lab-train`:

    0  done (a sweep: every job finished)
    1  a sweep finished, but some of its jobs failed (each left error.json; the others' results stand)
    2  bad input: one message naming the problem and the fix, including the config errors Hydra reports
       itself (an unknown config name, a malformed override), which Hydra alone would exit with 1
  130  interrupted (Ctrl-C)

Owns: job outputs on failure, mapping errors to exit codes. Ignores: what the jobs run.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, InstantiationException, OverrideParseException
from hydra.types import RunMode

from lab.errors import LabError
from lab.sweep_callback import SWEEP_FAILURES

EXIT_SWEEP_JOBS_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
# NOTE: what Hydra raises while composing the config from the command line (MissingConfigException included)
HYDRA_BAD_INPUT = (ConfigCompositionException, OverrideParseException)
JOB_OUTPUTS = ("results.json", "error.json", "requests.jsonl", "utilization.jsonl")
log = logging.getLogger("lab")   # NOTE: to the console (warnings, errors) and to the job's run.log (everything)


def unwrap(exc: BaseException) -> BaseException:
    """Hydra wraps constructor errors in InstantiationException; surface the user's LabError."""
    while isinstance(exc, InstantiationException) and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def exit_on_lab_error(raw: BaseException) -> NoReturn:
    """For the console scripts' mains: a LabError (possibly wrapped by Hydra) becomes one message on
    stderr and exit code 2; anything else is a bug and propagates with its traceback."""
    exc = unwrap(raw)
    if not isinstance(exc, LabError):
        raise raw
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def clear_job_outputs(run_dir: Path) -> None:
    """A job dir reused (the same hydra.sweep.dir run again) must not mix an earlier run's results or error.json
    with this one's: the analysis would skip a job that now succeeds, or read numbers it did not produce."""
    for name in JOB_OUTPUTS:
        (run_dir / name).unlink(missing_ok=True)


def record_failure(run_dir: Path, message: str, exc: BaseException) -> None:
    """A failed job still leaves a results.json (completed 0, the error) and error.json with the traceback."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "error.json").write_text(json.dumps(
        {"error": message, "traceback": traceback.format_exception(exc)}, indent=2))
    if not (run_dir / "results.json").exists():
        (run_dir / "results.json").write_text(json.dumps({"failed_job": True, "error": message, "completed": 0},
                                                         indent=2))


def run_job(body: Callable[[Path], Mapping[str, Any]], objective: str = "output_throughput") -> float | None:
    """The body of a `@hydra.main` that measures: body(run dir) -> results; returns results[objective] (what a
    Hydra sweeper optimizes). A single run exits 2 with one message on failure; in a multirun a failing job
    records its error (error.json) and returns None, and the sweep goes on (FailedJobsCallback lists it at the
    end). Ctrl-C leaves error.json and exits 130 either way."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    clear_job_outputs(run_dir)
    try:
        value = body(run_dir)[objective]
        return None if value is None else float(value)
    except KeyboardInterrupt as exc:
        record_failure(run_dir, "interrupted (SIGINT) before the run finished", exc)
        log.error(f"interrupted: nothing measured was kept; see {run_dir / 'error.json'}")
        sys.exit(EXIT_INTERRUPTED)
    except Exception as raw:  # noqa: BLE001 - turned into one message (run) or a recorded failure (sweep)
        exc = unwrap(raw)
        message = str(exc) if isinstance(exc, LabError) else f"{type(exc).__name__}: {exc}"
        record_failure(run_dir, message, exc)
        log.error(f"error: {message}")
        # NOTE: info: the traceback goes to run.log; the console shows it only for a bug in a single run (below)
        log.info("".join(["the error's traceback:\n", *traceback.format_exception(exc)]).rstrip())
        if hydra_cfg.mode == RunMode.MULTIRUN:
            return None  # NOTE: one failing job must not sink the sweep
        if not isinstance(exc, LabError):
            traceback.print_exception(exc)
        sys.exit(EXIT_BAD_INPUT)


def console_script(hydra_main: Callable[[], Any]) -> Callable[[], None]:
    """A `@hydra.main` function as a console script with the exit codes above."""

    def script() -> None:
        try:
            hydra_main()
        except SystemExit as exit_:
            # NOTE: Hydra prints its own message, then sys.exit(1) inside its `except`: the error is the context
            if exit_.code == 1 and isinstance(exit_.__context__, HYDRA_BAD_INPUT):
                sys.exit(EXIT_BAD_INPUT)
            raise
        if SWEEP_FAILURES:
            sys.exit(EXIT_SWEEP_JOBS_FAILED)

    script.__doc__ = hydra_main.__doc__
    return script
