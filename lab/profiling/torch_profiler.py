"""TorchProfiler (profiler=torch): torch.profiler over a window of engine steps (wait / warmup / active),
CPU activity plus CUDA on a GPU. Writes to the run dir: a Chrome/Perfetto trace, op tables (by self CPU
time, by device time, by memory), a memory timeline plot, and profile_summary.json; prints a summary.
NullProfiler (profiler=none) has the same methods and does nothing.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from lab.profiling.analysis import format_summary, summarize_profile
from lab.profiling.ranges import set_ranges_enabled


class NullProfiler:
    def __init__(self, **_: Any) -> None:
        self.outputs: dict[str, Path] = {}
        self.summary: dict[str, Any] | None = None

    def start(self, run_dir: Path, device: torch.device) -> None:
        pass

    def step(self) -> None:
        pass

    def stop(self) -> dict[str, Any] | None:
        return None


class TorchProfiler(NullProfiler):
    def __init__(self, wait: int = 1, warmup: int = 1, active: int = 8, repeat: int = 1, record_shapes: bool = True,
                 profile_memory: bool = True, with_stack: bool = True, row_limit: int = 25,
                 memory_timeline: bool = True) -> None:
        super().__init__()
        self.schedule = schedule(wait=wait, warmup=warmup, active=active, repeat=repeat)
        self.options = dict(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack)
        self.row_limit = row_limit
        self.memory_timeline = memory_timeline
        self._prof: Any = None
        self._run_dir = Path(".")
        self._device = torch.device("cpu")
        self._traces = 0

    def start(self, run_dir: Path, device: torch.device) -> None:
        self._run_dir, self._device = run_dir, device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof = profile(activities=activities, schedule=self.schedule, on_trace_ready=self._on_trace_ready,
                             **self.options)
        set_ranges_enabled(True)
        self._prof.__enter__()

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def _on_trace_ready(self, prof: Any) -> None:
        self._run_dir.mkdir(parents=True, exist_ok=True)
        suffix = f"_{self._traces}" if self._traces else ""
        trace = self._run_dir / f"trace{suffix}.json"
        prof.export_chrome_trace(str(trace))
        self.outputs[f"trace{suffix}"] = trace
        self._write_tables(prof, suffix)
        self.summary = summarize_profile(prof, self.row_limit)
        summary_path = self._run_dir / f"profile_summary{suffix}.json"
        summary_path.write_text(json.dumps(self.summary, indent=2, default=str))
        self.outputs[f"profile_summary{suffix}"] = summary_path
        if self.memory_timeline and self.options["profile_memory"] and self.options["with_stack"]:
            self._export_memory_timeline(prof, suffix)
        self._traces += 1

    def _write_tables(self, prof: Any, suffix: str) -> None:
        averages = prof.key_averages()
        sorts = {"self_cpu": "self_cpu_time_total", "cpu_memory": "self_cpu_memory_usage"}
        if self._device.type == "cuda":
            sorts.update(device="self_device_time_total", device_memory="self_device_memory_usage")
        for name, key in sorts.items():
            path = self._run_dir / f"ops_by_{name}{suffix}.txt"
            path.write_text(averages.table(sort_by=key, row_limit=self.row_limit))
            self.outputs[f"ops_by_{name}{suffix}"] = path
        if self._device.type == "cuda":
            kernels = self._run_dir / f"kernels{suffix}.txt"
            kernels.write_text(prof.key_averages(group_by_input_shape=False).table(
                sort_by="self_device_time_total", row_limit=self.row_limit, top_level_events_only=False))
            self.outputs[f"kernels{suffix}"] = kernels

    def _export_memory_timeline(self, prof: Any, suffix: str) -> None:
        """NOTE: the timeline needs record_shapes + profile_memory + with_stack; a failure here is reported,
        not raised, so a profiling run never loses its other outputs."""
        path = self._run_dir / f"memory_timeline{suffix}.html"
        device = "cuda:0" if self._device.type == "cuda" else "cpu"
        try:
            with warnings.catch_warnings():
                # NOTE: torch 2.13 deprecates the timeline in favour of torch.cuda.memory's snapshots, which record
                # CUDA allocations only; on CPU the timeline is still the one view of memory over a step.
                warnings.filterwarnings("ignore", message=".*export_memory_timeline.*", category=FutureWarning)
                prof.export_memory_timeline(str(path), device=device)
            self.outputs[f"memory_timeline{suffix}"] = path
        except Exception as exc:  # noqa: BLE001
            (self._run_dir / f"memory_timeline{suffix}.error.txt").write_text(f"{type(exc).__name__}: {exc}")

    def stop(self) -> dict[str, Any] | None:
        if self._prof is None:
            return None
        self._prof.__exit__(None, None, None)
        self._prof = None
        set_ranges_enabled(False)
        if self.summary is not None:
            print(format_summary(self.summary))
            print(f"profile: {self._run_dir} ({', '.join(p.name for p in self.outputs.values())})")
        return self.summary
