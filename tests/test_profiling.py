"""profiler=torch: a window of engine steps is captured and analysed; ranges are free when off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import record_function

from lab.profiling.ranges import profile_range, set_ranges_enabled
from lab.run import run
from lab.runner import ModelRunner
from lab.spec.dflash import DFlashProposerConfig
from tests.conftest import compose_cfg
from tests.helpers import load_experiment


# NOTE: torch 2.13 deprecates the memory timeline; the profiler keeps it for CPU runs and silences that one warning
@pytest.mark.filterwarnings("error:.*export_memory_timeline.*:FutureWarning")
def test_torch_profiler_writes_trace_tables_and_summary(tmp_path: Path) -> None:
    cfg = compose_cfg(["model=tiny", "workload.num_prompts=2", "workload.input_len=16", "workload.output_len=6",
                       "profiler=torch", "profiler.wait=0", "profiler.warmup=1", "profiler.active=6",
                       "metrics.utilization=false"])
    results = run(cfg, tmp_path)
    for name in ("trace.json", "ops_by_self_cpu.txt", "ops_by_cpu_memory.txt", "profile_summary.json"):
        assert (tmp_path / name).is_file(), f"{name} missing from {sorted(p.name for p in tmp_path.iterdir())}"
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any(e.get("name") == "decode" for e in trace["traceEvents"])
    summary = json.loads((tmp_path / "profile_summary.json").read_text())
    assert summary["ranges"]["decode"]["count"] >= 4
    assert summary["top_self_cpu"] and summary["totals"]["self_cpu_total_ms"] > 0
    assert "profile/host_syncs" in results and results["profile/range_decode_ms"] > 0
    assert (tmp_path / "memory_timeline.html").is_file() or (tmp_path / "memory_timeline.error.txt").is_file()
    error = tmp_path / "memory_timeline.error.txt"
    if not torch.cuda.is_available():   # NOTE: on CPU the timeline is written, without torch's deprecation warning
        assert not error.exists(), error.read_text()


def test_host_syncs_are_counted_with_call_sites() -> None:
    from torch.profiler import ProfilerActivity, profile

    from lab.profiling.analysis import sync_counts

    x = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(3):
            (x @ x).sum().item()
    counts = sync_counts(list(prof.events()))
    assert counts["by_op"].get("aten::item", 0) == 3, counts
    assert any("test_profiling.py" in site for site in counts["call_sites"]), counts["call_sites"]


def test_ranges_are_no_ops_unless_enabled() -> None:
    from contextlib import nullcontext

    assert isinstance(profile_range("decode"), nullcontext)
    set_ranges_enabled(True)
    try:
        assert not isinstance(profile_range("decode"), nullcontext)
    finally:
        set_ranges_enabled(False)


@pytest.mark.gpu
def test_torch_profiler_on_cuda_reports_kernels_and_idle_gaps(tmp_path: Path) -> None:
    cfg = compose_cfg(["model=tiny", "model.device=cuda", "+model.source.with_tokenizer=false",  # NOTE: no GGUF there
                       "+model.source.vocab_size=128", "workload.num_prompts=2", "workload.input_len=16",
                       "workload.output_len=6", "profiler=torch", "profiler.wait=0", "profiler.active=5",
                       "metrics.utilization=false", "logger=none"])   # NOTE: the GPU image has no wandb
    results = run(cfg, tmp_path)
    assert (tmp_path / "kernels.txt").is_file()
    assert 0.0 <= results["profile/device_idle_share"] <= 1.0


def test_bench_decode_graphs_profiles_a_speculative_step(tiny_runner: ModelRunner) -> None:
    """experiments/bench_decode_graphs.py --profile: the engine's labelled ranges reach the table (here on CPU; the
    GPU check runs it on an eager verify step, whose time on the H200 session 15 could not explain)."""
    bench = load_experiment("bench_decode_graphs")
    engine = bench.filled_engine(tiny_runner, 2, 20, max_tokens=16, num_spec_tokens=2,
                                 proposer=DFlashProposerConfig(checkpoint=None, drafter={"block_size": 3}))
    table = bench.profile_steps(engine, 2)
    assert all(name in table for name in ("decode", "draft", "attention", "Self CPU"))
    assert not isinstance(profile_range("probe"), record_function)   # the ranges are off again after the profile
