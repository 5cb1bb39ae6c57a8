"""NativeAttention, the `native` backend: decodes read their keys and values straight from the blocks in
one small C++ kernel per layer (no gather copy, no padding); prefill chunks go through SplitAttention.

The kernel is vLLM's CPU paged-attention idea at its simplest: for every (request, KV head) it walks the
request's block table, scores the G query heads of the group against each key, softmaxes in fp32 and
sums the values. It is compiled on first use with torch's cpp_extension (cached under
~/.cache/torch_extensions). Without a compiler, on a GPU, or in another dtype than fp32 the backend
falls back to SplitAttention, so `native` is always safe to ask for.

Owns: the decode kernel and when to use it. Ignores: which request a block belongs to.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lab.kv_cache.split_attention import SplitAttention, SplitMeta

if TYPE_CHECKING:
    from lab.kv_cache.block_kv import BlockKVCache, StepIndex

KERNEL_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// q (B, Hkv, G, D); k/v stores (Hkv, num_blocks, block_size, D); tables (B, max_blocks) int64;
// lens (B,) int64 keys to attend -> out (B, Hkv, G, D). All fp32, contiguous.
void paged_decode(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor tables, at::Tensor lens, double scale,
                  at::Tensor out) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t NB = k.size(1), bs = k.size(2), max_nb = tables.size(1);
  const float* qp = q.data_ptr<float>(); const float* kp = k.data_ptr<float>(); const float* vp = v.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>(); const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = (float)scale;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H, n = lp[b];
      scores.resize(G * n);
      float* s = scores.data();
      const float* qi = qp + i * G * D;
      float* oi = op + i * G * D;
      for (int64_t j = 0; j * bs < n; ++j) {
        const float* kb = kp + (h * NB + tp[b * max_nb + j]) * bs * D;
        const int64_t m = std::min(bs, n - j * bs);
        for (int64_t t = 0; t < m; ++t) {
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qi + g * D; const float* kr = kb + t * D;
            float acc = 0.f;
            #pragma omp simd reduction(+:acc)
            for (int64_t d = 0; d < D; ++d) acc += qg[d] * kr[d];
            s[g * n + j * bs + t] = acc * sc;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s + g * n;
        float mx = sg[0];
        for (int64_t t = 1; t < n; ++t) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
      }
      for (int64_t x = 0; x < G * D; ++x) oi[x] = 0.f;
      for (int64_t j = 0; j * bs < n; ++j) {
        const float* vb = vp + (h * NB + tp[b * max_nb + j]) * bs * D;
        const int64_t m = std::min(bs, n - j * bs);
        for (int64_t t = 0; t < m; ++t) {
          for (int64_t g = 0; g < G; ++g) {
            const float p = s[g * n + j * bs + t]; const float* vr = vb + t * D; float* og = oi + g * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) og[d] += p * vr[d];
          }
        }
      }
    }
  });
}
"""

_KERNEL: Any = None
_KERNEL_ERROR: str | None = None


def load_kernel() -> Any | None:
    """The compiled `paged_decode`, built once per machine (minutes under load) and cached; None if it
    cannot be built here (the reason is warned once)."""
    global _KERNEL, _KERNEL_ERROR
    if _KERNEL is None and _KERNEL_ERROR is None:
        try:
            from torch.utils.cpp_extension import load_inline

            _KERNEL = load_inline("lab_paged_decode", cpp_sources=KERNEL_SOURCE, functions=["paged_decode"],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=False)
        except Exception as exc:  # noqa: BLE001 - no compiler, no headers: fall back, say why once
            _KERNEL_ERROR = f"{type(exc).__name__}: {str(exc)[:300]}"
            warnings.warn(f"native attention unavailable, using `fast`: {_KERNEL_ERROR}", stacklevel=2)
    return _KERNEL


@dataclass(slots=True)
class NativeMeta:
    num_decodes: int
    tables: torch.Tensor | None    # (B, max_blocks) int64, the decodes' block tables
    lens: torch.Tensor | None      # (B,) int64, keys each decode attends to (its context + itself)
    chunks: SplitMeta              # the prefill chunks, SplitAttention's plan


class NativeAttention:
    def __init__(self) -> None:
        self.split = SplitAttention()

    def usable(self, cache: BlockKVCache) -> bool:
        return cache.device.type == "cpu" and cache.k[0].dtype == torch.float32 and load_kernel() is not None

    def prepare(self, cache: BlockKVCache, index: StepIndex) -> NativeMeta | SplitMeta:
        if not self.usable(cache):
            return self.split.prepare(cache, index)
        num_decodes = 0
        for seq in index.seqs:
            if seq.num_query_tokens != 1:
                break
            num_decodes += 1
        # NOTE: SplitAttention sees only the chunks; their q_start stays absolute in the flat batch.
        rest = dataclasses.replace(index, seqs=index.seqs[num_decodes:], q_start=index.q_start[num_decodes:],
                                   block_tables=index.block_tables[num_decodes:],
                                   context_lens=index.context_lens[num_decodes:],
                                   query_lens=index.query_lens[num_decodes:])
        chunks = self.split.prepare(cache, rest)
        if not num_decodes:
            return NativeMeta(0, None, None, chunks)
        num_blocks = -(-(int(index.context_lens[:num_decodes].max()) + 1) // cache.block_size)
        tables = index.block_tables[:num_decodes, :num_blocks].contiguous()                    # (B, nb)
        return NativeMeta(num_decodes, tables, index.context_lens[:num_decodes] + 1, chunks)

    def attend(self, cache: BlockKVCache, meta: NativeMeta | SplitMeta, layer_idx: int, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (N, Hq, D), k/v (N, Hkv, D) of this step (already stored) -> (N, Hq, D)."""
        if isinstance(meta, SplitMeta):
            return self.split.attend(cache, meta, layer_idx, q, k, v)
        out = self.split.attend(cache, meta.chunks, layer_idx, q, k, v)   # chunk rows filled, decode rows not
        if meta.num_decodes:
            num_seqs, (num_heads, head_dim) = meta.num_decodes, q.shape[1:]
            group = (num_seqs, cache.num_kv_heads, num_heads // cache.num_kv_heads, head_dim)
            queries = q[:num_seqs].contiguous().view(group)                                   # (B, Hkv, G, D)
            _KERNEL.paged_decode(queries, cache.k[layer_idx], cache.v[layer_idx], meta.tables, meta.lens,
                                 1 / math.sqrt(head_dim), out[:num_seqs].view(group))
        return out
