"""train.matmul_precision (lab/training/precision.py): what each setting means on a CPU and on CUDA, the block
restores torch's setting, and under `medium` a CPU's PackedLinear yields its native fp32 kernels to torch's bf16
products, the same values as F.linear's there, while a `highest` forward stays bit-identical to before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lab.kv_cache.base import NoCache
from lab.models.packed_linear import PackedLinear, pack_linear_weights
from lab.models.sources import tiny
from lab.runner import ModelRunner
from lab.training import precision
from lab.training.precision import effective_precision, float32_matmul_precision


def test_highest_and_cuda_settings_take_effect_as_asked() -> None:
    assert effective_precision("highest", "cpu") == ("highest", None)
    for asked in ("highest", "high", "medium"):
        assert effective_precision(asked, "cuda") == (asked, None)


def test_a_cpu_has_no_tf32_and_says_medium_is_its_bf16() -> None:
    taken, why = effective_precision("high", "cpu")
    assert taken == "highest" and "TF32" in why and "matmul_precision=medium" in why


def test_medium_on_a_cpu_without_a_bf16_unit_stays_fp32_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "cpu_has_bf16_matmul", lambda: False)
    taken, why = effective_precision("medium", "cpu")
    assert taken == "highest" and "no bf16" in why
    monkeypatch.setattr(precision, "cpu_has_bf16_matmul", lambda: True)
    assert effective_precision("medium", "cpu") == ("medium", None)


def test_an_unknown_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="expected one of highest, high, medium"):
        effective_precision("tf32", "cpu")


def test_the_block_restores_the_setting_even_after_an_error() -> None:
    before = torch.get_float32_matmul_precision()
    with pytest.raises(RuntimeError), float32_matmul_precision("medium"):
        assert torch.get_float32_matmul_precision() == "medium"
        raise RuntimeError("inside")
    assert torch.get_float32_matmul_precision() == before


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_packed_linear_under_medium_is_torch_products(rows: int) -> None:
    """At the native GEMV's row counts and the panel GEMM's, `medium` gives F.linear's values under
    `medium`; `highest` keeps the native fp32 result, within fp32 rounding of F.linear."""
    torch.manual_seed(rows)
    linear = PackedLinear(96, 200)
    linear.pack()
    x = torch.randn(rows, 96)
    exact = linear(x)
    torch.testing.assert_close(exact, F.linear(x, linear.weight, linear.bias), atol=1e-4, rtol=1e-5)
    with float32_matmul_precision("medium"):
        reduced = linear(x)
        assert torch.equal(reduced, F.linear(x, linear.weight, linear.bias))
    assert torch.equal(linear(x), exact)


def test_target_features_under_medium_are_close_to_fp32_and_fp32_is_unchanged() -> None:
    """The target's features (what lab-train caches) under `medium` are bf16 products of the same model: within
    bf16 rounding of fp32, and a forward at `highest` afterwards gives the fp32 features bit for bit."""
    runner = ModelRunner(tiny(seed=0, vocab_size=128, with_tokenizer=False), dtype="float32", device="cpu")
    pack_linear_weights(runner.model)
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(48)[None]

    def features() -> torch.Tensor:
        with torch.inference_mode():
            return runner.model.forward_with_features(ids, positions, NoCache(), (0, 1))[1]

    exact = features()
    with float32_matmul_precision("medium"):
        reduced = features()
    error = (reduced - exact).norm() / exact.norm()
    assert error < 0.03, error
    if precision.medium_rounds_products():   # NOTE: not cpu_has_bf16_matmul: oneDNN may report bf16 and keep fp32
        assert error > 0   # bf16 inputs did round
    assert torch.equal(features(), exact)

