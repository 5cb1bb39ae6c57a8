"""Streamed weights on 2 MiB pages (lab/huge_pages.py): the copies keep their values and lie back to back in one
2 MiB-aligned mapping that Linux backs with huge pages; a model and a drafter streaming from them decode exactly as
on the allocator's pages; a bad or impossible setting is refused with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lab.errors import LabError
from lab import huge_pages
from lab.models import native_gemv
from lab.models.packed_linear import PackedLinear, use_draft_blocks
from lab.runner import ModelRunner
from lab.spec.feature_proposer import _stream_draft_weights
from tests.test_weight_blocks import block_source

needs_kernel = pytest.mark.skipif(native_gemv.load_kernel() is None, reason="the native GEMV cannot be built here")
needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="this OS offers no transparent huge pages")


def _assert_back_to_back(tensors: list[torch.Tensor]) -> None:
    """One mapping, 2 MiB-aligned at its start, each tensor on its own 4 KiB line, in the given order."""
    pointers = [t.data_ptr() for t in tensors]
    assert pointers[0] % huge_pages.HUGE_PAGE_BYTES == 0, hex(pointers[0])
    assert all(p % 4096 == 0 for p in pointers), [hex(p) for p in pointers]
    assert pointers == sorted(pointers)
    span = pointers[-1] + tensors[-1].numel() * tensors[-1].element_size() - pointers[0]
    padded = sum((t.numel() * t.element_size() + 4095) // 4096 * 4096 for t in tensors)
    assert span <= padded, (span, padded)


def _mapping_huge_page_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds `tensor` (/proc/self/smaps). NOTE: the kernel merges neighbouring
    mappings of the same kind, so this may count other huge-page mappings beside it."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and ":" not in head:         # NOTE: a mapping's first line: "start-end perms ..."
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_moved_tensors_keep_their_values_shapes_and_dtypes_back_to_back() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 255, (300, 72), dtype=torch.uint8, generator=generator),
               torch.randn(5, 7, generator=generator).to(torch.float16),
               torch.randint(-128, 127, (3 << 20,), dtype=torch.int8, generator=generator),   # NOTE: past 2 MiB
               torch.randn(64, generator=generator)]
    moved = huge_pages.move(tensors)
    for before, after in zip(tensors, moved):
        assert after.shape == before.shape and after.dtype == before.dtype and torch.equal(after, before)
    _assert_back_to_back(moved)
    with pytest.raises(ValueError, match="contiguous CPU"):
        huge_pages.move([torch.randn(4, 6).t()])


@needs_thp
def test_linux_backs_the_mapping_with_huge_pages() -> None:
    """NOTE: the kernel's own count (AnonHugePages in /proc/self/smaps) for the mapping, not just the madvise."""
    moved = huge_pages.move([torch.ones(6 << 20, dtype=torch.uint8)])
    assert _mapping_huge_page_bytes(moved[0]) >= 4 << 20, _mapping_huge_page_bytes(moved[0])
    assert _mapping_huge_page_bytes(torch.ones(8)) == 0, "the allocator's small tensors are not on huge pages"
    assert huge_pages.process_huge_page_bytes() >= _mapping_huge_page_bytes(moved[0])


@needs_kernel
def test_a_model_streams_its_blocks_from_huge_pages_and_decodes_bit_identically() -> None:
    source = block_source()
    on = ModelRunner(source, dtype="float32", device="cpu", block_kernel="avx", huge_pages="auto")
    off = ModelRunner(source, dtype="float32", device="cpu", block_kernel="avx", huge_pages="off")
    assert on.block_linears == off.block_linears == 3 * 4 + 1
    assert on.use_huge_pages == huge_pages.available() and not off.use_huge_pages
    if on.use_huge_pages:
        _assert_back_to_back([blocks for _, blocks in on.model.block_pairs()])
        assert _mapping_huge_page_bytes(on.model.block_pairs()[0][1]) > 0
    assert _mapping_huge_page_bytes(off.model.block_pairs()[0][1]) == 0
    caches = [runner.allocate_kv_cache(1, 64) for runner in (on, off)]
    prompt = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    for cache in caches:
        cache.begin_forward(0, 7)
    logits = [runner.execute(prompt, torch.arange(7)[None], cache) for runner, cache in zip((on, off), caches)]
    for position in range(7, 24):     # NOTE: the fused one-call path, whose lists must point at the moved blocks
        token = logits[1].argmax(-1, keepdim=True)
        logits = []
        for runner, cache in zip((on, off), caches):
            cache.begin_forward(position, 1)
            logits.append(runner.execute(token, torch.tensor([[position]]), cache))
        assert torch.equal(logits[0], logits[1]), position


@needs_kernel
@needs_thp
def test_a_drafter_streams_its_draft_weights_from_huge_pages_where_the_target_does() -> None:
    target = ModelRunner(block_source(), dtype="float32", device="cpu", block_kernel="avx")
    drafter = torch.nn.Sequential(PackedLinear(64, 96), PackedLinear(96, 64))
    reference = torch.nn.Sequential(PackedLinear(64, 96), PackedLinear(96, 64))
    reference.load_state_dict(drafter.state_dict())
    _stream_draft_weights(drafter, target, "q8_0")
    use_draft_blocks(reference, "q8_0")
    _assert_back_to_back([layer.blocks for layer in drafter])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(drafter(x), reference(x))


def test_a_bad_or_impossible_huge_pages_setting_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LabError, match="model.huge_pages='yes'") as error:
        ModelRunner(block_source(), dtype="float32", device="cpu", huge_pages="yes")
    assert "model.huge_pages=auto" in str(error.value)
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    with pytest.raises(LabError, match="offers no transparent huge pages") as error:
        huge_pages.resolve("on")
    assert "model.huge_pages=auto" in str(error.value)
    assert huge_pages.resolve("auto") is False and huge_pages.resolve("off") is False
