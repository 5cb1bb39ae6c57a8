"""experiments/continuous_batching.py on hand-made results: the derived KV and throughput numbers, the
cb_paged ratios, and a full run over a fake sweep dir that writes the four PNGs and the table."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import load_experiment


@pytest.fixture(scope="module")
def cb() -> ModuleType:
    return load_experiment("continuous_batching")


def results(engine: str, workload: str, tok_s: float, **extra: Any) -> dict[str, Any]:
    engine_cfg = {"static": {"batch_size": 4}, "cb_rebuild": {"max_num_seqs": 4}, "hf_cb": {"max_num_seqs": 4}}
    return {"engine": engine, "workload": workload, "completed": 8, "num_prompts": 8, "duration": 10.0,
            "output_throughput": tok_s, "total_output_tokens": 10 * tok_s, "util/cpu_percent_mean": 50.0,
            "p50_ttft_ms": 100.0, "p99_ttft_ms": 300.0, "p50_tpot_ms": 20.0, "p99_tpot_ms": 40.0,
            "config": {"engine": engine_cfg.get(engine, {})}, **extra}


def test_paged_kv_per_request_and_budget_come_from_the_peak_and_running_rows(cb: ModuleType) -> None:
    row = cb.job_row(results("cb_paged", "mixed", 50.0, **{
        "kv/peak_reserved_bytes": 8 * 2**20, "kv/peak_used_bytes": 7 * 2**20, "kv/reserved_per_used_token": 1.05,
        "sched/max_running": 4}), budget_mb=100.0)
    assert row["kv_per_request_mb"] == pytest.approx(2.0), row
    assert row["max_requests_in_budget"] == 50, row
    assert row["reserved_per_used"] == pytest.approx(1.05), "the time average wins over the peak ratio"
    assert row["cpu_tok_s"] == pytest.approx(100.0), "500 tokens over 50% of 10 s = 5 CPU-s"


def test_static_uses_its_batch_size_and_the_peak_ratio(cb: ModuleType) -> None:
    row = cb.job_row(results("static", "mixed", 20.0, **{"kv/peak_reserved_bytes": 12 * 2**20,
                                                         "kv/peak_used_bytes": 4 * 2**20}), budget_mb=30.0)
    assert row["kv_per_request_mb"] == pytest.approx(3.0) and row["max_requests_in_budget"] == 10, row
    assert row["reserved_per_used"] == pytest.approx(3.0), row
    assert row["rebuild_count"] == 0


def test_ratios_are_cb_paged_over_each_engine_per_workload(cb: ModuleType) -> None:
    rows = cb.collect([_job(results(e, w, t)) for e, w, t in [
        ("cb_paged", "mixed", 80.0), ("static", "mixed", 40.0), ("hf_cb", "mixed", 16.0),
        ("cb_paged", "sharegpt", 30.0), ("cb_slots", "sharegpt", 30.0)]], budget_mb=100.0)
    assert [r["engine"] for r in rows] == ["static", "cb_paged", "hf_cb", "cb_slots", "cb_paged"]
    assert cb.ratios(rows) == {"mixed": {"static": pytest.approx(2.0), "hf_cb": pytest.approx(5.0)},
                               "sharegpt": {"cb_slots": pytest.approx(1.0)}}


def test_main_draws_the_pngs_and_prints_the_table(cb: ModuleType, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    for i, (engine, tok_s, extra) in enumerate([
            ("static", 40.0, {"kv/peak_reserved_bytes": 2**24, "kv/peak_used_bytes": 2**23}),
            ("cb_rebuild", 50.0, {"rebuild/count": 7, "rebuild/total_s": 0.5, "rebuild/share": 0.05}),
            ("cb_paged", 90.0, {"kv/reserved_per_used_token": 1.02, "sched/max_running": 4})]):
        job = sweep / f"{i}_{engine}_mixed"
        job.mkdir(parents=True)
        (job / "results.json").write_text(json.dumps(results(engine, "mixed", tok_s, **extra)))
    assert cb.main([str(sweep), "--out", str(tmp_path / "figs"), "--budget-mb", "64"]) == 0
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert names == ["cb_kv_memory.png", "cb_latency.png", "cb_rebuild.png", "cb_throughput.png"], names
    printed = capsys.readouterr().out
    assert "| mixed | cb_rebuild | 8 |" in printed and "static 2.25x" in printed, printed


def _job(res: dict[str, Any]) -> Any:
    from plots import Job

    return Job(Path("."), res, [], [])
