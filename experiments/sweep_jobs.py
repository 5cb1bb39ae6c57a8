"""A sweep's finished jobs, for the analysis scripts (spec_sweep.py, crossover.py): imported from the
scripts' own directory, so it works whether a script runs directly or is loaded by a Hydra callback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lab.sweep_callback import job_failure


def finished_jobs(sweep_dirs: list[Path]) -> tuple[list[dict[str, Any]], list[Path]]:
    """(results.json of every finished job, job dirs skipped because they failed or hold no results).

    NOTE: a job dir is wherever results.json or error.json sits: an override such as engine/proposer=ngram
    puts a "/" into Hydra's override_dirname, nesting the job one level deeper."""
    finished, skipped = [], []
    for sweep_dir in sweep_dirs:
        job_dirs = {p.parent for name in ("results.json", "error.json") for p in Path(sweep_dir).rglob(name)}
        for path in sorted(job_dirs):
            results = {} if job_failure(path) is not None else json.loads((path / "results.json").read_text())
            if not results or results.get("failed_job"):
                skipped.append(path)
            else:
                finished.append(results)
    return finished, skipped
