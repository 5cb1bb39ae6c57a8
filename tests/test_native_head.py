"""The head's greedy screen (lab/models/native_head.py): its argmax is the full head's (`argmax_rows` over the native
GEMV's logits on the same Q8_0 blocks) for any row count and thread count, through ties and near-ties a quantum
apart, zero and huge inputs and non-finite ones; the runner uses it only for greedy rows and only while the head's
blocks are its own; engines decode the same tokens with it on and off."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import torch

from lab.engines.ar import AREngine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.engines.speculative import SpeculativeEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig
from lab.models import native_gemv, native_head, weight_blocks
from lab.models.sources import tiny
from lab.runner import ModelRunner
from lab.sample.sampler import GreedyRows, Sampler, argmax_rows
from lab.sched import SchedulerConfig
from lab.spec.ngram_config import NgramProposerConfig
from tests.helpers import block_source, chat_prompt, make_requests

needs_screen = pytest.mark.skipif(not native_head.supported(),
                                  reason="the screen needs the native kernels and AVX-512 VNNI")

KV = PagedKVCacheConfig(block_size=4, num_blocks=128, kv_cache_memory_mb=None)


def q8_0_head(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    """A random head made of Q8_0 blocks, int8 (vocab, hidden / 32 * 36)."""
    weight = weight_blocks.round_to_q8_0(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)))
    blocks = weight_blocks.find_blocks(weight, "q8_0")
    assert blocks is not None
    return blocks


def full_argmax(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    return native_gemv.argmax_rows(native_gemv.gemv(x, blocks))


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


@needs_screen
def test_the_screen_finds_the_full_heads_argmax_at_every_row_count(threads: int) -> None:
    blocks = q8_0_head(2048, 192, seed=0)
    screen = native_head.HeadScreen(blocks)
    generator = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 5, 7, 8, 9, 12, 16, 17, 33, 64):
        x = torch.randn(rows, 192, generator=generator) * torch.rand(rows, 1, generator=generator) * 4
        x[0, 32:64] = 0.0                         # NOTE: a block of zeros: no scale to quantize with
        x[-1, 5] = 1e4                            # NOTE: one column far above the rest of its block
        assert torch.equal(screen.argmax(x), full_argmax(x, blocks)), rows
    x = torch.randn(2, 3, 192, generator=generator)
    assert torch.equal(screen.argmax(x), full_argmax(x.view(6, 192), blocks).view(2, 3))


@needs_screen
def test_ties_keep_the_lowest_token_and_near_ties_are_settled_exactly() -> None:
    weight = weight_blocks.round_to_q8_0(torch.randn(512, 64, generator=torch.Generator().manual_seed(2)))
    blocks = weight_blocks.find_blocks(weight, "q8_0")
    assert blocks is not None
    parts = blocks.view(512, 2, 36)
    parts[300] = parts[40]                        # NOTE: token 300's row is token 40's: equal logits
    parts[41] = parts[40]
    parts[41, 1, 4 + 7] += 1 if parts[41, 1, 4 + 7] < 127 else -1   # NOTE: one quantum from token 40's row
    screen = native_head.HeadScreen(blocks)
    row = weight_blocks.unpack(blocks)[40]
    x = torch.stack([row, row * 1e-3, -row, row + 1e-6 * torch.arange(64.0)])
    expected = full_argmax(x, blocks)
    assert torch.equal(screen.argmax(x), expected)
    assert expected[0].item() in (40, 41)         # NOTE: the tie between 40 and 300 goes to 40


@needs_screen
def test_rows_with_nan_or_inf_take_the_full_head() -> None:
    blocks = q8_0_head(256, 64, seed=3)
    screen = native_head.HeadScreen(blocks)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
        x[1, 9] = bad
        assert torch.equal(screen.argmax(x), full_argmax(x, blocks)), bad


def test_only_q8_0_heads_of_16_row_groups_are_screened() -> None:
    blocks = q8_0_head(256, 64, seed=5)
    assert native_head.can_screen(blocks)
    assert not native_head.can_screen(blocks[:250])
    assert not native_head.can_screen(None)
    q4_1 = weight_blocks.find_blocks(weight_blocks.round_to_q4_1(torch.randn(32, 64)), "q4_1")
    assert not native_head.can_screen(q4_1)
    with pytest.raises(ValueError, match="multiple of 16"):
        native_head.HeadScreen(blocks[:250])


def screen_bound(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """(rows, out): how far a screen value may be from the exact product, E = sum_b |d| |q|_1 S_b / 2 (S_b: x's int8
    scale in block b), plus fp32 rounding."""
    rows, out, nb = x.shape[0], blocks.shape[0], x.shape[1] // 32
    parts = blocks.view(out, nb, weight_blocks.Q8_0_BYTES)
    d = parts[..., :4].contiguous().view(torch.float32).view(out, nb)
    l1 = d.abs() * parts[..., 4:].to(torch.float32).abs().sum(-1)                    # (out, nb)
    scale = x.view(rows, nb, 32).abs().amax(-1) / 127                                # (rows, nb)
    return (scale / 2) @ l1.T * 1.01 + 1e-5 * (x.abs() @ weight_blocks.unpack(blocks).abs().T)


@needs_screen
def test_int8_products_stay_within_the_screens_bound_at_every_row_count(threads: int) -> None:
    """Int8Weight (engine.proposer.weights=int8): x W^T with x rounded to int8 per 32 columns, summed in integers,
    plus the bias; each value within the screen's bound of the exact product; any leading shape, any number of rows."""
    blocks = q8_0_head(96, 128, seed=11)
    weight, bias = weight_blocks.unpack(blocks), torch.randn(96)
    int8 = native_head.Int8Weight(blocks)
    generator = torch.Generator().manual_seed(12)
    for rows in (1, 2, 3, 4, 7, 8, 9, 13, 33, 64):
        x = torch.randn(rows, 128, generator=generator) * torch.rand(rows, 1, generator=generator) * 4
        exact = x @ weight.T
        products = int8.products(x)
        assert ((products - exact).abs() <= screen_bound(x, blocks)).all(), rows
        assert (products - exact).abs().max() > 0, "the inputs are rounded"
        torch.testing.assert_close(int8.products(x.view(1, rows, 128), bias), (products + bias).view(1, rows, 96))
    many = torch.randn(2, 70, 128, generator=generator)           # more rows than a call takes: 64 at a time
    assert torch.equal(int8.products(many, bias).view(140, 96),
                       torch.cat([int8.products(part, bias) for part in many.view(140, 128).split(64)]))
    errors = (int8.products(many) - many @ weight.T).view(140, 96).abs()
    assert (errors <= screen_bound(many.view(140, 128), blocks)).all()
    with pytest.raises(RuntimeError, match="fp32 rows of 128"):
        int8.products(torch.randn(2, 64))


