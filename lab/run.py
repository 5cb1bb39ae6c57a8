"""`lab` / `python -m lab.run`: compose model + engine + workload + logger with Hydra, run, write results.

The only module that touches DictConfig. Single runs exit with code 2 and one clear message on bad input;
in a multirun sweep a failing job records `error.json` in its run dir and the sweep goes on.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lab.errors import LabError
from lab.metrics import summarize
from lab.metrics.report import format_table, request_record, write_results
from lab.runner import ModelRunner
from lab.runner.device import cuda_memory_mb, peak_rss_mb
from lab.workloads import SamplingDefaults


def _unwrap(exc: BaseException) -> BaseException:
    """Hydra wraps constructor errors in InstantiationException; surface the user's LabError."""
    while isinstance(exc, InstantiationException) and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def build_runner(cfg: DictConfig) -> ModelRunner:
    source = instantiate(cfg.model.source)
    return ModelRunner(source, dtype=cfg.model.dtype, device=cfg.model.device, max_model_len=cfg.model.max_model_len)


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    logger = instantiate(cfg.logger)
    exit_code = 1
    try:
        load_start = time.perf_counter()
        runner = build_runner(cfg)
        load_s = time.perf_counter() - load_start
        engine = instantiate(cfg.engine, runner=runner, seed=cfg.seed)
        workload = instantiate(cfg.workload)
        sampling = SamplingDefaults(**OmegaConf.to_container(cfg.sampling, resolve=True))
        requests = workload.build(runner.tokenizer, runner.vocab_size, sampling)
        outcome = engine.run(requests)
        results: dict[str, Any] = {"engine": engine.name, "model_id": runner.model_id, "workload": workload.name,
                                   **summarize(outcome.requests, outcome.duration),
                                   "model_load_s": load_s, "peak_memory_mb": peak_rss_mb(),
                                   **cuda_memory_mb(runner.device),
                                   "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
                                   "num_threads": torch.get_num_threads(),
                                   "config": OmegaConf.to_container(cfg, resolve=True)}
        write_results(run_dir, results, outcome.requests, runner.tokenizer)
        logger.log_summary({k: v for k, v in results.items() if isinstance(v, (int, float))})
        logger.log_table("requests", [request_record(r, None) for r in outcome.requests])
        if cfg.print_table:
            print(format_table(results))
            print(f"results: {run_dir / 'results.json'}")
        exit_code = 0
        return results
    finally:
        logger.finish(exit_code)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    is_multirun = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        return float(run(cfg, run_dir)["output_throughput"])
    except Exception as raw:  # noqa: BLE001 - turned into one message (run) or error.json (sweep)
        exc = _unwrap(raw)
        message = str(exc) if isinstance(exc, LabError) else f"{type(exc).__name__}: {exc}"
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "error.json").write_text(json.dumps(
            {"error": message, "traceback": traceback.format_exception(exc)}, indent=2))
        print(f"error: {message}", file=sys.stderr)
        if is_multirun:
            return None  # NOTE: one failing job must not sink the sweep
        if not isinstance(exc, LabError):
            traceback.print_exception(exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
