"""Measurement suite around a run: the W&B logger (offline), the utilization sampler, sweep plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lab.errors import LabError
from lab.logging import WandbLogger
from lab.metrics.utilization import UtilizationSampler, nvml_target
from lab.sweep_callback import PlotsCallback, load_plots_module
from tests.conftest import compose_cfg

REPO = Path(__file__).resolve().parents[1]
PLOTS = ["latency_cdf.png", "ttft_vs_prompt_len.png", "tpot_vs_context.png", "memory_vs_length.png", "summary.md"]
plots = load_plots_module()


def offline_runs(job_dir: Path) -> list[Path]:
    return sorted((job_dir / "wandb").glob("offline-run-*"))


def run_file_bytes(run_dir: Path, text: str, timeout_s: float = 15.0) -> bytes:
    """The offline run file once it holds `text`.

    NOTE: wandb-core writes the run file asynchronously: finish() can return before the records reach the
    disk (they always do by the time the service shuts down, at the latest when the process exits).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        data = next(run_dir.glob("*.wandb")).read_bytes()
        if text.encode() in data or time.monotonic() > deadline:
            return data
        time.sleep(0.2)


# --- W&B logger ----------------------------------------------------------------------------------------


def test_wandb_logger_writes_an_offline_run_with_summary_table_series_and_artifact(tmp_path: Path) -> None:
    logger = WandbLogger(mode="offline", tags=["test"])
    logger.start(run_dir=tmp_path, name="engine=ar,workload.input_len=8", group="sweep-0123", config={"a": {"b": 1}})
    logger.log_summary({"output_throughput": 12.5, "mean_ttft_ms": 3.0})
    logger.log_table("requests", [{"request_id": "r0", "ttft_ms": 1.0, "itl_ms": [1.0, 2.0], "output_text": None},
                                  {"request_id": "r1", "ttft_ms": 2.0, "itl_ms": [], "output_text": "hi"}])
    logger.log_series("utilization", [{"t_s": 0.1, "cpu_percent": 50.0}, {"t_s": 0.2, "cpu_percent": 70.0}], "t_s")
    (tmp_path / "plot.png").write_bytes(b"png")
    logger.log_artifact(tmp_path / "plot.png", name="plots engine=ar", kind="plot")
    run_path = logger.run_path
    logger.finish(0)

    runs = offline_runs(tmp_path)
    assert runs == [run_path], f"expected one offline run in {tmp_path / 'wandb'}, found {runs}"
    expected = ("sweep-0123", "engine=ar,workload.input_len=8", "output_throughput", "utilization/cpu_percent",
                "utilization/t_s", "plots-engine-ar")
    data = run_file_bytes(runs[0], expected[0])
    assert [text for text in expected if text.encode() not in data] == [], "missing from the offline run file"
    table = json.loads(next(runs[0].glob("files/media/table/requests_*.table.json")).read_text())
    assert table["columns"] == ["request_id", "ttft_ms", "itl_ms", "output_text"]
    assert table["data"][0] == ["r0", 1.0, "[1.0, 2.0]", None] and len(table["data"]) == 2


def test_wandb_logger_is_safe_to_finish_unstarted_and_refuses_to_log_unstarted() -> None:
    logger = WandbLogger()
    logger.finish(1)  # NOTE: run() always calls finish, even when start never ran
    with pytest.raises(RuntimeError, match="start"):
        logger.log_summary({"x": 1.0})
    with pytest.raises(LabError, match="logger.mode='cloud'"):
        WandbLogger(mode="cloud")


def test_wandb_config_is_offline_unless_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert instantiate(compose_cfg(["logger=wandb"]).logger).mode == "offline"
    assert instantiate(compose_cfg(["logger=wandb", "logger.mode=online"]).logger).mode == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert instantiate(compose_cfg(["logger=wandb"]).logger).mode == "disabled"


