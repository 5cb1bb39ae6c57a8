"""Weights streamed as their exact GGUF blocks (lab/models/weight_blocks.py): blocks are found only where a weight
is made of them, the native GEMV over blocks is bit-identical to the fp32 GEMV over the values they hold (any row
count, the leftover rows, a bias), and a model streaming them decodes exactly as with fp32 weights and as HF."""

from __future__ import annotations

import pytest
import torch

from lab.engines.ar import AREngine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.engines.speculative import SpeculativeEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig
from lab.models import block_rows, native_gemv, native_tiles, weight_blocks
from lab.models.packed_linear import BLOCK_MAX_ROWS, NATIVE_MAX_ROWS, PackedLinear
from lab.models.sources import tiny
from lab.runner import ModelRunner
from lab.sched import SchedulerConfig
from lab.spec.ngram_config import NgramProposerConfig
from tests.helpers import block_source, hf_greedy, load_experiment, make_requests

needs_kernel = pytest.mark.skipif(native_gemv.load_kernel() is None, reason="the native GEMV cannot be built here")

KV = PagedKVCacheConfig(block_size=4, num_blocks=128, kv_cache_memory_mb=None)
ROUNDERS = {"q4_1": weight_blocks.round_to_q4_1, "q8_0": weight_blocks.round_to_q8_0}


