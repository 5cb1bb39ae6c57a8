"""The native fp32 batch-1 decode kernels (lab/models/native_gemv.py: GEMV on one row or a few, RMSNorm, add +
RMSNorm, RoPE, SiLU-and-mul, decode attention on a contiguous cache) match torch, a row's GEMV result does not
depend on the other rows, PackedLinear sends inputs of up to NATIVE_MAX_ROWS rows to the GEMV, and everything
still works with the kernels forced off (F.linear on MKL, column-major weights, SDPA).

The kernel is compiled on first use (a minute on a loaded 2-core machine, then cached), so the tests that
need it are skipped where it cannot be built.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from lab.engines.ar import AREngine
from lab.kv_cache.block_kv import BlockKVCache, SeqSlice
from lab.models import native_gemv, native_head, weight_blocks
from lab.models.packed_linear import (NATIVE_MAX_ROWS, PackedLinear, can_pack, pack_linear_weights,
                                       project_rows, use_draft_blocks, use_half_weights, use_int8_weights)
from lab.models.sources import tiny
from lab.runner import ModelRunner
from tests.helpers import load_experiment, make_requests

needs_kernel = pytest.mark.skipif(native_gemv.load_kernel() is None, reason="the native GEMV cannot be built here")


@pytest.fixture
def kernel_off() -> Iterator[None]:
    native_gemv.set_enabled(False)
    try:
        yield
    finally:
        native_gemv.set_enabled(True)


@pytest.fixture
def count_gemv(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = native_gemv.gemv

    def counting(*args: torch.Tensor | None) -> torch.Tensor:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(native_gemv, "gemv", counting)
    return calls


@needs_kernel
@pytest.mark.parametrize("gemv_threads", [1, 0, 2], ids=["one_thread", "torch_threads", "two_threads"])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (3, 5), (7, 13), (8, 8), (33, 17), (64, 576),
                                                      (129, 1000), (576, 1536), (960, 576), (5000, 40)])
def test_gemv_matches_f_linear(gemv_threads: int, out_features: int, in_features: int,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_gemv, "THREADS", gemv_threads)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
        w = torch.randn(out_features, in_features, generator=generator)
        b = torch.randn(out_features, generator=generator)
        for shape in [(in_features,), (1, in_features), (1, 1, in_features), (2, in_features), (1, 5, in_features),
                      (8, in_features), (3, 7, in_features)]:
            x = torch.randn(shape, generator=generator)
            for bias in (None, b):
                y = native_gemv.gemv(x, w, bias)
                reference = F.linear(x, w, bias)
                assert y.shape == reference.shape
                torch.testing.assert_close(y, reference, atol=1e-5 * in_features ** 0.5, rtol=1e-5)
    finally:
        torch.set_num_threads(saved)


@needs_kernel
@pytest.mark.parametrize("gemv_threads", [1, 2])
def test_gemv_rows_are_bit_identical_whatever_the_other_rows(gemv_threads: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify step's k + 1 rows must give each row exactly what a one-row decode gives it."""
    monkeypatch.setattr(native_gemv, "THREADS", gemv_threads)
    generator = torch.Generator().manual_seed(1)
    for out_features, in_features in [(960, 576), (37, 29), (5, 1536)]:
        w = torch.randn(out_features, in_features, generator=generator)
        b = torch.randn(out_features, generator=generator)
        x = torch.randn(7, in_features, generator=generator)
        together = native_gemv.gemv(x, w, b)
        for count in (1, 2, 3, 5):
            assert torch.equal(native_gemv.gemv(x[:count], w, b), together[:count])
        for i in range(len(x)):
            assert torch.equal(native_gemv.gemv(x[i], w, b), together[i])