# --- a real sweep: W&B runs, a failing job, plots --------------------------------------------------------


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """engine=ar,ar_nocache x output_len=4,5000 on the tiny model (context 2048): the 5000 jobs fail."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run(
        [sys.executable, "-m", "lab.run", "-m", "model=tiny", "logger=wandb", "workload.num_prompts=2",
         "workload.input_len=8", "workload.output_len=4,5000", "engine=ar,ar_nocache", "print_table=false",
         f"hydra.sweep.dir={sweep_dir}", "++hydra.callbacks.plots._target_=lab.sweep_callback.PlotsCallback"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]   # NOTE: the sweep ran to its end; two of its jobs failed
    assert "2 of 4 jobs failed" in proc.stderr
    return sweep_dir, proc


def job_dirs(sweep_dir: Path) -> dict[str, Path]:
    return {p.name.split("_", 1)[1]: p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir()}


def test_sweep_writes_one_offline_wandb_run_per_job(sweep: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    jobs = job_dirs(sweep[0])
    assert len(jobs) == 4, sorted(jobs)
    ok = {name: path for name, path in jobs.items() if "output_len=4," in name + ","}
    assert len(ok) == 2, sorted(jobs)
    for name, path in jobs.items():
        runs = offline_runs(path)
        assert len(runs) == 1, f"{path}: {runs}"
        assert name.encode() in next(runs[0].glob("*.wandb")).read_bytes(), f"run name {name} not in {runs[0]}"
    for path in ok.values():
        assert next(offline_runs(path)[0].glob("files/media/table/requests_*.table.json"), None) is not None


def test_a_failing_job_leaves_the_others_results_and_the_plots(
        sweep: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    sweep_dir, proc = sweep
    jobs = job_dirs(sweep_dir)
    failed = sorted(p for p in jobs.values() if (p / "error.json").exists())
    assert [p.name for p in failed] == sorted(p.name for n, p in jobs.items() if "output_len=5000" in n)
    for path in set(jobs.values()) - set(failed):
        results = json.loads((path / "results.json").read_text())
        assert results["completed"] == 2 and results["total_output_tokens"] == 8, path
        assert len((path / "requests.jsonl").read_text().splitlines()) == 2
    out = sweep_dir / "plots"
    assert [p for p in PLOTS if not (out / p).is_file()] == []
    assert (out / "throughput.png").is_file() or list(out.glob("throughput_vs_*.png"))
    for path in failed:
        assert f"skipped (failed or unfinished): {path}" in proc.stdout
    assert "| engine |" in (out / "summary.md").read_text()


# --- plots on a synthetic sweep ------------------------------------------------------------------------


def write_job(sweep_dir: Path, num: int, engine: str, input_len: int, seed: int = 0) -> None:
    job = sweep_dir / f"{num}_engine={engine},workload.input_len={input_len}"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- engine={engine}\n- workload.input_len={input_len}\n")
    config = {"seed": seed, "engine": {"name": engine, "use_kv_cache": engine == "ar"} if engine != "hf"
              else {"name": "hf", "batch_size": 1}, "workload": {"input_len": input_len, "seed": seed}}
    results = {"output_throughput": 100.0 / input_len, "total_token_throughput": 1.0, "median_ttft_ms": input_len,
               "median_tpot_ms": 2.0, "median_e2el_ms": 9.0, "peak_memory_mb": 500.0 + input_len, "config": config}
    (job / "results.json").write_text(json.dumps(results))
    records = [{"prompt_len": input_len, "output_len": 3, "ttft_ms": input_len * (1 + i / 10), "tpot_ms": 2.0,
                "itl_ms": [2.0, 2.0], "e2el_ms": input_len + 4.0} for i in range(3)]
    (job / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_swept_parameters_are_the_config_keys_that_differ() -> None:
    engines = [{"name": "ar", "use_kv_cache": True, "proposer": {"min_confidence": 0.3}},
               {"name": "hf", "batch_size": 1, "proposer": {"min_confidence": 0.0, "always_draft": 1}}]
    configs = [{"seed": s, "engine": e, "workload": {"input_len": n, "seed": s, "num_prompts": 2}}
               for s, e, n in [(0, engines[0], 8), (1, engines[1], 16)]]
    # NOTE: keys nested under a swept group (engine.proposer.*) belong to it, not parameters of their own
    assert plots.swept_params(configs) == {"seed": [0, 1], "engine": ["ar", "hf"], "workload.input_len": [8, 16]}


def test_callback_plots_a_sweep_and_lists_failed_jobs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for num, (engine, input_len) in enumerate([("ar", 8), ("ar", 64), ("hf", 8), ("hf", 64)]):
        write_job(tmp_path, num, engine, input_len)
    failed = tmp_path / "4_engine=hf,workload.input_len=9000"
    (failed / ".hydra").mkdir(parents=True)
    (failed / "error.json").write_text('{"error": "too long"}')
    PlotsCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    printed = capsys.readouterr().out
    expected = PLOTS + ["throughput_vs_input_len.png"]
    assert [p for p in expected if f"plots: {tmp_path / 'plots' / p}" not in printed] == []
    assert f"skipped (failed or unfinished): {failed}" in printed
    table = (tmp_path / "plots" / "summary.md").read_text().splitlines()
    assert table[0].startswith("| engine | input_len |") and len(table) == 2 + 4 + 4, table
    assert table[-3:] == ["Failed jobs (1, not in the table above):", "", f"- `{failed.name}`: too long"]


def test_jobs_nested_by_a_group_override_with_a_slash_are_found(tmp_path: Path) -> None:
    """engine/proposer=ngram puts a "/" into Hydra's job dir name: the job's files sit one level deeper."""
    write_job(tmp_path, 0, "ar", 8)
    write_job(tmp_path / "1_engine", 0, "hf", 16)
    jobs, skipped = plots.load_sweep(tmp_path)
    assert sorted(j.results["config"]["engine"]["name"] for j in jobs) == ["ar", "hf"] and skipped == []


def test_a_reused_job_dir_starts_without_the_earlier_runs_outputs(tmp_path: Path) -> None:
    from lab.hydra_job import JOB_OUTPUTS, clear_job_outputs

    for name in (*JOB_OUTPUTS, "run.log"):
        (tmp_path / name).write_text("{}")
    clear_job_outputs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.log"]


# --- utilization sampler -------------------------------------------------------------------------------


def test_utilization_sampler_records_cpu_and_rss_of_this_process_from_another(tmp_path: Path) -> None:
    busy_s = 1.0
    with UtilizationSampler(interval_s=0.05) as sampler:
        child_pid = sampler.pid
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        while time.perf_counter() - wall_start < busy_s:
            pass
        cpu_share = 100 * (time.process_time() - cpu_start) / (time.perf_counter() - wall_start)
        ballast = bytearray(200 * 2**20)
    assert child_pid not in (None, os.getpid()) and not psutil.pid_exists(child_pid), "sampler outlived the block"
    series = sampler.series
    assert len(series) >= busy_s / 0.05 / 4, f"only {len(series)} samples in {busy_s} s at 0.05 s"
    assert all(b["t_s"] > a["t_s"] for a, b in zip(series, series[1:]))
    summary = sampler.summary()
    assert summary["util/num_samples"] == len(series)
    for key in ("cpu_percent", "rss_mb"):
        assert {f"util/{key}_{s}" for s in ("mean", "max", "p50", "p90")} <= summary.keys()
    assert summary["util/cpu_percent_mean"] > 0.4 * cpu_share, f"sampled {summary['util/cpu_percent_mean']:.0f}% " \
        f"while the process used {cpu_share:.0f}% of a core"
    assert summary["util/rss_mb_max"] - series[0]["rss_mb"] > 150, f"RSS rose by only " \
        f"{summary['util/rss_mb_max'] - series[0]['rss_mb']:.0f} MB after allocating {len(ballast) >> 20} MB"
    path = sampler.write_series(tmp_path / "utilization.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == series


def test_nvml_target_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert (nvml_target("cpu"), nvml_target("cuda"), nvml_target("cuda:1")) == (None, 0, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc")
    assert (nvml_target("cuda:0"), nvml_target("cuda:1")) == (3, "GPU-abc")


@pytest.mark.gpu
def test_utilization_sampler_reads_nvml_on_cuda() -> None:
    import torch

    x = torch.randn(4096, 4096, device="cuda")
    with UtilizationSampler(interval_s=0.05, device="cuda") as sampler:
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:
            x = torch.tanh(x @ x)
        torch.cuda.synchronize()
    summary = sampler.summary()
    assert summary["util/gpu_percent_max"] > 10, summary
    assert summary["util/gpu_mem_used_mb_max"] > 64, summary
    assert summary.get("util/gpu_power_w_mean", 1.0) > 0, summary


def test_gpu_sample_converts_nvml_readings_and_skips_unsupported_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    from lab.metrics import utilization

    def not_supported(handle: object) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", lambda h: type("U", (), {"gpu": 87})())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: type("M", (), {"used": 3 * 2**30})())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", lambda h: 251_500)  # milliwatts
    assert utilization._gpu_sample(object()) == {"gpu_percent": 87.0, "gpu_mem_used_mb": 3072.0, "gpu_power_w": 251.5}
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", not_supported)
    assert "gpu_power_w" not in utilization._gpu_sample(object())


def test_length_sweep_experiment_composes_with_wandb_and_the_plots_callback(tmp_path: Path) -> None:
    cfg = compose_cfg(["+experiment=length_sweep"], run_dir=tmp_path)
    assert cfg.model.name == "smollm2" and cfg.workload.name == "random" and cfg.engine.name == "ar"
    assert instantiate(cfg.logger).mode in ("offline", "online", "disabled")
    assert set(cfg.hydra.sweeper.params) == {"engine", "workload.input_len", "workload.output_len"}
    assert cfg.hydra.callbacks.plots._target_ == "lab.sweep_callback.PlotsCallback"
    slurm = compose_cfg(["hydra/launcher=slurm"], run_dir=tmp_path).hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher") and slurm.gpus_per_node == 1
