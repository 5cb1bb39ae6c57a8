"""experiments/crossover.py on hand-made results: crossover points are interpolated where speedup falls
below 1.0 (or reported as never / always helping), failed jobs are skipped, crossover.json + PNG + table
are written, the prompt-length axis is detected; the experiment configs compose."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest

from lab.spec.feature_proposer import ConfidenceGate
from lab.spec.schedule import SpecSchedule
from tests.conftest import compose_cfg
from tests.helpers import load_experiment


@pytest.fixture(scope="module")
def crossover() -> ModuleType:
    return load_experiment("crossover")


SPEEDUPS = {"speculative": {1: 1.1, 4: 0.9, 16: 0.7}, "eagle": {1: 1.6, 4: 1.2, 16: 0.8},
            "dflash": {1: 2.0, 4: 1.5, 16: 1.1}}


def _write_sweep(root: Path, min_prompt_lens: tuple[int | None, ...] = (None,)) -> Path:
    num = 0
    for engine, by_concurrency in SPEEDUPS.items():
        for concurrency, speedup in by_concurrency.items():
            for min_len in min_prompt_lens:
                job = root / str(num)
                job.mkdir(parents=True)
                prompt_len = 100.0 if min_len is None else 2.0 * min_len
                results = {"workload": "mtbench", "max_concurrency": concurrency, "completed": 4,
                           "total_input_tokens": 4 * prompt_len, "mean_tpot_ms": 20 / speedup,
                           "baseline/mean_tpot_ms": 20.0, "spec/speedup_tpot": speedup * (1 + (min_len or 0) / 1000),
                           "spec/speedup_e2e": speedup, "spec_decode_acceptance_length": 2.5,
                           "spec/tokens_per_target_forward": 2.4, "spec/draft_s": 1.0, "spec/verify_s": 3.0,
                           "spec/same_output_as_baseline": True, "spec/num_spec_tokens": 4,
                           "config": {"concurrency": concurrency, "engine": {"name": engine},
                                      "workload": {"min_prompt_len": min_len}}}
                (job / "results.json").write_text(json.dumps(results))
                num += 1
    (root / "failed").mkdir()
    (root / "failed" / "error.json").write_text("{}")   # NOTE: no message in it
    return root


def test_crossover_points(crossover: ModuleType) -> None:
    point = crossover.crossover_point([1, 4, 16], [1.1, 0.9, 0.7])
    assert point["crossover"] == pytest.approx(2 ** (0 + 0.1 / 0.2 * 2)) and "1 and 4" in point["status"]
    assert crossover.crossover_point([1, 4], [0.8, 0.5])["crossover"] is None
    assert "below 1.0 already" in crossover.crossover_point([1, 4], [0.8, 0.5])["status"]
    assert "still above" in crossover.crossover_point([1, 4], [1.8, 1.5])["status"]
    assert crossover.crossover_point([100, 300], [1.2, 0.8], log_x=False)["crossover"] == pytest.approx(200)
    assert not point["holds_ar_after"]
    at_ar = crossover.crossover_point([1, 4, 16, 32], [1.2, 1.1, 0.99, 1.005])   # stops drafting from 16 on
    assert at_ar["holds_ar_after"] and at_ar["status"] == "crosses between 4 and 16, then within noise of AR"
    assert at_ar["pays_again_at"] == []
    # NOTE: a CPU's shape: extra verify rows dear at 4 requests (GGUF blocks), cheap again at 16 (fp32 weights)
    again = crossover.crossover_point([1, 4, 16, 32], [1.17, 0.82, 1.12, 0.95])
    assert again["pays_again_at"] == [16] and not again["holds_ar_after"]
    assert again["status"] == "crosses between 1 and 4, above 1.0 again at 16"
    late = crossover.crossover_point([1, 4, 16], [0.95, 0.8, 1.05])
    assert late["never_helps"] and late["status"] == "below 1.0 already at 1, above 1.0 again at 16"
    assert crossover.crossover_point([1, 4, 16], [0.95, 0.8, 1.01])["pays_again_at"] == [], "within the noise"


def test_the_jobs_that_drafted_nothing_set_the_noise_floor(crossover: ModuleType) -> None:
    def row(speedup: float, drafted_nothing: bool) -> dict[str, object]:
        return {"speedup_tpot": speedup, "drafted_nothing": drafted_nothing}

    assert crossover.noise_floor([row(1.3, False)]) == {"tolerance": crossover.AT_AR_TOLERANCE, "jobs": 0}
    quiet = crossover.noise_floor([row(0.995, True), row(1.005, True), row(0.7, False)])
    assert quiet["tolerance"] == crossover.AT_AR_TOLERANCE and quiet["jobs"] == 2, "never below the fixed tolerance"
    # NOTE: AR against AR read 0.95 and 1.03 beside a busy neighbour: rms sqrt((0.0025 + 0.0009) / 2)
    shaken = crossover.noise_floor([row(0.95, True), row(1.03, True), row(math.nan, True)])
    assert shaken["rms"] == pytest.approx(math.sqrt(0.0017)) and shaken["tolerance"] == pytest.approx(2 * shaken["rms"])
    assert (shaken["jobs"], shaken["min"], shaken["max"]) == (2, 0.95, 1.03)
    assert "2 jobs that drafted nothing (AR against AR) read 0.950-1.030x" in crossover.noise_floor_line(shaken)
    # NOTE: 0.96 at 4 requests is a loss on a quiet machine and AR's speed within this sweep's noise (8.2 %)
    quiet_point = crossover.crossover_point([1, 4, 16], [1.2, 0.96, 0.8])
    noisy_point = crossover.crossover_point([1, 4, 16], [1.2, 0.96, 0.8], noise=shaken["tolerance"])
    assert not quiet_point["within_noise"] and quiet_point["status"] == "crosses between 1 and 4"
    assert noisy_point["within_noise"] and noisy_point["crossover"] == quiet_point["crossover"], "it still crosses"
    assert noisy_point["status"] == "crosses between 1 and 4 (within noise of 1.0 at 4)"
    first = crossover.crossover_point([1, 4], [0.95, 0.9], noise=0.06)
    assert first["never_helps"] and first["status"] == "below 1.0 already at 1 (within noise of 1.0 at 1)"
    assert crossover.crossover_point([1, 4, 16], [1.2, 0.8, 1.05], noise=0.06)["pays_again_at"] == [], "inside it"
    held = crossover.crossover_point([1, 4, 16], [1.2, 0.95, 0.96], noise=0.06)
    assert held["holds_ar_after"] and held["status"] == "crosses between 1 and 4, then within noise of AR"


def test_main_writes_json_png_and_table(crossover: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = _write_sweep(tmp_path / "sweep")
    assert crossover.main([str(sweep)]) == 0
    out = sweep / "crossover"
    assert (out / "crossover.png").stat().st_size > 10_000
    data = json.loads((out / "crossover.json").read_text())
    assert data["axis"] == "concurrency" and len(data["rows"]) == 9
    assert data["failed_jobs"] == [{"job": str(sweep / "failed"), "error": "see error.json"}]
    by_method = {p["method"]: p for p in data["crossovers"]}
    assert by_method["EAGLE"]["crossover"] == pytest.approx(2 ** (2 + 0.2 / 0.4 * 2))
    assert by_method["DFlash"]["crossover"] is None and "still above" in by_method["DFlash"]["status"]
    assert [by_method[m]["pays_up_to"] for m in ("vanilla (suffix)", "EAGLE", "DFlash")] == [2, 8, None]
    assert crossover.pays_up_to(crossover.crossover_point([1, 4], [0.8, 0.5])) == 0
    printed = capsys.readouterr().out
    assert "skipped" in printed and "| mtbench | DFlash | still above 1.0 at 16 | 2 | all tested |" in printed
    assert "| mtbench | EAGLE | 8 (crosses between 4 and 16) | 1.6 | 8 |" in printed
    floor = "noise floor: every job here drafted, so none measured AR against AR; speedups within 2% of 1.0 read as"
    assert floor in printed
    assert data["noise_floor"] == {"tolerance": crossover.AT_AR_TOLERANCE, "jobs": 0}


def test_prompt_length_axis(crossover: ModuleType, tmp_path: Path) -> None:
    rows, _ = crossover.load_rows([_write_sweep(tmp_path / "sweep", (8, 256, 768))])
    assert crossover.axis_of(rows) == "prompt_len"
    points = crossover.crossovers(rows, "prompt_len")
    assert len(points) == 9 and all("concurrency" in p and "pays_up_to" not in p for p in points)
    assert not any(math.isnan(p["best_speedup_tpot"]) for p in points)


@pytest.mark.parametrize("experiment", ["crossover", "crossover_prompt_len"])
def test_experiment_configs_compose(experiment: str) -> None:
    cfg = compose_cfg([f"+experiment={experiment}", "concurrency=16"])
    assert cfg.engine.measure_speedup and cfg.workload.num_prompts == 16 and cfg.workload.max_concurrency == 16
    assert compose_cfg([f"+experiment={experiment}", "concurrency=1"]).workload.num_prompts == 4


@pytest.mark.parametrize("experiment", ["crossover", "crossover_prompt_len"])
def test_the_sweeps_run_one_single_threaded_job_per_core_of_two(experiment: str, tmp_path: Path) -> None:
    cfg = compose_cfg([f"+experiment={experiment}"], run_dir=tmp_path)
    assert cfg.hydra.launcher._target_.endswith("JoblibLauncher") and cfg.hydra.launcher.n_jobs == 2
    assert cfg.threads == 1
    sequential = compose_cfg([f"+experiment={experiment}", "hydra.launcher.n_jobs=1"], run_dir=tmp_path)
    assert sequential.hydra.launcher.n_jobs == 1


def test_the_prompt_length_sweep_runs_sharegpt_only(tmp_path: Path) -> None:
    # NOTE: Hydra merges an experiment's sweeper params into those of the experiment it extends; crossover's
    # `workload: mtbench,gsm8k` once leaked into this sweep, where no prompt is 256+ tokens long
    params = compose_cfg(["+experiment=crossover_prompt_len"], run_dir=tmp_path).hydra.sweeper.params
    assert params.workload == "sharegpt" and params.concurrency == "1,8"
    assert params["workload.min_prompt_len"] == "8,256,768"


def test_engine_dflash_verifies_its_second_draft_only_where_the_drafter_is_sure() -> None:
    for engine in ("dflash", "dflash_adaptive"):
        proposer = compose_cfg(["+experiment=crossover", f"engine={engine}"]).engine.proposer
        gate = ConfidenceGate(proposer.min_confidence, proposer.always_draft)
        # NOTE: a confidence list is the drafter's top probability at each drafted position
        assert [gate.length(c) for c in ([0.1, 0.9], [0.9, 0.3], [0.9, 0.6])] == [1, 1, 2], engine
    assert compose_cfg(["engine=speculative", "engine/proposer=dflash"]).engine.proposer.min_confidence == 0


def test_the_adaptive_dflash_engine_drafts_by_batch_size() -> None:
    cfg = compose_cfg(["+experiment=crossover", "engine=dflash_adaptive"])
    dflash = compose_cfg(["+experiment=crossover", "engine=dflash"])
    assert cfg.engine.name == "dflash_adaptive" and cfg.engine.proposer.checkpoint == dflash.engine.proposer.checkpoint
    schedule = SpecSchedule.build(cfg.engine.num_spec_tokens, cfg.engine.num_spec_tokens_by_batch_size)
    assert [schedule.num_spec_tokens(n) for n in (1, 2, 3, 4, 5, 32)] == [2, 0, 0, 0, 0, 0]