@needs_screen
def test_int8_products_of_a_row_slice_and_of_non_finite_rows() -> None:
    blocks = q8_0_head(96, 64, seed=13)
    int8 = native_head.Int8Weight(blocks)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(14))
    part = int8.rows(slice(32, 80))
    assert part is not None and part.out_features == 48
    assert part.screen.data_ptr() == int8.screen[2].data_ptr(), "a view of the same bytes"
    torch.testing.assert_close(part.products(x), int8.products(x)[:, 32:80])
    assert int8.rows(slice(8, 48)) is None and int8.rows(slice(0, 96, 2)) is None, "a cut group, a stride"
    x[1, 5] = float("inf")
    assert int8.products(x).isnan().all(), "a non-finite input: no products, not a crash"


def test_greedy_rows_stand_in_for_logits() -> None:
    rows = GreedyRows(torch.tensor([5, 7, 9]))
    assert len(rows) == 3 and torch.equal(argmax_rows(rows[1:]), torch.tensor([7, 9]))
    assert Sampler().sample(rows, [make_requests([[1]], 1)[0].sampling_params] * 3, [None] * 3) == [5, 7, 9]


@pytest.fixture(scope="module")
def screened_runners() -> tuple[ModelRunner, ModelRunner]:
    """A tiny model made of blocks (a tied Q8_0 head of 256 tokens: 16 groups), with the screen and without."""
    source = block_source()
    return (ModelRunner(source, dtype="float32", device="cpu", block_kernel="avx"),
            ModelRunner(source, dtype="float32", device="cpu", block_kernel="avx", greedy_head="off"))


