"""Tensor parallelism: TP=2 greedy output equals TP=1 on CPU (gloo), started with torchrun, and the
sharding layout checked on its own (vocab ranges, divisibility)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lab.errors import LabError
from lab.models.config import DecoderConfig
from lab.parallel.layers import vocab_range
from lab.parallel.shard import check_divisible

ROOT = Path(__file__).resolve().parents[1]


def test_vocab_ranges_cover_the_vocab_once_with_equal_padded_shards() -> None:
    for vocab_size, world_size in ((128, 2), (127, 2), (10, 4), (49152, 8)):
        ranges = [vocab_range(vocab_size, r, world_size) for r in range(world_size)]
        covered = [i for start, end, _ in ranges for i in range(start, end)]
        assert covered == list(range(vocab_size)), (vocab_size, world_size)
        assert len({per_rank for _, _, per_rank in ranges}) == 1


def test_sharding_refuses_sizes_that_do_not_divide_the_heads() -> None:
    config = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                           max_position_embeddings=2048, tie_word_embeddings=False)
    check_divisible(config, 2)
    with pytest.raises(LabError, match="key/value heads"):
        check_divisible(config, 4)


@pytest.mark.slow
@pytest.mark.parametrize("gguf_blocks", [False, True], ids=["fp32", "gguf_blocks"])
def test_tp2_greedy_equals_tp1_under_torchrun(tmp_path: Path, gguf_blocks: bool) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "tp.json"
    # NOTE: tied embeddings and an odd vocabulary: the head shares the embedding's rows and the last shard is padded
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               f"--master-port={port}", "-m", "lab.parallel.check", "--tie", "--vocab-size", "127", "--out", str(out)]
    command += ["--gguf-blocks"] if gguf_blocks else []
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ar_tokens"] == result["reference_ar_tokens"]
    assert result["cb_paged_equal"], "cb_paged under the lockstep serving loop diverged from TP=1"
    assert result["max_abs_logit_diff"] < 1e-4, result["max_abs_logit_diff"]
    assert result["sampled_lengths"] == [12] * 4, "sampled requests did not finish in lockstep"
    assert (result["block_linears"] > 0) == gguf_blocks, "each shard streams the blocks of its rows"
