"""GGUF blocks through AMX tiles (lab/models/native_tiles.py): the tile layout holds the blocks' values exactly (any
CPU); where the CPU has AMX, the tile GEMV is within fp32 rounding of the fp32 GEMV, every row's result is the same
whatever rows it came with, and a model on tiles decodes as HF does, speculation included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lab.engines.ar import AREngine
from lab.engines.speculative import SpeculativeEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig
from lab.models import native_gemv, native_tiles, weight_blocks
from lab.models.packed_linear import GEMV_MAX_ROWS, PackedLinear, project_rows
from lab.runner import ModelRunner
from lab.sched import SchedulerConfig
from lab.spec.dflash import DFlashProposerConfig
from lab.spec.ngram_config import NgramProposerConfig
from tests.helpers import hf_greedy, load_experiment, make_requests
from tests.test_weight_blocks import block_source

needs_amx = pytest.mark.amx
ROUNDERS = {"q4_1": weight_blocks.round_to_q4_1, "q8_0": weight_blocks.round_to_q8_0}
KV = PagedKVCacheConfig(block_size=4, num_blocks=128, kv_cache_memory_mb=None)


def _blocks(fmt: str, out: int, inn: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    weight = ROUNDERS[fmt](torch.randn(out, inn, generator=torch.Generator().manual_seed(seed)) * 0.1)
    blocks = weight_blocks.find_blocks(weight, fmt)
    assert blocks is not None
    return weight, blocks


@pytest.mark.parametrize("fmt", weight_blocks.FORMATS)
def test_tiles_hold_the_blocks_values_exactly(fmt: str) -> None:
    weight, blocks = _blocks(fmt, 48, 96)
    tiles = native_tiles.pack(blocks)
    assert tiles is not None and native_tiles.is_tiles(tiles) and not native_tiles.is_tiles(blocks)
    assert tiles.shape == (3, 3, native_tiles.TILE_BYTES[fmt]) and tiles.dtype == blocks.dtype
    assert torch.equal(native_tiles.unpack(tiles), weight)


def test_pack_refuses_what_tiles_cannot_hold() -> None:
    assert native_tiles.pack(_blocks("q4_1", 40, 64)[1]) is None, "out rows not a multiple of 16"
    blocks = _blocks("q4_1", 16, 64)[1].clone()
    blocks[0, 4:8] = torch.tensor([0.1], dtype=torch.float32).view(torch.uint8)   # m = 0.1: not an fp16 value
    assert native_tiles.pack(blocks) is None


@needs_amx
@pytest.mark.parametrize("fmt", weight_blocks.FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 64])
def test_the_tile_gemv_is_within_fp32_rounding_and_row_independent(fmt: str, rows: int) -> None:
    weight, blocks = _blocks(fmt, 96, 192, seed=rows)
    tiles = native_tiles.pack(blocks)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(96)
    y = native_gemv.gemv(x, tiles, bias)
    exact = x.double() @ weight.double().T + bias.double()
    scale = x.double().abs() @ weight.double().abs().T + bias.double().abs()
    assert float(((y.double() - exact).abs() / scale).max()) < 2e-7
    for row in {0, rows // 2, rows - 1}:                  # NOTE: a verify step's rows are its decodes' rows
        assert torch.equal(native_gemv.gemv(x[row:row + 1], tiles, bias), y[row:row + 1])
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        native_gemv.gemv(torch.randn(65, 192), tiles)


@pytest.fixture(scope="module")
def tile_runner() -> ModelRunner:
    """block_source (its every output dim a multiple of 16: hidden 64, QKV 128, MLP 2 x 128, vocab 256) on tiles."""
    return ModelRunner(block_source(), dtype="float32", device="cpu", block_kernel="amx")


@needs_amx
def test_a_model_on_tiles_streams_them_in_every_few_row_forward(tile_runner: ModelRunner) -> None:
    assert tile_runner.block_kernel == "amx" and tile_runner.block_linears == 3 * 4 + 1
    assert tile_runner.model.block_max_rows == GEMV_MAX_ROWS
    linears = [m for m in tile_runner.model.modules() if isinstance(m, PackedLinear) and m.blocks is not None]
    assert linears and all(native_tiles.is_tiles(m.blocks) for m in linears)
    assert all(native_tiles.is_tiles(layer[i]) for layer in fused_tile_layers(tile_runner) for i in (1, 3, 5, 6))
    avx = ModelRunner(block_source(), dtype="float32", device="cpu", block_kernel="avx")
    assert avx.block_kernel == "avx" and not any(native_tiles.is_tiles(m.blocks) for m in avx.model.modules()
                                                 if isinstance(m, PackedLinear) and m.blocks is not None)
    assert tile_runner.streamed_weight_bytes < avx.streamed_weight_bytes


def fused_tile_layers(runner: ModelRunner) -> list[list[torch.Tensor]]:
    layers = runner.model._native_decode_layers(GEMV_MAX_ROWS)
    assert layers is not None
    return layers


@needs_amx
def test_engines_on_tiles_equal_hf_greedy_and_speculation_stays_lossless(tile_runner: ModelRunner) -> None:
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (6, 19, 33)]
    references = [hf_greedy(tile_runner, p, 24) for p in prompts]
    assert tile_runner.model.fused_max_rows == GEMV_MAX_ROWS      # NOTE: steps of 13-64 tokens: one native call
    engines = (AREngine(tile_runner),
               SpeculativeEngine(tile_runner, NgramProposerConfig(), num_spec_tokens=5,      # NOTE: 6-row verifies
                                 scheduler=SchedulerConfig(max_num_seqs=3), kv_cache=KV),
               SpeculativeEngine(tile_runner, NgramProposerConfig(), num_spec_tokens=20,     # NOTE: up to 21 rows
                                 scheduler=SchedulerConfig(max_num_seqs=1), kv_cache=KV))
    steps: list[int] = []
    real = native_gemv.paged_step_layers
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_gemv, "paged_step_layers", lambda x, *rest: steps.append(x.shape[1]) or real(x, *rest))
        for engine in engines:
            result = engine.run(make_requests(prompts, 24, ignore_eos=True))
            assert [r.output_token_ids for r in result.requests] == references, type(engine).__name__
    assert max(steps) > 12, "a verify step past the AVX path's 12 rows ran as one native call"


@needs_amx
def test_drafters_on_a_tile_target_stream_q8_0_tiles_and_stay_lossless(tile_runner: ModelRunner) -> None:
    """engine.proposer.weights=auto on a target on tiles: the drafter's linears stream Q8_0 tiles of their weights
    (rounded), the draft head (head_weights=auto) the target's own head tiles (exact), or with head_weights=q4_1
    Q4_1 tiles of them rounded; project_rows reads whole 16-row groups of them."""
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (7, 21)]
    expected = [r.output_token_ids for r in AREngine(tile_runner).run(make_requests(prompts, 16, ignore_eos=True)).requests]
    target_rows = tile_runner.model.lm_head.weight[:128]
    for head_weights, head_values in (("auto", target_rows), ("q4_1", weight_blocks.round_to_q4_1(target_rows))):
        config = DFlashProposerConfig(checkpoint=None, drafter={"block_size": 4}, draft_vocab_size=128,
                                      head_weights=head_weights)
        engine = SpeculativeEngine(tile_runner, config, num_spec_tokens=3, scheduler=SchedulerConfig(max_num_seqs=2),
                                   kv_cache=KV)
        head = engine.proposer.draft_head
        assert native_tiles.is_tiles(head.blocks) and torch.equal(native_tiles.unpack(head.blocks), head_values)
        linears = [m for m in engine.proposer.drafter.modules() if isinstance(m, PackedLinear)]
        assert linears and all(native_tiles.is_tiles(m.blocks) and m.block_max_rows == GEMV_MAX_ROWS for m in linears)
        outputs = engine.run(make_requests(prompts, 16, ignore_eos=True)).requests
        assert [r.output_token_ids for r in outputs] == expected
    qkv = engine.proposer.drafter.layers[0].qkv_proj
    rounded = weight_blocks.round_to_q8_0(qkv.weight)
    x = torch.randn(1, 5, qkv.in_features)
    with torch.inference_mode():
        whole = slice(qkv.out_features - 32, None)                # NOTE: whole 16-row groups: their tiles
        torch.testing.assert_close(project_rows(qkv, x, whole), F.linear(x, rounded[whole]), atol=1e-5, rtol=1e-5)
        cut = slice(8, 40)                                        # NOTE: a cut group: the live fp32 weight
        torch.testing.assert_close(project_rows(qkv, x, cut), F.linear(x, qkv.weight[cut]))


def test_block_kernel_amx_without_amx_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    if native_gemv.load_kernel() is None:
        pytest.skip("the native GEMV cannot be built here (no blocks to stream)")
    monkeypatch.setattr(native_tiles, "available", lambda: False)
    with pytest.raises(LabError, match="block_kernel=amx") as error:
        ModelRunner(block_source(), dtype="float32", device="cpu", block_kernel="amx")
    assert "block_kernel=auto" in error.value.fix
    assert ModelRunner(block_source(), dtype="float32", device="cpu").block_kernel == "avx"


@needs_amx
def test_bench_gemv_tiles_table_reports_each_row_count_within_fp32_rounding(
        capsys: pytest.CaptureFixture[str]) -> None:
    """experiments/bench_gemv.py --tiles: one row per row count, the tiles' error at fp32 rounding."""
    load_experiment("bench_gemv").tiles_table([1, 17], reps=1, layers=1)
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 17 |"))]
    assert len(rows) == 2 and all(float(row[-2]) < 2e-7 for row in rows)
