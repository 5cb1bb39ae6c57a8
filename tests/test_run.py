"""`lab.run` end to end: results files, every config composes and instantiates, sweeps survive failures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import DictConfig

from lab.run import ARRIVAL_KEYS, run
from tests.conftest import CONF_DIR, compose_cfg

REPO = Path(__file__).resolve().parents[1]
RESULT_FIELDS = ["engine", "model_id", "num_prompts", "completed", "failed", "duration", "total_input_tokens",
                 "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
                 "peak_memory_mb", "config"] + [f"{s}_{m}_ms" for s in ("mean", "median", "p99")
                                                for m in ("ttft", "tpot", "itl", "e2el")]
REQUEST_FIELDS = ["request_id", "prompt_len", "output_len", "output_token_ids", "output_text", "ttft_ms",
                  "itl_ms", "e2el_ms"]


def lab_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lab.run", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_run_writes_results_and_requests(cfg: DictConfig, tmp_path: Path) -> None:
    results = run(cfg, tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert [f for f in RESULT_FIELDS if f not in on_disk] == []
    assert on_disk["completed"] == 3 and on_disk["failed"] == 0
    assert on_disk["total_output_tokens"] == 3 * 8 == results["total_output_tokens"]
    assert on_disk["config"]["engine"]["name"] == "ar"
    # NOTE: the tiny random-init model is not made of GGUF blocks: it streams its fp32 weights
    assert on_disk["weight_blocks_linears"] == 0 and on_disk["streamed_weight_bytes"] == on_disk["weight_bytes"]
    assert on_disk["weight_blocks_kernel"] == "none"
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    for record in lines:
        assert [f for f in REQUEST_FIELDS if f not in record] == []
        assert len(record["itl_ms"]) == record["output_len"] - 1 == 7
        assert record["ttft_ms"] <= record["e2el_ms"]


def test_sampling_logprobs_go_into_requests_jsonl(tmp_path: Path) -> None:
    cfg = compose_cfg(["model=tiny", "logger=none", "engine=cb_paged", "workload.num_prompts=2",
                       "workload.input_len=8", "workload.output_len=4", "sampling.logprobs=2",
                       "sampling.prompt_logprobs=0", "print_table=false"])
    run(cfg, tmp_path)
    for line in (tmp_path / "requests.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert len(record["output_logprobs"]) == 4 and all(e["rank"] == 1 for e in record["output_logprobs"])
        assert [e["top"][0][0] for e in record["output_logprobs"]] == record["output_token_ids"]   # greedy
        prompt_logprobs = record["prompt_logprobs"]
        assert len(prompt_logprobs) == 8 and prompt_logprobs[0] is None and prompt_logprobs[1]["top"] == []


@pytest.mark.parametrize("group", ["model", "engine", "workload", "metrics", "profiler", "logger"])
def test_every_config_file_composes(group: str, tmp_path: Path) -> None:
    names = sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))
    assert names, f"no configs in conf/{group}"
    for name in names:
        overrides = [f"{group}={name}", f"hydra.run.dir={tmp_path}"]
        if group == "workload" and name == "file":
            overrides.append("workload.path=prompts.jsonl")
        cfg = compose_cfg(overrides)
        assert cfg[group] is not None
        if group in ("workload", "metrics", "profiler", "logger"):
            spec = {k: v for k, v in cfg[group].items() if k not in ARRIVAL_KEYS}
            instantiate(spec)  # constructors validate; nothing heavy happens here


def test_every_experiment_composes(tmp_path: Path) -> None:
    names = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
    for name in names:
        cfg = compose_cfg([f"+experiment={name}", f"hydra.run.dir={tmp_path}"], run_dir=tmp_path)
        assert cfg.engine is not None and cfg.workload is not None, name
        assert cfg.hydra.sweeper.params, f"experiment {name} sweeps nothing"


def test_file_workload_matches_hf_greedy_through_the_cli(tmp_path: Path, tiny_text_runner) -> None:
    from tests.helpers import chat_prompt, hf_greedy

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "The quick brown fox"}\n'
                       '{"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5}\n')
    proc = lab_cli("model=tiny", "engine=ar", "workload=file", f"workload.path={prompts}", "workload.max_tokens=8",
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Output token throughput" in proc.stdout
    run_log = (tmp_path / "run" / "run.log").read_text()   # NOTE: the job's record: what ran, the same table
    assert "[lab.run][INFO] - loaded tiny-llama" in run_log and "workload file: 2 requests" in run_log
    assert "Output token throughput" in run_log and "Output token throughput" not in proc.stderr
    records = [json.loads(x) for x in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    tokenizer = tiny_text_runner.tokenizer
    first = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    second = chat_prompt(tokenizer, "Hello there")
    assert records[0]["output_token_ids"] == hf_greedy(tiny_text_runner, first, 8, ignore_eos=False)
    assert records[1]["output_token_ids"] == hf_greedy(tiny_text_runner, second, 5, ignore_eos=False)


def test_multirun_sweep_survives_a_failing_job(tmp_path: Path) -> None:
    proc = lab_cli("-m", "model=tiny", "workload.num_prompts=1", "workload.input_len=8",
                   "workload.output_len=2,5000", f"hydra.sweep.dir={tmp_path}")
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and p.name[0].isdigit())  # not plots/, .submitit
    assert len(jobs) == 2, [p.name for p in jobs]
    assert (jobs[0] / "results.json").is_file() and not (jobs[0] / "error.json").exists()
    error = json.loads((jobs[1] / "error.json").read_text())["error"]
    assert "exceeds the model's context" in error
    run_log = (jobs[1] / "run.log").read_text()
    assert "[lab][ERROR] - error: request random-0" in run_log and "the error's traceback:\nTraceback" in run_log
    assert proc.stderr.count("error: request random-0") == 1 and "Traceback" not in proc.stderr
    # NOTE: the sweep ran to its end (plots included), then says which job failed, last, and exits 1
    assert (tmp_path / "plots" / "summary.md").is_file()
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.rstrip().splitlines()[-2:] == [
        "1 of 2 jobs failed (exit code 1; the other jobs' results stand):", f"  {jobs[1]}: {error.splitlines()[0]}"]


def test_a_sweeps_jobs_in_one_process_share_the_model_while_it_stays_the_same(tmp_path: Path) -> None:
    # NOTE: the basic launcher runs every job in this one process, one after another
    proc = lab_cli("-m", "model=tiny", "workload.num_prompts=1", "workload.input_len=8", "logger=none",
                   "model.max_model_len=64,64,128", "workload.output_len=3", "print_table=false",
                   f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=${hydra.job.num}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads((tmp_path / str(i) / "results.json").read_text()) for i in range(3)]
    assert [r["phase/model_reused"] for r in results] == [False, True, False], "a new model config loads anew"
    assert results[1]["phase/load_s"] < results[0]["phase/load_s"]
    assert "(the model: the sweep's job before's, reused)" in (tmp_path / "1" / "run.log").read_text()
    outputs = [json.loads((tmp_path / str(i) / "requests.jsonl").read_text().splitlines()[0])["output_token_ids"]
               for i in range(3)]
    assert outputs[0] == outputs[1] == outputs[2], "the shared model computes what a fresh one does"
    # NOTE: joblib's workers (the crossover's launcher) get `python -m lab.run`'s functions by value, with fresh
    # globals each call: the cache must live outside lab/run.py to outlive a job there
    workers = tmp_path / "joblib"
    proc = lab_cli("-m", "model=tiny", "workload.num_prompts=1", "workload.input_len=8", "logger=none",
                   "workload.output_len=2,3,4,5", "print_table=false", "hydra/launcher=joblib",
                   "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={workers}", "hydra.sweep.subdir=${hydra.job.num}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    reused = [json.loads((workers / str(i) / "results.json").read_text())["phase/model_reused"] for i in range(4)]
    assert sum(reused) >= 2, "two workers, four jobs: each worker builds the model once"


def test_a_joblib_worker_holding_a_shared_model_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import psutil

    from lab.runner import shared

    loky = types.SimpleNamespace(_MAX_MEMORY_LEAK_SIZE=int(3e8), _USE_PSUTIL=True)
    monkeypatch.setitem(sys.modules, "joblib.externals.loky.process_executor", loky)
    shared.keep_this_joblib_worker()
    held = psutil.Process().memory_info().rss
    # NOTE: whatever loky measured first (perhaps before the model), the worker may hold what it holds now + 2 GiB
    assert abs(loky._MAX_MEMORY_LEAK_SIZE - shared.LOKY_WORKER_GROWTH_BYTES - held) < 64 << 20
    loky._MAX_MEMORY_LEAK_SIZE = 1 << 40
    shared.keep_this_joblib_worker()
    assert loky._MAX_MEMORY_LEAK_SIZE == 1 << 40, "never lowered"
    without_psutil = types.SimpleNamespace(_MAX_MEMORY_LEAK_SIZE=int(3e8), _USE_PSUTIL=False)
    monkeypatch.setitem(sys.modules, "joblib.externals.loky.process_executor", without_psutil)
    shared.keep_this_joblib_worker()
    assert without_psutil._MAX_MEMORY_LEAK_SIZE == int(3e8), "loky checks nothing there"
    monkeypatch.delitem(sys.modules, "joblib.externals.loky.process_executor")
    shared.keep_this_joblib_worker()   # NOTE: not a joblib worker: nothing to do


def test_a_single_run_loads_its_own_model(cfg: DictConfig, tmp_path: Path) -> None:
    from lab.runner import shared

    run(cfg, tmp_path / "a")
    assert shared._last is None, "not a sweep's job: nothing kept for a next one"
    assert json.loads((tmp_path / "a" / "results.json").read_text())["phase/model_reused"] is False


def test_sweep_failures_are_the_job_dirs_with_an_error_or_no_results(tmp_path: Path) -> None:
    from lab.sweep_callback import sweep_failures
    for i, files in enumerate([("results.json",), ("results.json", "error.json"), ()]):
        job = tmp_path / f"{i}_x" / "nested"
        (job / ".hydra").mkdir(parents=True)
        for name in files:
            (job / name).write_text(json.dumps({"error": "boom\ndetail"}))
    num_jobs, failures = sweep_failures(tmp_path)
    assert num_jobs == 3
    assert [(p.parent.name, error) for p, error in failures] == [
        ("1_x", "boom\ndetail"), ("2_x", "no results.json: the job did not finish")]


@pytest.mark.parametrize("args, message", [
    (["engine=nosuch"], "Could not find 'engine/nosuch'"),     # Hydra's own message (it would exit 1)
    (["engine=["], "override_grammar"),
    (["+experiment=serving"], "python experiments/serving.py +experiment=NAME"),
])
def test_bad_config_names_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    proc = lab_cli("model=tiny", "logger=none", f"hydra.run.dir={tmp_path}", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr


@pytest.mark.parametrize("override, fix", [
    ("+seeed=3", "did you mean seed?"),
    ("+api=chat", "api: a setting of `lab-bench-serve` (conf/bench_serve.yaml), not of `lab`"),
    ("+concurency=4", "remove it, or set it inside its group"),
])
def test_an_unknown_top_level_setting_is_named(override: str, fix: str) -> None:
    from lab.errors import LabError
    from lab.run import check_top_level_keys
    with pytest.raises(LabError, match="unknown top-level setting for `lab`") as caught:
        check_top_level_keys(compose_cfg(["model=tiny", override]))
    assert fix in str(caught.value)


def test_every_lab_experiment_passes_the_top_level_check(tmp_path: Path) -> None:
    from lab.errors import LabError
    from lab.run import check_top_level_keys
    check_top_level_keys(compose_cfg(["engine=static", "+concurrency=4"]))   # ${oc.select:concurrency,8} reads it
    check_top_level_keys(compose_cfg(["+my_len=4", "workload.output_len=${my_len}"]))
    for path in sorted((Path(CONF_DIR) / "experiment").glob("*.yaml")):
        cfg = compose_cfg([f"+experiment={path.stem}", f"hydra.run.dir={tmp_path}"], run_dir=tmp_path)
        if path.stem.startswith("serving"):   # experiments/serving.py's, not lab's
            with pytest.raises(LabError, match="experiments/serving.py"):
                check_top_level_keys(cfg)
        else:
            check_top_level_keys(cfg)


def test_console_script_composes_from_any_directory(tmp_path: Path) -> None:
    scripts = (REPO / "pyproject.toml").read_text()
    assert 'lab = "lab.run:cli"' in scripts
    lab_script = Path(sys.executable).parent / "lab"
    proc = subprocess.run([str(lab_script), "--cfg", "job", "engine=cb_paged"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ContinuousBatchingEngine" in proc.stdout
