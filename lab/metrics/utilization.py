"""UtilizationSampler: CPU / GPU utilization of a run, polled from a separate process.

Owns: the polling process, the time series it records and its summary statistics. Every sample has `t_s`
(seconds since the sampler started), the parent process's `cpu_percent` (psutil; 100 = one core busy) and
`rss_mb`; on a CUDA device also NVML's `gpu_percent`, `gpu_mem_used_mb` (the whole device, every process)
and `gpu_power_w`. Ignores: what the measured process is doing.

    with UtilizationSampler(interval_s=0.1, device="cuda:0") as sampler:
        engine.run(requests)
    sampler.series      # [{"t_s": 0.1, "cpu_percent": 98.0, "rss_mb": 512.0, ...}, ...]
    sampler.summary()   # {"util/cpu_percent_mean": ..., "util/gpu_power_w_max": ..., ...}

NOTE: the poller is a fresh interpreter (`python -m lab.metrics.utilization`), i.e. what a spawn-context
multiprocessing child is, without its two costs here: a spawned child re-imports the parent's __main__
(lab.run: torch, transformers; seconds and ~250 MB per job) and inherits the parent's start method, which
fails inside joblib's loky workers (hydra/launcher=joblib). It never forks a process that holds CUDA.
It stops when its stdin closes (the parent stopped it or died) and then writes its samples as JSON lines.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil

if TYPE_CHECKING:
    import torch

STATS = {"mean": np.mean, "max": np.max, "p50": lambda x: np.percentile(x, 50), "p90": lambda x: np.percentile(x, 90)}
READY_TIMEOUT_S = 60.0


def nvml_target(device: str) -> int | str | None:
    """The NVML index (or UUID) of a torch device string; None for non-CUDA devices.

    NVML numbers GPUs physically, torch after CUDA_VISIBLE_DEVICES, so map through it.
    """
    if not device.startswith("cuda"):
        return None
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return index
    entry = visible[index]
    return int(entry) if entry.isdigit() else entry


def _nvml_handle(target: int | str) -> Any:
    import pynvml

    pynvml.nvmlInit()
    if isinstance(target, int):
        return pynvml.nvmlDeviceGetHandleByIndex(target)
    return pynvml.nvmlDeviceGetHandleByUUID(target)


def _gpu_sample(handle: Any) -> dict[str, float]:
    import pynvml

    out: dict[str, float] = {}
    readers = {"gpu_percent": lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
               "gpu_mem_used_mb": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20,
               "gpu_power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000}
    for key, read in readers.items():
        try:
            out[key] = read()
        except pynvml.NVMLError:
            pass  # NOTE: some boards (and MIG slices) do not report every counter
    return out


def poll(pid: int, target: int | str | None, interval_s: float) -> None:
    """The polling process: a "ready" line, then samples every interval_s until stdin closes, then them all."""
    process = psutil.Process(pid)
    process.cpu_percent(None)  # NOTE: the first reading only sets the baseline
    handle, warning = None, None
    if target is not None:
        try:
            handle = _nvml_handle(target)
        except Exception as exc:  # noqa: BLE001 - reported by the parent; CPU sampling goes on
            warning = f"NVML unavailable for GPU {target}: {type(exc).__name__}: {exc}"
    print(json.dumps({"ready": True, "warning": warning}), flush=True)
    samples: list[dict[str, float]] = []
    while True:
        # NOTE: buffered, not streamed: an unread pipe would block the poller after ~64 KB
        is_stopping = bool(select.select([sys.stdin], [], [], interval_s)[0])
        try:
            sample = {"time": time.perf_counter(), "cpu_percent": process.cpu_percent(None),
                      "rss_mb": process.memory_info().rss / 2**20}
        except psutil.NoSuchProcess:
            break
        if handle is not None:
            sample.update(_gpu_sample(handle))
        samples.append(sample)
        if is_stopping:
            break
    sys.stdout.write("".join(json.dumps(s) + "\n" for s in samples))
    sys.stdout.flush()


class UtilizationSampler:
    def __init__(self, interval_s: float = 0.1, device: str | torch.device = "cpu") -> None:
        self.interval_s = interval_s
        self.device = str(device)
        self.series: list[dict[str, float]] = []
        self.start_time: float | None = None  # perf_counter when sampling began (one clock with the engines')
        self._process: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int | None:
        """The polling process's pid while it runs."""
        return self._process.pid if self._process is not None else None

    def start(self) -> UtilizationSampler:
        lab_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [lab_root, os.environ.get("PYTHONPATH")]))}
        args = [sys.executable, "-m", "lab.metrics.utilization", str(os.getpid()), str(self.interval_s),
                json.dumps(nvml_target(self.device))]
        self._process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = select.select([self._process.stdout], [], [], READY_TIMEOUT_S)[0]
        line = self._process.stdout.readline() if ready else ""
        if not line:
            self._process.kill()
            self._process = None
            raise RuntimeError(f"utilization sampler process did not start within {READY_TIMEOUT_S:.0f} s")
        if warning := json.loads(line)["warning"]:
            print(f"warning: {warning}", file=sys.stderr)
        self.start_time = time.perf_counter()
        return self

    def stop(self) -> list[dict[str, float]]:
        """Stop the polling process; returns the samples (also kept in `self.series`)."""
        if self._process is None:
            return self.series
        process, self._process = self._process, None
        try:
            out, _ = process.communicate(timeout=max(10.0, 20 * self.interval_s))  # closes its stdin: stop
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
        raw = [json.loads(line) for line in out.splitlines() if line.strip()]
        self.series = [{"t_s": s.pop("time") - self.start_time, **s} for s in raw]
        return self.series

    def __enter__(self) -> UtilizationSampler:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def summary(self, prefix: str = "util/") -> dict[str, float]:
        """mean / max / p50 / p90 of every sampled quantity, e.g. `util/gpu_power_w_mean`."""
        out: dict[str, float] = {f"{prefix}num_samples": len(self.series)}
        keys = dict.fromkeys(k for s in self.series for k in s if k != "t_s")
        for key in keys:
            values = np.asarray([s[key] for s in self.series if key in s], dtype=np.float64)
            out.update({f"{prefix}{key}_{name}": float(fn(values)) for name, fn in STATS.items()})
        return out

    def write_series(self, path: Path) -> Path:
        """The samples as JSONL, one dict per line."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for sample in self.series:
                f.write(json.dumps(sample) + "\n")
        return path


if __name__ == "__main__":
    poll(int(sys.argv[1]), json.loads(sys.argv[3]), float(sys.argv[2]))
