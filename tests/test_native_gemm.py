"""The native panel GEMM (lab/models/native_gemm.py) matches F.linear for any row count, ragged output width,
bias and thread count; a row's result does not depend on the other rows; PackedLinear sends more than
NATIVE_MAX_ROWS rows to it on the `native` backend and to oneDNN on `onednn`, repacks when asked for the
other one, and a cb engine's greedy tokens are the same on both.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from lab.engines.continuous import ContinuousBatchingEngine
from lab.models import native_gemm, native_gemv
from lab.models.packed_linear import NATIVE_MAX_ROWS, PackedLinear, can_pack, default_backend, pack_linear_weights
from lab.models.sources import tiny
from lab.runner import ModelRunner
from lab.sched import SchedulerConfig
from tests.helpers import make_requests
from tests.test_continuous_batching import random_prompts

pytestmark = pytest.mark.skipif(native_gemv.load_kernel() is None, reason="the native kernels cannot be built here")


@pytest.fixture
def count_gemm(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = native_gemm.gemm

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(native_gemm, "gemm", counted)
    return calls


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def gemm_threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(native_gemv, "THREADS", request.param)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 3, 13, 64, 67, 130])
@pytest.mark.parametrize("out_features,in_features", [(24, 8), (100, 29), (577, 64), (48, 1)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gemm_matches_f_linear(gemm_threads: int, rows: int, out_features: int, in_features: int,
                               bias: bool) -> None:
    torch.manual_seed(rows + out_features)
    x = torch.randn(rows, in_features)
    w = torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    y = native_gemm.gemm(x, native_gemm.pack(w), out_features, b)
    assert y.shape == (rows, out_features)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_gemm_keeps_leading_dims_and_reads_non_contiguous_x() -> None:
    w = torch.randn(50, 32)
    x = torch.randn(3, 32, 7).transpose(1, 2)                     # (3, 7, 32), not contiguous
    y = native_gemm.gemm(x, native_gemm.pack(w), 50)
    assert y.shape == (3, 7, 50)
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_gemm_rows_are_bit_identical_whatever_the_other_rows(gemm_threads: int) -> None:
    torch.manual_seed(0)
    w, x = torch.randn(75, 40), torch.randn(70, 40)
    panels = native_gemm.pack(w)
    together = native_gemm.gemm(x, panels, 75)
    for i in (0, 5, 63, 64, 69):
        assert torch.equal(native_gemm.gemm(x[i:i + 1], panels, 75)[0], together[i])
    assert torch.equal(native_gemm.gemm(x[60:70], panels, 75), together[60:70])


def test_gemm_rejects_what_it_cannot_compute() -> None:
    panels = native_gemm.pack(torch.randn(30, 16))
    with pytest.raises(RuntimeError, match="rows of 16"):
        native_gemm.gemm(torch.randn(4, 15), panels, 30)
    with pytest.raises(RuntimeError, match="do not fit"):
        native_gemm.gemm(torch.randn(4, 16), panels, 49)
    with pytest.raises(RuntimeError, match="fp32"):
        native_gemm.gemm(torch.randn(4, 16, dtype=torch.float64), panels, 30)
    with pytest.raises(RuntimeError, match="bias"):
        native_gemm.gemm(torch.randn(4, 16), panels, 30, torch.randn(29))
    with pytest.raises(RuntimeError, match="empty panels"):
        native_gemm.gemm(torch.randn(4, 0), native_gemm.pack(torch.randn(30, 0)), 30)


def _layer(backend: str | None = None) -> PackedLinear:
    if not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("PackedLinear needs fp32 on a CPU build with mkldnn")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(29, 37))
    pack_linear_weights(model, backend)
    return model[0]


def test_packed_linear_sends_many_rows_to_the_panel_gemm(count_gemm: list[int]) -> None:
    assert default_backend() == "native"
    layer = _layer()
    assert layer.backend == "native" and layer.packed.shape == (2, 29, native_gemm.PANEL_WIDTH)
    many = torch.randn(2, NATIVE_MAX_ROWS, layer.in_features)     # 24 rows: past the GEMV
    with torch.inference_mode():
        torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        layer(torch.randn(1, NATIVE_MAX_ROWS, layer.in_features))  # a few rows: the GEMV
        assert count_gemm[0] == 1
        with torch.no_grad():                      # a changed weight makes the packed copy stale: F.linear
            layer.weight.mul_(2)
        torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert count_gemm[0] == 1
        pack_linear_weights(torch.nn.Sequential(layer))       # makes the stale copy again
        torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert count_gemm[0] == 2


def test_packed_linear_repacks_for_the_other_backend(count_gemm: list[int]) -> None:
    layer = _layer("onednn")
    many = torch.randn(40, layer.in_features)
    with torch.inference_mode():
        onednn = layer(many)
        assert count_gemm[0] == 0
        pack_linear_weights(torch.nn.Sequential(layer), "native")
        assert layer.backend == "native"
        torch.testing.assert_close(layer(many), onednn, atol=1e-5, rtol=1e-5)
        assert count_gemm[0] == 1
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        layer.pack("blas")


def test_lab_gemm_env_picks_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_GEMM", "onednn")
    assert default_backend() == "onednn"
    monkeypatch.setenv("LAB_GEMM", "mkl")
    with pytest.raises(ValueError, match="LAB_GEMM='mkl'"):
        default_backend()


def test_cb_greedy_tokens_same_on_native_and_onednn_gemm(count_gemm: list[int]) -> None:
    runner = ModelRunner(tiny(), dtype="float32", device="cpu", max_model_len=256)
    prompts = random_prompts(NATIVE_MAX_ROWS + 8, runner.vocab_size, seed=3, max_len=40)
    tokens = {}
    for backend in ("onednn", "native"):
        pack_linear_weights(runner.model, backend)
        engine = ContinuousBatchingEngine(runner, SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048))
        result = engine.run(make_requests(prompts, 6, ignore_eos=True))
        tokens[backend] = [r.output_token_ids for r in result.requests]
    assert count_gemm[0] > 0, "prefill and the 20-row decode steps use the panel GEMM"
    assert tokens["native"] == tokens["onednn"]
