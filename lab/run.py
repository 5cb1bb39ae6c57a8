"""`lab` / `python -m lab.run`: compose model + engine + workload + metrics + logger with Hydra, run, write
results. The only module that touches DictConfig.

Single runs exit with code 2 and one clear message on bad input; in a multirun sweep a failing job
records the failure in its results.json / error.json, the sweep goes on, and `lab -m` exits 1 at the end
(lab/hydra_job.py).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import lab.resolvers  # noqa: F401 - registers ${max:...} before Hydra composes
from lab import huge_pages
from lab.config_check import check_call, check_group, check_target_config, check_value, checked_kwargs
from lab.engines.base import Engine, RunResult
from lab.engines.interleave import arrive_at_once, run_interleaved
from lab.metrics.summary import check_slo, summarize
from lab.errors import LabError
from lab.hydra_job import console_script, run_job
from lab.metrics.report import format_table, request_record, write_results
from lab.request import Request
from lab.runner import ModelRunner
from lab.runner.shared import shared_runner
from lab.runner.device import cuda_memory_mb, peak_rss_mb
from lab.workloads import SamplingDefaults
from lab.workloads.arrivals import ArrivalProcess

log = logging.getLogger("lab.run")   # NOTE: the job's record in run.log (conf/hydra/job_logging/lab.yaml)
ARRIVAL_KEYS = ("request_rate", "burstiness", "max_concurrency", "num_warmups")


# NOTE: the groups `run` builds with hydra's instantiate, and what it passes them besides their settings
RUN_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("logger", ()), ("engine", ("runner", "seed")), ("metrics", ()), ("profiler", ()))
TOP_LEVEL_SETTINGS = {"seed": int, "threads": int | None}   # of the configs that have them (run, serve, train)
LAB_TOP_LEVEL = frozenset({"model", "engine", "workload", "metrics", "profiler", "logger", "sampling", "seed",
                           "threads", "print_table", "hydra"})
OTHER_SCRIPTS = {"bench_serve.yaml": "lab-bench-serve", "serve.yaml": "lab-serve", "train.yaml": "lab-train"}
INTERPOLATED_NAME = re.compile(r"\$\{(?:oc\.select:)?([A-Za-z_]\w*)")   # ${concurrency}, ${oc.select:concurrency,4}


def check_run_config(cfg: DictConfig) -> None:
    """Every group `run` builds, against what it builds (lab/config_check.py), before anything is built: a typo in
    the workload fails in a second, not after the model has loaded."""
    check_top_level_keys(cfg)
    check_model_config(cfg)
    for path, supplied in RUN_GROUPS:
        check_group(cfg, path, supplied)
    check_slo(OmegaConf.to_container(cfg.metrics, resolve=True).get("slo"))
    split_workload(cfg)
    checked_kwargs(SamplingDefaults, cfg.sampling, "sampling")


def check_top_level_keys(cfg: DictConfig) -> None:
    """A top-level key is one of `lab`'s settings or a variable some config interpolates (an experiment's
    `concurrency`, read by the groups it sweeps); any other does nothing, so it is a mistake: `+seeed=1`, a setting
    of another script, or an experiment of another script (`+experiment=serving` is experiments/serving.py's)."""
    texts = [repr(OmegaConf.to_container(cfg, resolve=False))]
    texts += [path.read_text() for path in Path(CONF_DIR).rglob("*.yaml")]
    interpolated = {name for text in texts for name in INTERPOLATED_NAME.findall(text)}
    unknown = [key for key in cfg if key not in LAB_TOP_LEVEL and key not in interpolated]
    if not unknown:
        return
    fixes = []
    if "serving" in unknown:   # NOTE: +experiment=serving or serving_spec; its other keys are lab-bench-serve's
        fixes.append("the serving experiments run with `python experiments/serving.py +experiment=NAME`")
    else:
        for file_name, script in OTHER_SCRIPTS.items():
            if theirs := [key for key in unknown if key in OmegaConf.load(Path(CONF_DIR) / file_name)]:
                what = "settings" if len(theirs) > 1 else "a setting"
                fixes.append(f"{', '.join(theirs)}: {what} of `{script}` (conf/{file_name}), not of `lab`")
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(LAB_TOP_LEVEL - {"hydra"}), n=1)
        if close:
            fixes.append(f"did you mean {close[0]}?")
    raise LabError(f"unknown top-level setting{'s' if len(unknown) > 1 else ''} for `lab`: {', '.join(unknown)}",
                   "; ".join(fixes) or "remove it, or set it inside its group (e.g. workload.<key>)")


