"""experiments/spec_sweep.py on hand-made results: rows carry each job's settings and measurements, repeats
of a setting (several sweep dirs) become medians, failed jobs are skipped, the three PNGs are written and
the table has a line per setting."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import compose_cfg
from tests.helpers import load_experiment


@pytest.fixture(scope="module")
def spec_sweep() -> ModuleType:
    return load_experiment("spec_sweep")


def _results(workload: str, proposer: str, k: int, concurrency: int, speedup: float) -> dict:
    target = {"ngram": "lab.spec.ngram_config.NgramProposerConfig",
              "layerskip": "lab.spec.draft_model.LayerSkipProposerConfig"}[proposer]
    accepted = [0.6 / (i + 1) for i in range(k)]
    return {"workload": workload, "max_concurrency": concurrency, "total_output_tokens": 100,
            "mean_tpot_ms": 50.0 / speedup, "baseline/mean_tpot_ms": 50.0, "baseline/duration": 5.0,
            "spec/speedup_tpot": speedup, "spec/speedup_e2e": speedup * 0.9, "spec/same_output_as_baseline": True,
            "spec/num_spec_tokens": k, "spec_decode_num_drafts": 40, "spec_decode_accepted_tokens": 30,
            "spec_decode_acceptance_rate": 100 * sum(accepted) / k,
            "spec_decode_acceptance_length": 1 + sum(accepted), "spec/tokens_per_target_forward": 1 + sum(accepted),
            "spec/draft_s": 0.1 * k, "spec/verify_s": 4.0, "phase/decode_s": 3.0, "phase/decode_steps": 60,
            "phase/draft_steps": 50,
            "spec_decode_per_position_acceptance_rates": list(accepted),
            "config": {"concurrency": concurrency, "engine": {"num_spec_tokens": k, "proposer": {
                "_target_": target, **({"num_layers": 8} if proposer == "layerskip" else {"min_n": 1})}}}}


def _write_sweep(root: Path, scale: float = 1.0) -> Path:
    num = 0
    for workload in ("mtbench", "gsm8k"):
        for proposer in ("ngram", "layerskip"):
            for k in (1, 2, 4):
                for concurrency in (1, 4):
                    # NOTE: nested as Hydra nests `engine/proposer=...` overrides in override-named dirs
                    job = root / f"{num}_k={k},engine" / f"proposer={proposer},workload={workload}"
                    job.mkdir(parents=True)
                    speedup = scale * (1.0 + 0.1 * k) / concurrency ** 0.5
                    (job / "results.json").write_text(json.dumps(_results(workload, proposer, k, concurrency, speedup)))
                    num += 1
    failed = root / f"{num}_failed"
    failed.mkdir()
    (failed / "results.json").write_text(json.dumps({"failed_job": True, "error": "boom", "completed": 0}))
    (failed / "error.json").write_text("{}")
    return root


def test_rows_carry_settings_and_measurements(spec_sweep: ModuleType, tmp_path: Path) -> None:
    rows, skipped = spec_sweep.load_rows([_write_sweep(tmp_path / "sweep")])
    assert len(rows) == 24 and [p.name for p in skipped] == ["24_failed"]
    row = next(r for r in rows if r["workload"] == "gsm8k" and r["proposer"] == "layerskip[8]" and r["k"] == 4
               and r["concurrency"] == 4)
    assert row["speedup_tpot"] == pytest.approx(1.4 / 2) and row["runs"] == 1
    assert row["per_position"] == pytest.approx([0.6, 0.3, 0.2, 0.15])
    baseline_step_ms = 50.0
    assert row["verify_step_cost"] == pytest.approx(3000 / 60 / baseline_step_ms)
    assert row["draft_step_cost"] == pytest.approx(400 / 50 / baseline_step_ms)
    assert row["tokens_per_request_step"] == pytest.approx(100 / (100 - 30))
    assert row["same_output"] is True


def test_repeated_sweeps_give_medians(spec_sweep: ModuleType, tmp_path: Path) -> None:
    dirs = [_write_sweep(tmp_path / f"sweep{i}", scale) for i, scale in enumerate((1.0, 1.2, 2.0))]
    rows, _ = spec_sweep.load_rows(dirs)
    assert len(rows) == 24 and all(r["runs"] == 3 for r in rows)
    row = next(r for r in rows if r["workload"] == "mtbench" and r["proposer"] == "ngram" and r["k"] == 1
               and r["concurrency"] == 1)
    assert row["speedup_tpot"] == pytest.approx(1.2 * 1.1), "the median of 1.1, 1.32 and 2.2"


def test_main_writes_three_pngs_and_a_table(spec_sweep: ModuleType, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    sweep = _write_sweep(tmp_path / "sweep")
    assert spec_sweep.main([str(sweep), "--out", str(tmp_path / "figs")]) == 0
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert names == ["spec_acceptance.png", "spec_speedup.png", "spec_step_cost.png"]
    assert all((tmp_path / "figs" / n).stat().st_size > 10_000 for n in names)
    printed = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("| mtbench") or line.startswith("| gsm8k")]
    assert len(table) == 24, printed
    assert "skipped" in printed and "24_failed" in printed


def test_trained_drafters_and_trees_of_drafts_are_told_apart(spec_sweep: ModuleType) -> None:
    """conf/experiment/tree_sweep.yaml's and denoise_sweep.yaml's jobs: the proposer's name carries its tree
    (tree_width > 1) and its denoising steps (denoise_steps > 1)."""
    def engine(target: str, **proposer: object) -> dict:
        return {"proposer": {"_target_": f"lab.spec.{target}", **proposer}}

    assert spec_sweep.proposer_name(engine("eagle.EagleProposerConfig", tree_width=1)) == "eagle"
    assert spec_sweep.proposer_name(engine("eagle.EagleProposerConfig", tree_width=3)) == "eagle[tree 3]"
    assert spec_sweep.proposer_name(engine("dflash.DFlashProposerConfig", tree_width=2,
                                           tree_tails=True)) == "dflash[tree 2+tails]"
    assert spec_sweep.proposer_name(engine("dflash.DFlashProposerConfig")) == "dflash"
    assert spec_sweep.proposer_name(engine("dflash.DFlashProposerConfig", denoise_steps=2)) == "dflash[2 steps]"
    assert spec_sweep.proposer_name(engine("dflash.DFlashProposerConfig", tree_width=4,
                                           denoise_steps=3)) == "dflash[tree 4, 3 steps]"
    assert spec_sweep.proposer_name(engine("dflash.DFlashProposerConfig", tree_nodes=62)) == "dflash[tree of 62]"


def test_the_tree_sweep_composes_batch_one_jobs_paired_over_ar(tmp_path: Path) -> None:
    cfg = compose_cfg(["+experiment=tree_sweep"], run_dir=tmp_path)
    params = cfg.hydra.sweeper.params
    assert params.engine == "eagle,dflash" and params["engine.proposer.tree_width"] == "1,2,3"
    assert cfg.engine.speedup_baseline == "ar" and cfg.workload.max_concurrency == 1
    for name in ("eagle", "dflash"):
        tree = compose_cfg(["+experiment=tree_sweep", f"engine={name}", "engine.proposer.tree_width=3"])
        assert tree.engine.proposer.tree_width == 3 and tree.engine.measure_speedup


def test_the_denoise_sweep_composes_batch_one_jobs_with_the_drafter_trained_for_it(tmp_path: Path) -> None:
    cfg = compose_cfg(["+experiment=denoise_sweep"], run_dir=tmp_path)
    params = cfg.hydra.sweeper.params
    assert params["engine.proposer.denoise_steps"] == "1,2,3" and params["engine.num_spec_tokens"] == "2,3"
    assert cfg.engine.name == "dflash" and cfg.engine.speedup_baseline == "ar" and cfg.workload.max_concurrency == 1
    job = compose_cfg(["+experiment=denoise_sweep", "engine.proposer.denoise_steps=3"])
    assert job.engine.proposer.checkpoint.endswith("dflash_denoise.pt") and job.engine.proposer.denoise_steps == 3