@needs_kernel
def test_gemv_reads_strided_rows_and_non_contiguous_x() -> None:
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(50, 40, generator=generator)
    w = wide[:, 3:30]                                  # rows of 27 values, row stride 40
    x = torch.randn(27, 2, generator=generator)[:, 1]  # stride 2
    torch.testing.assert_close(native_gemv.gemv(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_gemv_rejects_what_it_cannot_compute() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="rows of 16"):
        native_gemv.gemv(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        native_gemv.gemv(torch.randn(65, 16), w)
    with pytest.raises(RuntimeError, match="row-major"):
        native_gemv.gemv(torch.randn(16), w.t().contiguous().t())
    with pytest.raises(RuntimeError, match="fp32"):
        native_gemv.gemv(torch.randn(16, dtype=torch.float64), w.double())


@needs_kernel
@pytest.mark.parametrize("gemv_threads", [1, 2])
@pytest.mark.parametrize("out_features,in_features", [(1, 8), (7, 13), (33, 16), (576, 1536), (8192, 576)])
def test_gemv_f16_is_the_fp32_product_of_the_rounded_weights(gemv_threads: int, out_features: int, in_features: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafters stream fp16 weights: the result is the fp32 product with the weights rounded to fp16."""
    monkeypatch.setattr(native_gemv, "THREADS", gemv_threads)
    generator = torch.Generator().manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features, generator=generator).half()
    b = torch.randn(out_features, generator=generator)
    for shape in [(in_features,), (1, 1, in_features), (2, in_features), (1, 5, in_features), (12, in_features)]:
        x = torch.randn(shape, generator=generator)
        for bias in (None, b):
            torch.testing.assert_close(native_gemv.gemv_f16(x, w, bias), F.linear(x, w.float(), bias),
                                       atol=1e-5 * in_features ** 0.5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="fp16 W"):
        native_gemv.gemv_f16(torch.randn(in_features), w.float())


@needs_kernel
def test_half_weights_serve_few_rows_and_step_aside_when_stale(count_gemv: list[int]) -> None:
    layer = _packed_layer(out_features=40, in_features=24)
    assert use_half_weights(torch.nn.Sequential(layer)) == 1 and layer.half_weight.dtype == torch.float16
    rounded = layer.weight.half().float()
    with torch.inference_mode():
        x = torch.randn(3, layer.in_features)
        torch.testing.assert_close(layer(x), F.linear(x, rounded, layer.bias), atol=1e-5, rtol=1e-5)
        many = torch.randn(NATIVE_MAX_ROWS + 1, layer.in_features)   # more rows: the fp32 GEMM
        torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert count_gemv[0] == 0
        with torch.no_grad():
            layer.weight.mul_(2)                   # the fp16 copy is stale now: the live fp32 weight serves
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert count_gemv[0] == 1


@needs_kernel
def test_project_rows_streams_part_of_the_fp16_copy() -> None:
    """project_rows (a drafter's K and V out of its fused QKV): the product with those rows of the weight, of the
    fp16 copy for a few rows, of the live fp32 weight for more rows, a plain nn.Linear or a stale copy."""
    layer = _packed_layer(out_features=40, in_features=24, bias=False)
    rows = slice(16, None)
    with torch.inference_mode():
        x, many = torch.randn(1, 3, layer.in_features), torch.randn(1, NATIVE_MAX_ROWS + 1, layer.in_features)
        torch.testing.assert_close(project_rows(layer, x, rows), F.linear(x, layer.weight[rows]))
        use_half_weights(torch.nn.Sequential(layer))
        torch.testing.assert_close(project_rows(layer, x, rows), F.linear(x, layer.weight[rows].half().float()),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(project_rows(layer, many, rows), F.linear(many, layer.weight[rows]))
        with torch.no_grad():
            layer.weight.mul_(2)                   # the fp16 copy is stale now: the live fp32 weight serves
        torch.testing.assert_close(project_rows(layer, x, rows), F.linear(x, layer.weight[rows]))
        plain = torch.nn.Linear(24, 40, bias=False)
        torch.testing.assert_close(project_rows(plain, x, rows), F.linear(x, plain.weight[rows]))


@needs_kernel
def test_q8_0_weights_serve_few_rows_rounded_and_keep_exact_blocks_exact(count_gemv: list[int]) -> None:
    """use_draft_blocks (drafters): a weight that is not made of blocks streams its Q8_0 rounding, one that is keeps
    its own blocks (lossless); more rows, a stale copy or an input dim off the 32-grid take the live fp32 weight."""
    layer = _packed_layer(out_features=48, in_features=64)
    assert use_draft_blocks(torch.nn.Sequential(layer)) == 1 and layer.blocks.dtype == torch.int8
    assert layer.half_weight is None
    rounded = weight_blocks.round_to_q8_0(layer.weight)
    assert torch.equal(weight_blocks.unpack(layer.blocks), rounded)
    with torch.inference_mode():
        x = torch.randn(3, layer.in_features)
        torch.testing.assert_close(layer(x), F.linear(x, rounded, layer.bias), atol=1e-5, rtol=1e-5)
        assert (layer(x) - F.linear(x, layer.weight, layer.bias)).abs().max() > 1e-6, "the rounding shows"
        rows = slice(16, None)
        torch.testing.assert_close(project_rows(layer, x, rows), F.linear(x, rounded[rows]), atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            layer.weight.mul_(2)                   # the blocks are stale now: the live fp32 weight serves
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(project_rows(layer, x, rows), F.linear(x, layer.weight[rows]))
    exact = _packed_layer(out_features=48, in_features=64)
    with torch.no_grad():
        exact.weight.copy_(weight_blocks.round_to_q4_1(exact.weight))
    use_draft_blocks(torch.nn.Sequential(exact))
    assert exact.blocks.dtype == torch.uint8, "a weight made of Q4_1 blocks streams them, not a rounding"
    with torch.inference_mode():
        x = torch.randn(2, exact.in_features)
        assert torch.equal(exact(x), native_gemv.gemv(x, exact.weight, exact.bias))
    assert use_draft_blocks(torch.nn.Sequential(_packed_layer(out_features=48, in_features=24))) == 0
    assert weight_blocks.quantize_q8_0(torch.randn(4, 24)) is None


@pytest.mark.skipif(not native_head.supported(), reason="int8 products need the native kernels and AVX-512 VNNI")
def test_int8_weights_serve_every_call_and_step_aside_when_stale() -> None:
    """use_int8_weights (drafters): calls take the weight's Q8_0 rounding in 8-bit integer products (its own blocks
    where it is made of them), project_rows a slice of them; a stale copy or output rows off the 16-row groups take
    the fp32 weight."""
    layer = _packed_layer(out_features=48, in_features=64)
    assert use_int8_weights(torch.nn.Sequential(layer)) == 1 and layer.half_weight is None and layer.blocks is None
    rounded = weight_blocks.round_to_q8_0(layer.weight)
    with torch.inference_mode():
        x = torch.randn(64, layer.in_features)
        assert torch.equal(layer(x), layer.int8.products(x, layer.bias))
        torch.testing.assert_close(layer(x), F.linear(x, rounded, layer.bias), atol=0.05, rtol=0.05)
        torch.testing.assert_close(project_rows(layer, x[:3], slice(16, None)), layer.int8.products(x[:3])[:, 16:])
        many = torch.randn(65, layer.in_features)       # more rows than one kernel call: still int8 products
        assert torch.equal(layer(many), layer.int8.products(many, layer.bias))
        with torch.no_grad():
            layer.weight.mul_(2)                        # stale now: the live fp32 weight serves
        torch.testing.assert_close(layer(x[:3]), F.linear(x[:3], layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    exact = _packed_layer(out_features=32, in_features=64)
    with torch.no_grad():
        exact.weight.copy_(rounded[:32])               # made of Q8_0 blocks: the rounding is those blocks, lossless
    use_int8_weights(torch.nn.Sequential(exact))
    own = weight_blocks.find_blocks(rounded[:32], "q8_0")
    assert torch.equal(exact.int8.screen, native_head.Int8Weight(own).screen)
    assert use_int8_weights(torch.nn.Sequential(_packed_layer(out_features=40, in_features=64))) == 0
    assert use_int8_weights(torch.nn.Sequential(_packed_layer(out_features=48, in_features=24))) == 0


@needs_kernel
def test_q4_1_draft_blocks_round_a_q8_0_head_and_keep_q4_1_blocks_exact() -> None:
    """use_draft_blocks(fmt="q4_1") (a draft head): a weight made of Q8_0 blocks (the target's head) streams its Q4_1
    rounding, llama.cpp's (round_to_q4_1); one made of Q4_1 blocks keeps its own (lossless); few rows read them."""
    head = _packed_layer(out_features=48, in_features=64, bias=False)
    with torch.no_grad():
        head.weight.copy_(weight_blocks.round_to_q8_0(head.weight))
    assert use_draft_blocks(torch.nn.Sequential(head), "q4_1") == 1 and head.blocks.dtype == torch.uint8
    rounded = weight_blocks.round_to_q4_1(head.weight)
    assert torch.equal(weight_blocks.unpack(head.blocks), rounded) and not torch.equal(rounded, head.weight)
    with torch.inference_mode():
        x = torch.randn(4, head.in_features)
        torch.testing.assert_close(head(x), F.linear(x, rounded), atol=1e-5, rtol=1e-5)
    exact = _packed_layer(out_features=48, in_features=64, bias=False)
    with torch.no_grad():
        exact.weight.copy_(weight_blocks.round_to_q4_1(exact.weight))
    use_draft_blocks(torch.nn.Sequential(exact), "q4_1")
    assert torch.equal(weight_blocks.unpack(exact.blocks), exact.weight), "Q4_1 blocks are kept as they are"
    assert weight_blocks.quantize_q4_1(torch.randn(4, 24)) is None


def _packed_layer(out_features: int = 37, in_features: int = 29, bias: bool = True) -> PackedLinear:
    if not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("PackedLinear needs fp32 on a CPU build with mkldnn")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=bias))
    pack_linear_weights(model)
    return model[0]


@needs_kernel
def test_packed_linear_sends_a_few_rows_to_the_kernel(count_gemv: list[int]) -> None:
    layer = _packed_layer()
    x = torch.randn(1, 1, layer.in_features)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert count_gemv[0] == 1
        few = torch.randn(1, NATIVE_MAX_ROWS, layer.in_features)   # a verify step, a small batch: the GEMV
        torch.testing.assert_close(layer(few), F.linear(few, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert count_gemv[0] == 2
        layer(torch.randn(1, NATIVE_MAX_ROWS + 1, layer.in_features))  # more rows: oneDNN, not the GEMV
        layer(torch.randn(0, layer.in_features))
        assert count_gemv[0] == 2
        x = torch.randn(1, 1, layer.in_features)
        with torch.no_grad():                      # the kernel reads the live weight: never stale
            layer.weight.mul_(2)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert count_gemv[0] == 3


@needs_kernel
def test_packed_linear_keeps_f_linear_for_autograd_and_column_major(count_gemv: list[int]) -> None:
    layer = _packed_layer()
    x = torch.randn(1, layer.in_features, requires_grad=True)
    layer(x).sum().backward()                      # grad enabled, weight requires grad: F.linear
    assert x.grad is not None and layer.weight.grad is not None
    assert count_gemv[0] == 0
    with torch.inference_mode():
        layer.weight.data = layer.weight.data.t().contiguous().t()   # column-major: MKL's gemv
        x = torch.randn(1, layer.in_features)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert count_gemv[0] == 0


def test_fallback_when_forced_off(kernel_off: None, count_gemv: list[int]) -> None:
    assert native_gemv.load_kernel() is None and not native_gemv.AVAILABLE
    layer = _packed_layer()
    x = torch.randn(1, layer.in_features)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert count_gemv[0] == 0
    runner = ModelRunner(tiny(), dtype="float32", device="cpu")
    weight = runner.model.layers[0].mlp.gate_up_proj.weight
    assert weight.stride(0) == 1, "without the kernel the runner keeps MKL's faster column-major layout"


@needs_kernel
@pytest.mark.parametrize("attention_bias", [False, True], ids=["llama", "qkv_bias"])
def test_fused_decode_layers_are_bit_identical_to_the_module_path(attention_bias: bool) -> None:
    """Batch-1 decode on the contiguous cache runs all layers in one native call (decode_layers); the logits
    and the cache must equal the per-module path's exactly, step after step."""
    source = tiny(seed=3, num_hidden_layers=3, with_tokenizer=False, vocab_size=96,
                  model_type="qwen2" if attention_bias else "llama")
    runners = [ModelRunner(source, dtype="float32", device="cpu") for _ in range(2)]
    fused, modules = runners
    modules.model._fused_layers = []                     # NOTE: [] = the fused path is off for this model
    calls = [0]
    real = native_gemv.decode_layers

    def counting(*args: object) -> torch.Tensor:
        calls[0] += 1
        return real(*args)

    caches = [r.allocate_kv_cache(1, 64) for r in runners]
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    logits = []
    for runner, cache in zip(runners, caches):
        cache.begin_forward(0, prompt.shape[1])
        logits.append(runner.execute(prompt, torch.arange(9)[None], cache))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_gemv, "decode_layers", counting)
        for position in range(9, 30):
            token = logits[0].argmax(-1, keepdim=True)                              # (1, 1)
            logits = []
            for runner, cache in zip(runners, caches):
                cache.begin_forward(position, 1)
                logits.append(runner.execute(token, torch.tensor([[position]]), cache))
            assert torch.equal(logits[0], logits[1]), f"step at position {position}"
    assert calls[0] == 21, "every decode step of the fused runner takes the one-call path"
    for layer in range(3):
        assert torch.equal(caches[0].k[layer], caches[1].k[layer])
        assert torch.equal(caches[0].v[layer], caches[1].v[layer])


@needs_kernel
@pytest.mark.parametrize("attention_bias", [False, True], ids=["llama", "qkv_bias"])
def test_fused_paged_steps_are_bit_identical_to_the_module_path(attention_bias: bool) -> None:
    """Steps of a few tokens per request on the paged cache (decodes, verify steps) run all layers in one native
    call (paged_step_layers); hidden states, the captured features and the cache equal the per-module path's
    exactly. A prefill chunk (> 8 tokens) or more than NATIVE_MAX_ROWS tokens keeps the module path."""
    source = tiny(seed=3, num_hidden_layers=3, with_tokenizer=False, vocab_size=96,
                  model_type="qwen2" if attention_bias else "llama")
    runners = [ModelRunner(source, dtype="float32", device="cpu") for _ in range(2)]
    runners[1].model._fused_layers = []                  # NOTE: [] = the fused paths are off for this model
    config = runners[0].config
    caches = [BlockKVCache(config.num_layers, config.num_kv_heads, config.head_dim, 16, 4, torch.float32,
                           torch.device("cpu"), backend="native") for _ in runners]   # 2 requests x 8 blocks of 4
    calls = [0]
    real = native_gemv.paged_step_layers

    def counting(*args: object) -> list[torch.Tensor]:
        calls[0] += 1
        return real(*args)

    tables = [list(range(8)), list(range(8, 16))]
    lengths = [0, 0]
    generator = torch.Generator().manual_seed(0)
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setattr(native_gemv, "paged_step_layers", counting)
        for fed in [(10, 9), (3, 2), (1, 1), (5, 7), (6, 7)]:   # prefill, verify, decode, short chunks, 13 tokens
            seqs = [SeqSlice(t, n, q) for t, n, q in zip(tables, lengths, fed)]
            ids = torch.randint(0, 96, (1, sum(fed)), generator=generator)
            positions = torch.tensor([[n + j for n, q in zip(lengths, fed) for j in range(q)]])
            outputs = []
            for runner, cache in zip(runners, caches):
                cache.begin_step(seqs)
                outputs.append(runner.model.forward_with_features(ids, positions, cache, (0, 2)))
            assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1]), fed
            lengths = [n + q for n, q in zip(lengths, fed)]
            hidden = []
            for runner, cache in zip(runners, caches):   # NOTE: then a decode of both requests (model.forward)
                cache.begin_step([SeqSlice(t, n, 1) for t, n in zip(tables, lengths)])
                hidden.append(runner.model(ids[:, :2], torch.tensor([lengths]), cache))
            assert torch.equal(hidden[0], hidden[1]), f"decode after {fed}"
            lengths = [n + 1 for n in lengths]
    assert calls[0] == 3 + 5, "the verify, decode and short-chunk steps and every decode take the one-call path"
    for layer in range(3):
        assert torch.equal(caches[0].k[layer], caches[1].k[layer])
        assert torch.equal(caches[0].v[layer], caches[1].v[layer])


@needs_kernel
@pytest.mark.parametrize("hidden", [1, 7, 8, 13, 64, 576])
def test_rms_norm_and_silu_mul_match_torch(hidden: int) -> None:
    generator = torch.Generator().manual_seed(hidden)
    x = 3 * torch.randn(3, 2, hidden, generator=generator)
    w = torch.randn(hidden, generator=generator)
    torch.testing.assert_close(native_gemv.rms_norm(x, w, 1e-5), F.rms_norm(x, (hidden,), w, 1e-5),
                               atol=1e-5, rtol=1e-5)
    gate_up = 10 * torch.randn(2, 1, 2 * hidden, generator=generator)   # large |gate|: exp must not overflow
    gate, up = gate_up.split(hidden, dim=-1)
    torch.testing.assert_close(native_gemv.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("batch,tokens,heads,head_dim", [(1, 1, 12, 64), (1, 7, 3, 16), (2, 3, 2, 10)])
def test_rope_and_add_rms_norm_match_torch(batch: int, tokens: int, heads: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(heads)
    x = torch.randn(batch, tokens, heads + 3, head_dim, generator=generator)[:, :, :heads]  # a strided view
    table = torch.randn(batch, tokens, 2, head_dim, generator=generator)
    cos, signed_sin = table[:, :, 0:1], table[:, :, 1:2]
    reference = torch.addcmul(x * cos, x.roll(head_dim // 2, dims=-1), signed_sin)
    torch.testing.assert_close(native_gemv.rope(x, cos, signed_sin), reference, atol=1e-6, rtol=1e-6)
    h, a = torch.randn(2, batch, tokens, head_dim, generator=generator)
    w = torch.randn(head_dim, generator=generator)
    total, normed = native_gemv.add_rms_norm(h, a, w, 1e-6)
    torch.testing.assert_close(total, h + a)
    torch.testing.assert_close(normed, F.rms_norm(h + a, (head_dim,), w, 1e-6), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("num_kv_heads,group,head_dim,position", [(3, 3, 64, 0), (3, 3, 64, 1), (3, 3, 64, 130),
                                                                    (2, 2, 16, 49), (1, 4, 40, 7), (2, 1, 96, 2000)])
def test_decode_attention_matches_sdpa_and_writes_the_cache(num_kv_heads: int, group: int, head_dim: int,
                                                            position: int) -> None:
    generator = torch.Generator().manual_seed(position)
    max_len = position + 5
    k_cache = torch.randn(num_kv_heads, max_len, head_dim, generator=generator)
    v_cache = torch.randn(num_kv_heads, max_len, head_dim, generator=generator)
    q = torch.randn(1, 1, num_kv_heads * group, head_dim, generator=generator)
    k, v = (torch.randn(1, 1, num_kv_heads, head_dim, generator=generator) for _ in range(2))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[:, position], expected_v[:, position] = k[0, 0], v[0, 0]
    out = native_gemv.decode_attention(q, k, v, k_cache, v_cache, position, head_dim ** -0.5)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    keys = expected_k[:, :position + 1].repeat_interleave(group, dim=0)                  # (Hq, S, D)
    values = expected_v[:, :position + 1].repeat_interleave(group, dim=0)
    reference = F.scaled_dot_product_attention(q[0, 0, :, None], keys, values)           # (Hq, 1, D)
    torch.testing.assert_close(out[0, 0], reference[:, 0], atol=1e-5, rtol=1e-5)


@needs_kernel
def test_ar_greedy_tokens_and_logits_same_with_and_without_kernels(count_gemv: list[int]) -> None:
    source = tiny()
    with_kernel = ModelRunner(source, dtype="float32", device="cpu")
    assert with_kernel.model.layers[0].mlp.gate_up_proj.weight.is_contiguous(), "row-major for the kernel"
    native_gemv.set_enabled(False)
    try:
        without = ModelRunner(source, dtype="float32", device="cpu")
    finally:
        native_gemv.set_enabled(True)
    outputs, logits = [], []
    for runner in (with_kernel, without):
        native_gemv.set_enabled(runner is with_kernel)
        try:
            requests = make_requests([[1, 2, 3, 4, 5], [7, 8, 9]], max_tokens=12)
            AREngine(runner).run(requests)
            outputs.append([r.output_token_ids for r in requests])
            cache = runner.allocate_kv_cache(1, 16)
            steps = []
            for position, token in enumerate([3, 1, 4, 1, 5]):   # decode one token at a time: the T = 1 path
                cache.begin_forward(position, 1)
                steps.append(runner.execute(torch.tensor([[token]]), torch.tensor([[position]]), cache))
            logits.append(torch.stack(steps))
        finally:
            native_gemv.set_enabled(True)
    assert count_gemv[0] > 0
    assert outputs[0] == outputs[1]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


@needs_kernel
def test_bench_gemv_floor_prints_one_row_per_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    """experiments/bench_gemv.py --floor: the arithmetic floor of each row count against a given DRAM rate."""
    bench = load_experiment("bench_gemv")
    bench.floor_table(native_gemv._KERNEL, [1, 3], dram_gbps=20.0, calls=2)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 2
    for row in rows:
        gbps, fmas, floor = (float(cell) for cell in row.strip("|").split("|")[1:])
        assert gbps > 0 and fmas > 0 and floor == pytest.approx(20.0 / gbps, abs=0.01)
