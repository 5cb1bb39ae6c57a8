"""WandbLogger: one job = one W&B run (logger=wandb), offline by default so no account is needed.

Owns: the W&B run's lifetime (init in `start`, finish in `finish`), and turning summaries, tables,
series and files into W&B summary fields, Tables, step-keyed metrics and Artifacts.
Ignores: what the numbers mean and where they came from.

Offline runs land in `<dir>/wandb/offline-run-*` (dir defaults to the job's run dir) and can be uploaded
later with `wandb sync <that dir>`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import wandb

from lab.errors import LabError

MODES = ("offline", "online", "disabled")


def _cell(value: Any) -> Any:
    """Table cells stay scalars; lists and dicts (ITL lists, token ids) become JSON text."""
    return json.dumps(value) if isinstance(value, (list, tuple, dict)) else value


def _artifact_name(name: str) -> str:
    # NOTE: artifact names allow only letters, digits, '-', '_' and '.'; override strings carry '=' and ','.
    return re.sub(r"[^\w.-]+", "-", name).strip("-") or "artifact"


class WandbLogger:
    def __init__(self, project: str = "lab", entity: str | None = None, mode: str = "offline",
                 tags: Sequence[str] = (), dir: str | None = None, system_stats: bool = False,
                 console: str = "off", **_: Any) -> None:
        if mode not in MODES:
            raise LabError(f"logger.mode={mode!r} is not a W&B mode", f"use one of: {', '.join(MODES)}")
        self.project = project
        self.entity = entity
        self.mode = mode
        self.tags = list(tags)
        self.dir = dir
        self.system_stats = system_stats
        self.console = console
        self._run: Any = None
        self._series_defined: set[str] = set()

    @property
    def run_path(self) -> Path | None:
        """The local W&B run directory (offline-run-* or run-*), once started."""
        return Path(self._run.dir).parent if self._run is not None else None

    def start(self, run_dir: Path, name: str, group: str, config: dict[str, Any]) -> None:
        target = Path(self.dir) if self.dir else Path(run_dir)
        target.mkdir(parents=True, exist_ok=True)
        # NOTE: wandb's own system-stats sampler is off by default: UtilizationSampler measures the same
        # things at a known rate, and a second sampler competes for the cores being measured.
        settings = wandb.Settings(silent=True, console=self.console, x_disable_stats=not self.system_stats)
        self._run = wandb.init(project=self.project, entity=self.entity, mode=self.mode, dir=str(target),
                               group=group or None, name=name or None, config=config, tags=self.tags or None,
                               reinit="finish_previous", settings=settings)
        self._series_defined.clear()

    def _require_run(self) -> Any:
        if self._run is None:
            raise RuntimeError("WandbLogger: call start(run_dir, name, group, config) before logging")
        return self._run

    def log_summary(self, metrics: dict[str, Any]) -> None:
        self._require_run().summary.update(metrics)

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        run = self._require_run()
        columns: list[str] = list(dict.fromkeys(key for row in rows for key in row))
        data = [[_cell(row.get(column)) for column in columns] for row in rows]
        run.log({name: wandb.Table(columns=columns, data=data, allow_mixed_types=True)})

    def log_series(self, name: str, rows: list[dict[str, Any]], step_key: str) -> None:
        run = self._require_run()
        step_metric = f"{name}/{step_key}"
        if name not in self._series_defined:
            run.define_metric(step_metric)
            run.define_metric(f"{name}/*", step_metric=step_metric)
            self._series_defined.add(name)
        for row in rows:
            run.log({f"{name}/{key}": value for key, value in row.items()})

    def log_artifact(self, path: Path, name: str, kind: str) -> None:
        run = self._require_run()
        path = Path(path)
        artifact = wandb.Artifact(_artifact_name(name), type=kind)
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        run.log_artifact(artifact)

    def finish(self, exit_code: int = 0) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        try:
            run.finish(exit_code=exit_code)
        except Exception as exc:  # noqa: BLE001
            # NOTE: finish runs in the job's `finally`; raising here would hide the job's own error.
            print(f"warning: wandb finish failed: {type(exc).__name__}: {exc}", file=sys.stderr)
