"""NullLogger: the experiment-logger interface, doing nothing (logger=none).

Every logger is built by `instantiate(cfg.logger)`, then `start(...)` once per job, then any number of
`log_*` calls, then `finish(exit_code)` in a `finally`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class NullLogger:
    def __init__(self, **_: Any) -> None:
        pass

    def start(self, run_dir: Path, name: str, group: str, config: dict[str, Any]) -> None:
        """One job = one run: `group` is the sweep name, `name` the override string."""

    def log_summary(self, metrics: dict[str, Any]) -> None:
        """Scalar results (results.json's numeric fields)."""

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        """A table, e.g. one row per request."""

    def log_series(self, name: str, rows: list[dict[str, Any]], step_key: str) -> None:
        """A time series (rows keyed by `step_key`, e.g. utilization samples over `t_s`)."""

    def log_artifact(self, path: Path, name: str, kind: str) -> None:
        """A file (trace, plot) attached to the run."""

    def finish(self, exit_code: int = 0) -> None:
        """Always called, in a `finally`."""