@needs_screen
def test_the_runner_screens_greedy_rows_only_while_the_head_is_its_blocks(
        screened_runners: tuple[ModelRunner, ModelRunner]) -> None:
    screened, plain = screened_runners
    assert screened.greedy_head and not plain.greedy_head
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(7))
    results = []
    for runner in screened_runners:
        cache = runner.allocate_kv_cache(1, 32)
        cache.begin_forward(0, 12)
        logits = runner.execute(tokens, torch.arange(12)[None], cache, logits_index=None)       # (1, 12, V)
        cache.begin_forward(0, 12)
        greedy = runner.execute(tokens, torch.arange(12)[None], cache, logits_index=None, greedy=True)
        assert greedy.shape == (1, 12) and greedy.dtype == torch.long
        assert torch.equal(greedy, argmax_rows(logits))
        results.append(greedy)
    assert torch.equal(results[0], results[1])
    model = screened.model
    hidden = torch.randn(3, model.config.hidden_size)
    assert model.greedy_tokens(hidden) is not None
    assert model.greedy_tokens(torch.randn(65, model.config.hidden_size)) is None, "more rows than the GEMV takes"
    saved = model.lm_head.blocks
    try:
        model.lm_head.blocks = saved.clone()           # NOTE: blocks other than the screen's: it steps aside
        assert model.greedy_tokens(hidden) is None
    finally:
        model.lm_head.blocks = saved


def test_greedy_head_setting_is_checked() -> None:
    with pytest.raises(LabError, match="model.greedy_head='on'") as error:
        ModelRunner(tiny(seed=0, vocab_size=128, with_tokenizer=False), device="cpu", greedy_head="on")
    assert "greedy_head=auto" in error.value.fix


@needs_screen
def test_engines_decode_the_same_tokens_with_the_screen_on_and_off(
        screened_runners: tuple[ModelRunner, ModelRunner]) -> None:
    """Greedy requests take the screen; one asking for logprobs makes its steps compute the logits again."""
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (6, 19, 27)]
    outputs = []
    for runner in screened_runners:
        engines = (AREngine(runner), ContinuousBatchingEngine(runner, SchedulerConfig(max_num_seqs=3), KV),
                   SpeculativeEngine(runner, NgramProposerConfig(), num_spec_tokens=3,
                                     scheduler=SchedulerConfig(max_num_seqs=2), kv_cache=KV))
        for engine in engines:
            requests = make_requests(prompts, 16, ignore_eos=True)
            requests[1].sampling_params.logprobs = 2
            result = engine.run(requests)
            assert result.requests[1].output_logprobs is not None
            outputs.append([r.output_token_ids for r in result.requests])
    assert all(out == outputs[0] for out in outputs)


@needs_screen
def test_the_bundled_smollm2s_head_is_screened_to_the_same_tokens(smollm2_runner: ModelRunner) -> None:
    """SmolLM2's own Q8_0 head, on a chat prompt's every position and on random rows far from its hidden states."""
    runner = smollm2_runner
    assert runner.greedy_head and runner.model.head_screen is not None
    prompt = torch.tensor([chat_prompt(runner.tokenizer, "Name three rivers of Europe and the seas they reach.")])
    steps = prompt.shape[1]
    assert steps <= 64
    results = []
    for greedy in (False, True):
        cache = runner.allocate_kv_cache(1, steps)
        cache.begin_forward(0, steps)
        results.append(runner.execute(prompt, torch.arange(steps)[None], cache, logits_index=None, greedy=greedy))
    assert torch.equal(argmax_rows(results[0]), results[1])
    x = torch.randn(9, runner.config.hidden_size, generator=torch.Generator().manual_seed(9)) * 3
    blocks = runner.model.lm_head.fresh_blocks()
    assert torch.equal(runner.model.greedy_tokens(x), full_argmax(x, blocks))


def test_the_screen_is_built_wherever_the_cpu_and_a_compiler_allow() -> None:
    """A kernel that fails to compile would only make the tests above skip: this one fails instead."""
    if not (native_gemv.cpu_has("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512_vnni")
            and shutil.which("c++") and os.environ.get("LAB_NATIVE_GEMV", "1") != "0"):
        pytest.skip("no AVX-512 VNNI or no C++ compiler here")
    assert native_gemv.load_kernel() is not None, native_gemv._KERNEL_ERROR
    assert native_head.supported()
