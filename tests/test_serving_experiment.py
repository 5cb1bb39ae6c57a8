"""experiments/serving.py end to end on the tiny model: each server of `serving_spec` runs its own engine as a
`lab-serve` subprocess (a fresh one per rate), a speculating one reports its acceptance length, and a server
that cannot start (DFlash's drafter was trained for SmolLM2, not for the tiny model) is recorded without losing
the other servers' rows."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import load_experiment


def test_a_failing_server_does_not_sink_the_serving_sweep(tmp_path: Path) -> None:
    load_experiment("serving").main([
        "+experiment=serving_spec", "~serving.servers.dflash_adaptive", "serving.model=tiny", "serving.rates=[inf]",
        "workload.num_prompts=2", "workload.output_len=16", "workload.num_warmups=0", f"serving.out_dir={tmp_path}"])
    saved = json.loads((tmp_path / "results.json").read_text())
    rows = {row["server"]: row for row in saved["rows"]}
    assert set(rows) == {"no_spec", "suffix"} and all(row["completed"] == 2 for row in rows.values())
    # NOTE: 16 tokens: the tiny model's greedy text repeats, so suffix decoding drafts (vLLM reports no tau without)
    assert rows["no_spec"]["tau"] is None and rows["suffix"]["tau"] >= 1.0, "tau only where the server speculates"
    assert all(0.0 <= row["prefix_hit_rate"] <= 1.0 for row in rows.values()), "both run on the paged KV cache"
    assert list(saved["failed_servers"]) == ["dflash"] and "server exited" in saved["failed_servers"]["dflash"]
    assert "trained for target" in (tmp_path / "dflash_rateinf.server.log").read_text()
    assert (tmp_path / "serving.png").exists() and "| suffix | inf |" in (tmp_path / "table.md").read_text()