def check_model_config(cfg: DictConfig) -> None:
    """The top-level seed and threads, model.source against what it builds and the model group's other settings
    against ModelRunner (lab, lab-serve and lab-train all load the model this way)."""
    for key, annotation in TOP_LEVEL_SETTINGS.items():
        if key in cfg:
            check_value(annotation, cfg[key], key)
    if cfg.get("threads") is not None and cfg.threads < 1:
        raise LabError(f"threads must be >= 1 or null, got {cfg.threads}", "use null for torch's default")
    check_group(cfg, "model.source")
    settings = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k not in ("name", "source")}
    check_call(ModelRunner, settings, "model", ("source",))


def split_workload(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the workload's own settings, its arrival settings: ARRIVAL_KEYS), each checked against what it builds."""
    spec: dict[str, Any] = OmegaConf.to_container(cfg.workload, resolve=True)
    arrival_cfg = {k: spec.pop(k) for k in ARRIVAL_KEYS if k in spec}
    check_target_config(spec, "workload")
    num_warmups = arrival_cfg.get("num_warmups")
    if num_warmups is not None and (not isinstance(num_warmups, int) or isinstance(num_warmups, bool)
                                    or num_warmups < 0):
        raise LabError(f"workload.num_warmups must be an integer >= 0 or null, got {num_warmups!r}",
                       "set workload.num_warmups to 0 (none) or more")
    arrival = {k: v for k, v in arrival_cfg.items() if k != "num_warmups"}
    check_call(ArrivalProcess, arrival, "workload", ("seed",))
    ArrivalProcess(**arrival)   # NOTE: its ranges (rate > 0, ...), checked before the model loads
    return spec, arrival_cfg


def build_runner(cfg: DictConfig) -> ModelRunner:
    source = instantiate(cfg.model.source)
    return ModelRunner(source, dtype=cfg.model.dtype, device=cfg.model.device, max_model_len=cfg.model.max_model_len,
                       weight_blocks=cfg.model.get("weight_blocks", "auto"),
                       block_rows=cfg.model.get("block_rows", "auto"),
                       block_kernel=cfg.model.get("block_kernel", "auto"),
                       huge_pages=cfg.model.get("huge_pages", "auto"),
                       greedy_head=cfg.model.get("greedy_head", "auto"))


def runner_key(cfg: DictConfig) -> str:
    """What a runner is built from: the model's config, the seed (random-init models) and the thread count (the
    kernels' measured choices). Jobs with the same key may share one (lab/runner/shared.py)."""
    return json.dumps([OmegaConf.to_container(cfg.model, resolve=True), cfg.seed, cfg.get("threads")],
                      sort_keys=True, default=str)


def build_requests(cfg: DictConfig, runner: ModelRunner) -> tuple[list[Request], list[Request], ArrivalProcess, str]:
    """(measured requests with arrival offsets, warm-up requests, arrival process, workload name)."""
    spec, arrival_cfg = split_workload(cfg)
    num_warmups = int(arrival_cfg.pop("num_warmups", 0) or 0)
    arrival = ArrivalProcess(request_rate=float(arrival_cfg.get("request_rate", math.inf)),
                             burstiness=float(arrival_cfg.get("burstiness", 1.0)),
                             max_concurrency=arrival_cfg.get("max_concurrency"), seed=int(cfg.seed))
    workload = instantiate(spec)
    sampling = SamplingDefaults(**checked_kwargs(SamplingDefaults, cfg.sampling, "sampling"))
    requests = arrival.assign(workload.build(runner.tokenizer, runner.vocab_size, sampling))
    warmups = []
    for i in range(num_warmups):
        warmup = copy.deepcopy(requests[i % len(requests)])
        warmup.request_id, warmup.arrival_time = f"warmup-{i}", 0.0
        warmups.append(warmup)
    return requests, warmups, arrival, workload.name


def run_measured(engine: Engine, requests: list[Request], max_concurrency: int | None
                 ) -> tuple[RunResult | None, RunResult]:
    """(baseline, outcome). For engines asked to `measure_speedup`, the same requests also go through the
    engine's baseline (its `baseline_engine`: by default itself with speculation off) in the same process, so
    ratios are not across noisy runs. How the two take turns is `speedup_turns`:

    - `steps`: step by step, each timed on its own clock (lab/engines/interleave.py): whatever slows the machine
      slows both alike. Every request must arrive at once.
    - `chunks`: with `speedup_rounds` = N > 1 the requests are cut into N consecutive chunks and the two engines take
      turns chunk by chunk in ABBA order (baseline first on even chunks, speculation first on odd ones): a machine
      whose speed drifts during the run then slows both sides alike at the scale of a chunk. No chunk holds fewer
      than `max_concurrency` requests (fewer rounds where needed), so the turns measure the batch size asked for.
    - `auto`: steps where every request arrives at once, else chunks."""
    if not getattr(engine, "measure_speedup", False):
        return None, engine.run(requests, max_concurrency=max_concurrency)
    baseline_engine = engine.baseline_engine(max_concurrency)
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    if speedup_turns(engine, requests) == "steps":
        baseline, outcome = run_interleaved([baseline_engine, engine], [copy.deepcopy(ordered), ordered],
                                            max_concurrency)
        return baseline, outcome
    # NOTE: a chunk smaller than max_concurrency would shrink the batch being measured
    most_rounds = len(ordered) // max_concurrency if max_concurrency else len(ordered)
    rounds = max(1, min(int(getattr(engine, "speedup_rounds", 1)), most_rounds))
    bounds = [len(ordered) * i // rounds for i in range(rounds + 1)]
    parts: dict[str, list[RunResult]] = {"baseline": [], "outcome": []}
    for i in range(rounds):
        chunk = ordered[bounds[i]:bounds[i + 1]]
        if rounds > 1:
            first = chunk[0].arrival_time
            for request in chunk:
                request.arrival_time -= first   # NOTE: each chunk starts at its own t = 0
        pair = [("baseline", baseline_engine, copy.deepcopy(chunk)), ("outcome", engine, chunk)]
        for kind, turn_engine, chunk_requests in (pair if i % 2 == 0 else pair[::-1]):
            parts[kind].append(turn_engine.run(chunk_requests, max_concurrency=max_concurrency))
    return _merged(parts["baseline"]), _merged(parts["outcome"])


def speedup_turns(engine: Engine, requests: list[Request]) -> str:
    """How run_measured has `engine` and its baseline take turns over `requests`: 'steps' or 'chunks' (`auto`: steps
    where every request arrives at once)."""
    turns = getattr(engine, "speedup_turns", "chunks")
    if turns != "auto":
        return turns
    return "steps" if arrive_at_once(requests) else "chunks"


def _merged(parts: list[RunResult]) -> RunResult:
    """Chunks run one after another as one result: their requests, their summed durations."""
    return RunResult([r for part in parts for r in part.requests], parts[0].start_time,
                     sum(part.duration for part in parts))


def speedup_fields(baseline: RunResult | None, outcome: RunResult, baseline_name: str = "engine",
                   turns: str | None = None) -> dict[str, Any]:
    """spec/speedup_* = baseline / outcome (TPOT, end to end); `baseline_name` says what the baseline was, `turns` how
    the two took turns (speedup_turns)."""
    if baseline is None:
        return {}
    base, ours = summarize(baseline.requests, baseline.duration), summarize(outcome.requests, outcome.duration)
    same = [a.output_token_ids for a in baseline.requests] == [b.output_token_ids for b in outcome.requests]
    return {"baseline/mean_tpot_ms": base["mean_tpot_ms"], "baseline/duration": base["duration"],
            "baseline/output_throughput": base["output_throughput"],
            "spec/speedup_tpot": base["mean_tpot_ms"] / max(ours["mean_tpot_ms"], 1e-9),
            "spec/speedup_e2e": base["duration"] / max(ours["duration"], 1e-9),
            "spec/same_output_as_baseline": same, "spec/speedup_baseline": baseline_name,
            **({"spec/speedup_turns": turns} if turns else {})}


def profile_fields(profile: dict[str, Any] | None) -> dict[str, Any]:
    """The profile's headline numbers for results.json (the full summary is profile_summary.json)."""
    if profile is None:
        return {}
    fields: dict[str, Any] = {"profile/host_syncs": profile["syncs"]["total"],
                              **{f"profile/{k}": v for k, v in profile["totals"].items()}}
    fields.update({f"profile/range_{k}_ms": v["total_ms"] for k, v in profile["ranges"].items()})
    if profile["device_idle"]:
        fields["profile/device_idle_share"] = profile["device_idle"]["idle_share"]
    return fields


def _hydra_names() -> tuple[str, str]:
    """(run name = the override string, group = the sweep's directory name) for the experiment logger."""
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not under @hydra.main (tests call run() directly)
        return "run", "single"
    name = hydra_cfg.job.override_dirname or hydra_cfg.job.name
    sweep_dir = Path(hydra_cfg.sweep.dir)
    group = f"{sweep_dir.parent.name}_{sweep_dir.name}" if hydra_cfg.mode == RunMode.MULTIRUN else "single"
    return name, group


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    check_run_config(cfg)
    torch.manual_seed(cfg.seed)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    logger = instantiate(cfg.logger)
    name, group = _hydra_names()
    resolved = OmegaConf.to_container(cfg, resolve=True)
    logger.start(run_dir=run_dir, name=name, group=group, config=resolved)
    exit_code = 1
    try:
        load_start = time.perf_counter()
        in_sweep = group != "single"   # NOTE: a multirun's job (_hydra_names names any other run's group "single")
        runner, reused = (shared_runner(runner_key(cfg), lambda: build_runner(cfg)) if in_sweep
                          else (build_runner(cfg), False))
        engine: Engine = instantiate(cfg.engine, runner=runner, seed=cfg.seed)
        # NOTE: engines build what they need (HF models, KV pools, drafts) here, so it counts as load
        load = {"phase/load_s": time.perf_counter() - load_start, "phase/model_reused": reused,
                "memory/load_peak_mb": peak_rss_mb(),
                **{f"memory/load_{k}": v for k, v in cuda_memory_mb(runner.device).items()}}
        log.info(f"loaded {runner.model_id} ({runner.device}, {runner.dtype}) and engine {engine.name} in "
                 f"{load['phase/load_s']:.1f} s" + (" (the model: the sweep's job before's, reused)" if reused else ""))
        metrics = instantiate(cfg.metrics)
        requests, warmups, arrival, workload_name = build_requests(cfg, runner)
        log.info(f"workload {workload_name}: {len(requests)} requests ({len(warmups)} warm-ups), request_rate "
                 f"{arrival.request_rate}, max_concurrency {arrival.max_concurrency}")
        if warmups:
            engine.run(warmups)
            engine.reset_caches()   # NOTE: a warm-up copies a measured request: its cached prefix would serve it
            engine.reset_stats()
        calibrated = engine.calibrate(arrival.max_concurrency or len(requests))
        if calibrated:
            log.info(f"engine {engine.name} calibrated steps of {min(calibrated)}-{max(calibrated)} rows: "
                     + ", ".join(f"{rows}: {s * 1e3:.1f} ms" for rows, s in calibrated.items()))
        profiler = instantiate(cfg.profiler)
        profiler.start(run_dir, runner.device)
        engine.step_hook = profiler.step
        try:
            turns = speedup_turns(engine, requests)   # NOTE: before the run moves the arrival times
            with metrics.sample_utilization(runner.device):
                baseline, outcome = run_measured(engine, requests, arrival.max_concurrency)
        finally:
            profile = profiler.stop()
            engine.step_hook = None
        results: dict[str, Any] = {
            "engine": engine.name, "model_id": runner.model_id, "workload": workload_name,
            "request_rate": arrival.request_rate, "burstiness": arrival.burstiness,
            "max_concurrency": arrival.max_concurrency, "num_warmups": len(warmups),
            "engine_supports_arrivals": engine.supports_arrivals,
            **metrics.summarize(outcome, engine, runner.tokenizer), **load,
            **speedup_fields(baseline, outcome, getattr(engine, "speedup_baseline", "engine"), turns),
            "peak_memory_mb": peak_rss_mb(), **cuda_memory_mb(runner.device),
            "kv/bytes_per_token": engine.kv_bytes_per_token, "weight_bytes": runner.weight_bytes,
            "weight_blocks_linears": runner.block_linears, "streamed_weight_bytes": runner.streamed_weight_bytes,
            "weight_blocks_max_rows": runner.model.block_max_rows if runner.block_linears else 0,
            "weight_blocks_kernel": runner.block_kernel if runner.block_linears else "none",
            "huge_page_bytes": huge_pages.process_huge_page_bytes(), "greedy_head": runner.greedy_head,
            "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
            "num_threads": torch.get_num_threads(), **profile_fields(profile), "config": resolved}
        write_results(run_dir, results, outcome.requests, runner.tokenizer)
        if metrics.sampler is not None:
            metrics.sampler.write_series(run_dir / "utilization.jsonl")
            logger.log_series("utilization", metrics.sampler.series, step_key="t_s")
        for artifact_name, path in profiler.outputs.items():
            logger.log_artifact(path, artifact_name, kind="profile")
        logger.log_summary({k: v for k, v in results.items() if isinstance(v, (int, float)) and v is not None})
        logger.log_table("requests", [request_record(r, runner.tokenizer) for r in outcome.requests])
        table = format_table(results)
        log.info(f"results ({run_dir / 'results.json'}):\n{table}")
        if cfg.print_table:
            print(table)
            print(f"results: {run_dir / 'results.json'}")
        exit_code = 0
        return results
    finally:
        logger.finish(exit_code)


# NOTE: an absolute path: the `lab` console script has no calling file for Hydra to resolve "../conf" from.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    return run_job(lambda run_dir: run(cfg, run_dir))


cli = console_script(main)   # NOTE: the `lab` console script

if __name__ == "__main__":
    cli()