@pytest.mark.parametrize("fmt", weight_blocks.FORMATS)
def test_blocks_are_found_exactly_where_a_weight_is_made_of_them(fmt: str) -> None:
    generator = torch.Generator().manual_seed(0)
    raw = torch.randn(40, 96, generator=generator) * 0.05
    weight = ROUNDERS[fmt](raw)
    blocks = weight_blocks.find_blocks(weight, fmt)
    assert blocks is not None and weight_blocks.block_format(blocks) == fmt
    assert blocks.shape == (40, 96 // 32 * weight_blocks.block_bytes(fmt))
    assert torch.equal(weight_blocks.unpack(blocks), weight)
    assert weight_blocks.find_blocks(raw, fmt) is None, "a random fp32 weight is not made of blocks"
    assert weight_blocks.find_blocks(weight[:, :40].contiguous(), fmt) is None, "in % 32 != 0"
    assert weight_blocks.find_blocks(weight.to(torch.float64), fmt) is None
    one_off = weight.clone()
    one_off[3, 5] = torch.nextafter(one_off[3, 5], torch.tensor(1.0))
    assert weight_blocks.find_blocks(one_off, fmt) is None, "one value an ulp off a block value"


def test_a_negative_zero_is_not_a_block_value() -> None:
    """Bitwise: a dequantizer never writes -0.0 (q is an integer), and the kernel would widen it to +0.0."""
    weight = weight_blocks.round_to_q8_0(torch.randn(4, 64, generator=torch.Generator().manual_seed(1)))
    weight[2, 7] = 0.0                                   # NOTE: q = 0 is a Q8_0 value in any block
    assert weight_blocks.find_blocks(weight, "q8_0") is not None
    weight[2, 7] = -0.0
    assert weight_blocks.find_blocks(weight, "q8_0") is None


def test_constant_blocks_round_trip() -> None:
    weight = torch.zeros(4, 64)                          # NOTE: all zero: d = 0 in either format
    assert torch.equal(weight_blocks.unpack(weight_blocks.find_blocks(weight, "q8_0")), weight)
    weight[1] = 0.25                                     # NOTE: max == min: Q4_1's d = 0, m = 0.25, every q = 0
    assert torch.equal(weight_blocks.unpack(weight_blocks.find_blocks(weight, "q4_1")), weight)


@pytest.fixture(params=[False, True], ids=["avx2", "avx512"])
def block_isa(request: pytest.FixtureRequest):
    """The block GEMV's AVX2 path, then its AVX-512 one (two weight rows to a register, input rows in chunks of up to
    9) where this CPU has AVX-512F/VL."""
    if native_gemv.load_kernel() is None:
        pytest.skip("the native GEMV cannot be built here")
    default = native_gemv.blocks_avx512()
    if native_gemv.blocks_avx512(request.param) != request.param:
        native_gemv.blocks_avx512(default)
        pytest.skip("this CPU lacks AVX-512F/VL")
    yield request.param
    native_gemv.blocks_avx512(default)


@pytest.mark.parametrize("fmt", weight_blocks.FORMATS)
@pytest.mark.parametrize("shape", [(576, 576), (4 * 37 + 3, 96), (3, 32), (64, 1536), (1501, 96)])
def test_block_gemv_is_bit_identical_to_the_fp32_gemv(fmt: str, shape: tuple[int, int], block_isa: bool) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    weight = ROUNDERS[fmt](torch.randn(*shape, generator=generator) * 0.05)
    blocks = weight_blocks.find_blocks(weight, fmt)
    bias = torch.randn(shape[0], generator=generator)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 19, 64):
        x = torch.randn(rows, shape[1], generator=generator)
        assert torch.equal(native_gemv.gemv(x, blocks, bias), native_gemv.gemv(x, weight, bias)), rows
        assert torch.equal(native_gemv.gemv(x, blocks)[rows // 2], native_gemv.gemv(x[rows // 2], blocks))


@needs_kernel
def test_block_gemv_names_bad_input() -> None:
    blocks = weight_blocks.find_blocks(weight_blocks.round_to_q4_1(torch.randn(8, 64)), "q4_1")
    with pytest.raises(RuntimeError, match="rows of 64 values"):
        native_gemv.gemv(torch.randn(1, 48), blocks)
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        native_gemv.gemv(torch.randn(65, 64), blocks)


@pytest.fixture(scope="module")
def block_runners() -> tuple[ModelRunner, ModelRunner]:
    """block_source streaming its blocks in forwards of up to BLOCK_MAX_ROWS rows, and not at all."""
    source = block_source()
    return (ModelRunner(source, dtype="float32", device="cpu", block_rows=BLOCK_MAX_ROWS, block_kernel="avx"),
            ModelRunner(source, dtype="float32", device="cpu", weight_blocks="off"))


@pytest.fixture(scope="module")
def wide_block_runner() -> ModelRunner:
    """block_source streaming its blocks in every forward the native GEMV serves (up to NATIVE_MAX_ROWS rows)."""
    return ModelRunner(block_source(), dtype="float32", device="cpu", block_rows=NATIVE_MAX_ROWS, block_kernel="avx")


@needs_kernel
def test_a_model_made_of_blocks_streams_them_and_decodes_bit_identically(
        block_runners: tuple[ModelRunner, ModelRunner]) -> None:
    blocks, fp32 = block_runners
    assert blocks.block_linears == 3 * 4 + 1 and fp32.block_linears == 0
    assert isinstance(blocks.model.lm_head, PackedLinear) and blocks.model.lm_head.blocks.dtype == torch.int8
    assert blocks.streamed_weight_bytes < fp32.streamed_weight_bytes / 3
    assert all(layer[i].dtype == torch.uint8 for layer in blocks.model._native_decode_layers() for i in (1, 3, 5, 6))
    # NOTE: from BLOCK_MAX_ROWS + 1 rows the fp32 weights' sweep is as fast: steps that large keep them
    wide = blocks.model._native_decode_layers(BLOCK_MAX_ROWS + 1)
    assert all(layer[i].dtype == torch.float32 for layer in wide for i in (1, 3, 5, 6))
    head = blocks.model.lm_head
    calls = []
    real = native_gemv.gemv
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setattr(native_gemv, "gemv", lambda x, w, b=None: calls.append(w.dtype) or real(x, w, b))
        for rows in (1, BLOCK_MAX_ROWS, BLOCK_MAX_ROWS + 1):
            head(torch.randn(rows, head.in_features))
    assert calls == [torch.int8, torch.int8, torch.float32]
    caches = [r.allocate_kv_cache(1, 64) for r in block_runners]
    prompt = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    logits = []
    for runner, cache in zip(block_runners, caches):
        cache.begin_forward(0, 7)
        logits.append(runner.execute(prompt, torch.arange(7)[None], cache))
    for position in range(7, 30):                         # NOTE: decode_layers, the fused one-call path
        token = logits[0].argmax(-1, keepdim=True)
        logits = []
        for runner, cache in zip(block_runners, caches):
            cache.begin_forward(position, 1)
            logits.append(runner.execute(token, torch.tensor([[position]]), cache))
        assert torch.equal(logits[0], logits[1]), position


@needs_kernel
def test_steps_of_up_to_12_rows_stream_blocks_where_asked_and_stay_bit_identical(
        block_runners: tuple[ModelRunner, ModelRunner], wide_block_runner: ModelRunner) -> None:
    wide, fp32 = wide_block_runner, block_runners[1]
    assert wide.model.block_max_rows == NATIVE_MAX_ROWS
    assert all(layer[i].dtype == torch.uint8 for layer in wide.model._native_decode_layers(NATIVE_MAX_ROWS)
               for i in (1, 3, 5, 6))
    assert {m.block_max_rows for m in wide.model.modules() if isinstance(m, PackedLinear)} == {NATIVE_MAX_ROWS}
    caches = [r.allocate_kv_cache(1, 64) for r in (wide, fp32)]
    tokens = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    for start, width in ((0, 12), (12, 9), (21, 6), (27, 1)):      # NOTE: prefill-sized and verify-sized steps
        logits = []
        for runner, cache in zip((wide, fp32), caches):
            cache.begin_forward(start, width)
            logits.append(runner.execute(tokens[:, start:start + width], torch.arange(start, start + width)[None],
                                         cache, logits_index=None))
        assert torch.equal(logits[0], logits[1]), (start, width)


def test_block_rows_keeps_blocks_up_to_the_last_row_count_where_they_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule on a made-up clock: fp32 costs 1 a row, blocks 0.7 + 0.03 x rows a row, so blocks win at 6 and 8
    rows and lose at 12; a count after the first loss is not measured."""
    clock = [0.0]
    monkeypatch.setattr(block_rows.time, "perf_counter", lambda: clock[0])

    def fake_gemv(x: torch.Tensor, weight: torch.Tensor) -> None:
        rows = x.shape[0]
        clock[0] += rows * (1.0 if weight.dtype == torch.float32 else 0.7 + 0.03 * rows)

    monkeypatch.setattr(block_rows.native_gemv, "gemv", fake_gemv)
    pairs = [(torch.zeros(4, 32), torch.zeros(4, 24, dtype=torch.uint8))] * 6
    measured = block_rows.measure_block_rows(pairs, floor=5, candidates=(12, 6, 8, 10, 16), reps=2)
    assert measured.max_rows == 10 and list(measured.speedups) == [6, 8, 10, 12]
    assert measured.speedups[6] == pytest.approx(1 / 0.88) and measured.speedups[12] < 1
    assert block_rows.measure_block_rows(pairs, floor=5, candidates=(12,)).max_rows == 5


@pytest.mark.parametrize("avx2_cost,kept", [(1.0, True), (0.97, True), (0.9, False)])
def test_block_isa_keeps_avx512_unless_avx2_is_clearly_faster(monkeypatch: pytest.MonkeyPatch, avx2_cost: float,
                                                              kept: bool) -> None:
    """The rule on a made-up clock: AVX-512 costs 1 a row; AVX2 `avx2_cost`. A 3 % edge for AVX2 is noise (AVX-512,
    the default, stays), a 10 % one switches; the choice is what the kernel is left set to."""
    clock, isa = [0.0], [True]
    monkeypatch.setattr(block_rows.time, "perf_counter", lambda: clock[0])
    monkeypatch.delenv("LAB_BLOCKS_AVX512", raising=False)

    def fake_isa(enabled: bool | None = None) -> bool:
        if enabled is not None:
            isa[0] = enabled
        return isa[0]

    def fake_gemv(x: torch.Tensor, weight: torch.Tensor) -> None:
        clock[0] += x.shape[0] * (1.0 if isa[0] else avx2_cost)

    monkeypatch.setattr(block_rows.native_gemv, "blocks_avx512", fake_isa)
    monkeypatch.setattr(block_rows.native_gemv, "gemv", fake_gemv)
    pairs = [(torch.zeros(4, 32), torch.zeros(4, 24, dtype=torch.uint8))] * 6
    measured = block_rows.measure_block_isa(pairs, reps=2)
    assert measured.avx512 is kept and isa[0] is kept
    assert list(measured.speedups) == list(block_rows.ISA_ROWS)
    assert measured.speedups[7] == pytest.approx(avx2_cost)
    monkeypatch.setenv("LAB_BLOCKS_AVX512", "1")           # NOTE: a fixed choice is not measured
    assert block_rows.measure_block_isa(pairs) is None


@needs_kernel
def test_block_rows_auto_measures_at_load() -> None:
    runner = ModelRunner(block_source(), dtype="float32", device="cpu", block_kernel="avx")
    assert runner.model.block_max_rows in (BLOCK_MAX_ROWS, *block_rows.CANDIDATE_ROWS)
    assert {m.block_max_rows for m in runner.model.modules() if isinstance(m, PackedLinear)} == {
        runner.model.block_max_rows}


@pytest.mark.parametrize("value", [0, 65, "fast", 6.5, True])
def test_block_rows_setting_is_checked(value: object) -> None:
    with pytest.raises(LabError, match="model.block_rows") as error:
        ModelRunner(block_source(), device="cpu", block_rows=value)
    assert "auto" in error.value.fix and "1 to 64" in error.value.fix


@needs_kernel
@pytest.mark.parametrize("wide", [False, True], ids=["blocks to 5 rows", "blocks to 12 rows"])
def test_engines_on_blocks_equal_hf_greedy(block_runners: tuple[ModelRunner, ModelRunner],
                                           wide_block_runner: ModelRunner, wide: bool) -> None:
    runner = wide_block_runner if wide else block_runners[0]
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 17, 30)]
    references = [hf_greedy(runner, p, 20) for p in prompts]
    engines = (AREngine(runner), ContinuousBatchingEngine(runner, SchedulerConfig(max_num_seqs=3), KV),
               SpeculativeEngine(runner, NgramProposerConfig(), num_spec_tokens=3,
                                 scheduler=SchedulerConfig(max_num_seqs=2), kv_cache=KV))   # NOTE: verify rows
    for engine in engines:
        result = engine.run(make_requests(prompts, 20, ignore_eos=True))
        assert [r.output_token_ids for r in result.requests] == references, type(engine).__name__


def test_a_model_not_made_of_blocks_keeps_fp32(tiny_runner: ModelRunner) -> None:
    assert tiny_runner.block_linears == 0
    assert tiny_runner.streamed_weight_bytes == tiny_runner.weight_bytes


def test_weight_blocks_setting_is_checked() -> None:
    with pytest.raises(LabError, match="model.weight_blocks='q4'"):
        ModelRunner(tiny(seed=0, vocab_size=128, with_tokenizer=False), device="cpu", weight_blocks="q4")
    with pytest.raises(LabError, match="model.block_kernel='sse'") as error:
        ModelRunner(tiny(seed=0, vocab_size=128, with_tokenizer=False), device="cpu", block_kernel="sse")
    assert "block_kernel=auto" in error.value.fix


def test_the_bundled_smollm2_is_streamed_as_its_gguf_blocks(smollm2_runner: ModelRunner) -> None:
    """Every projection of the Q4_1 GGUF (and its Q8_0 tied head) is found exactly; a decode step reads ~5x fewer
    bytes. test_engines_greedy's SmolLM2 test checks these runs against HF token for token."""
    if not native_gemv.AVAILABLE:
        pytest.skip("the native GEMV cannot be built here")
    assert smollm2_runner.block_linears == 30 * 4 + 1
    assert smollm2_runner.block_kernel == ("amx" if native_tiles.available() else "avx")
    assert smollm2_runner.streamed_weight_bytes < smollm2_runner.weight_bytes / 4.5


@needs_kernel
def test_bench_gemv_blocks_table_reports_bit_identical_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """experiments/bench_gemv.py --blocks: one row per row count, every output bit-identical to fp32."""
    bench = load_experiment("bench_gemv")
    bench.blocks_table([1, 3], reps=1, layers=1)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 2 and all(row.rstrip().endswith("| True |") for row in rows)
