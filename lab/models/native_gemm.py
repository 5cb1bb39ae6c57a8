"""C++ fp32 GEMM for batched decode and prefill on CPU: y = x W^T (+ bias) for more rows than the few-row GEMV
takes, on a copy of W packed once into column panels.

At batch 32-64 a decode step is compute-bound (SmolLM2-135M: ~270 MFLOP per token, the weights stream
from DRAM once per step), and its GEMMs are short: 64 rows against 576-wide matrices. oneDNN ran them at
60-68 % of this CPU's GEMM peak, against 90+ % on large square shapes (docs/profiling.md). This kernel is
the textbook register-blocked GEMM, sized to those shapes:
- W (N, K) is packed once into panels of NR = 24 output columns, each panel K x 24 contiguous floats
  (zero-padded past N), so the inner loop reads the weights as one sequential stream;
- a 4 x 24 microkernel keeps a 4-row by 24-column tile of y in 12 AVX2 registers and, per k, loads three
  8-wide weight vectors and broadcasts four x values: 12 FMAs per 7 loads;
- rows go in blocks of up to 64 (x's block stays in L2: <= 192 KiB) and, inside one, every 4-row tile
  reuses the panel from L1/L2; while it runs, each tile prefetches its share of the next panel, which
  otherwise arrives from DRAM at the first tile's pace;
- panels are split over torch's intra-op threads (native_gemv.THREADS caps them), one contiguous run each.
Every y[m, n] is one FMA chain over k in order, whatever the other rows, the tile or the thread: a row's
result does not depend on the batch it came with.

NOTE: measured on this CPU (1 thread, SmolLM2-135M's 121 linears at 64 rows, weights streamed from DRAM):
oneDNN on its prepacked weights 62-70 GFLOP/s, this kernel 80-91 (docs/profiling.md).

Owns: the panel layout and the GEMM. Ignores: when a layer uses it (lab/models/packed_linear.py decides).
The source is compiled into native_gemv's extension (one build), whose `load_kernel` and `usable` gate it.
"""

from __future__ import annotations

import torch

from lab.models import native_gemv

PANEL_WIDTH = 24    # NR: output columns per panel (three AVX2 vectors)

GEMM_SOURCE = r"""
constexpr int64_t GEMM_NR = 24;   // panel width: three 8-wide vectors
constexpr int64_t GEMM_MR = 4;    // rows per microkernel tile
constexpr int64_t GEMM_MC = 64;   // at most this many rows per block (x's block stays in L2 while the panels pass)
constexpr int64_t GEMM_BLOCK_X_BYTES = 192 * 1024;   // x's block, next to a panel (K x 96 B), within the 512 KiB L2

// W (N, K) row-major -> (ceil(N / NR), K, NR): panel p holds columns [p NR, p NR + NR) of y, k-major.
at::Tensor pack_panels(at::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.device().is_cpu(),
              "pack_panels: W must be fp32 (N, K) on the CPU");
  at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + GEMM_NR - 1) / GEMM_NR;
  at::Tensor out = at::zeros({P, K, GEMM_NR}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < GEMM_NR && p * GEMM_NR + j < N; ++j) {
        const float* row = src + (p * GEMM_NR + j) * K;
        float* col = dst + p * K * GEMM_NR + j;
        for (int64_t k = 0; k < K; ++k) col[k * GEMM_NR] = row[k];
      }
  });
  return out;
}

// y[0:MR, 0:24] = (bias or 0) + a[0:MR, 0:K] . panel, a row-major with stride lda; y's stride ldc. While it
// runs, one cache line of `prefetch` (the next panel, or null) is requested every 8 k.
template <int MR>
static inline void gemm_tile(const float* __restrict a, int64_t lda, const float* __restrict panel, int64_t K,
                             const float* __restrict bias, float* __restrict y, int64_t ldc,
                             const char* prefetch) {
  __m256 acc[MR][3];
  #pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = bias ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps();
  const float* b = panel;
  #pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k, b += GEMM_NR) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), b2 = _mm256_loadu_ps(b + 16);
    if (prefetch && (k & 7) == 0) _mm_prefetch(prefetch + (k >> 3) * 64, _MM_HINT_T0);
    #pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(av, b2, acc[r][2]);
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) _mm256_storeu_ps(y + r * ldc + 8 * j, acc[r][j]);
}

static inline void gemm_tile_any(int64_t rows, const float* a, int64_t lda, const float* panel, int64_t K,
                                 const float* bias, float* y, int64_t ldc, const char* prefetch) {
  switch (rows) {
    case 4: gemm_tile<4>(a, lda, panel, K, bias, y, ldc, prefetch); break;
    case 3: gemm_tile<3>(a, lda, panel, K, bias, y, ldc, prefetch); break;
    case 2: gemm_tile<2>(a, lda, panel, K, bias, y, ldc, prefetch); break;
    default: gemm_tile<1>(a, lda, panel, K, bias, y, ldc, prefetch); break;
  }
}

// x (..., K) -> (..., N) = x W^T + bias, W given as pack_panels(W).
at::Tensor gemm_panels(at::Tensor x, at::Tensor panels, int64_t N, c10::optional<at::Tensor> bias,
                       int64_t max_threads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "gemm_panels: fp32 only");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == GEMM_NR && panels.is_contiguous(),
              "gemm_panels: panels must come from pack_panels");
  const int64_t K = panels.size(1), P = panels.size(0);
  TORCH_CHECK(K > 0 && P > 0, "gemm_panels: empty panels (K = ", K, ", ", P, " panels)");
  TORCH_CHECK(N > (P - 1) * GEMM_NR && N <= P * GEMM_NR, "gemm_panels: ", N, " outputs do not fit ", P, " panels");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "gemm_panels: x must have rows of ", K, " values");
  at::Tensor xc = x.contiguous();
  const int64_t M = xc.numel() / K;
  float bias_pad[GEMM_NR] = {0};    // the last panel's bias, zero past N
  at::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == N, "gemm_panels: bias must be fp32 (N,)");
    bp = bc.data_ptr<float>();
    for (int64_t n = (P - 1) * GEMM_NR; n < N; ++n) bias_pad[n - (P - 1) * GEMM_NR] = bp[n];
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const float* xp = xc.data_ptr<float>(); const float* wp = panels.data_ptr<float>(); float* yp = y.data_ptr<float>();
  const int64_t panel_floats = K * GEMM_NR;
  // NOTE: 64 rows at K = 576, 32 at K = 1536 (the down projection): a 64-row block of its x is 384 KiB.
  const int64_t mc = std::max<int64_t>(GEMM_MR,
                                       std::min<int64_t>(GEMM_MC, GEMM_BLOCK_X_BYTES / (4 * K) / GEMM_MR * GEMM_MR));
  auto run = [&](int64_t p0, int64_t p1) {
    alignas(32) float tail[GEMM_MR * GEMM_NR];      // a ragged last panel's tile, copied out column by column
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
      const int64_t rows = std::min(mc, M - m0);
      const int64_t tiles = (rows + GEMM_MR - 1) / GEMM_MR;
      const int64_t chunk = (panel_floats * 4 / tiles + 63) / 64 * 64;   // bytes of the next panel per tile
      for (int64_t p = p0; p < p1; ++p) {
        const float* panel = wp + p * panel_floats;
        const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(panel + panel_floats) : nullptr;
        const int64_t cols = std::min(GEMM_NR, N - p * GEMM_NR);
        const float* tile_bias = bp == nullptr ? nullptr : cols == GEMM_NR ? bp + p * GEMM_NR : bias_pad;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m = m0 + t * GEMM_MR, mr = std::min(GEMM_MR, M - m);
          const char* pf = next ? next + t * chunk : nullptr;
          if (cols == GEMM_NR) {
            gemm_tile_any(mr, xp + m * K, K, panel, K, tile_bias, yp + m * N + p * GEMM_NR, N, pf);
          } else {
            gemm_tile_any(mr, xp + m * K, K, panel, K, tile_bias, tail, GEMM_NR, pf);
            for (int64_t r = 0; r < mr; ++r)
              std::memcpy(yp + (m + r) * N + p * GEMM_NR, tail + r * GEMM_NR, cols * sizeof(float));
          }
        }
      }
    }
  };
  // NOTE: as gemv: max_threads 1 stays on the calling thread; otherwise each thread takes one contiguous run
  // of panels, at most max_threads runs (0: torch's intra-op thread count).
  if (max_threads == 1 || P == 1) {
    run(0, P);
  } else {
    const int64_t threads = max_threads > 1 ? std::min<int64_t>(max_threads, at::get_num_threads())
                                            : at::get_num_threads();
    at::parallel_for(0, P, (P + threads - 1) / threads, run);
  }
  return y;
}
"""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) fp32 -> its panels (ceil(N / 24), K, 24) for `gemm`. Needs the kernel."""
    return native_gemv.load_kernel().pack_panels(weight.detach())


def gemm(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) -> (..., out_features) = x W^T + bias, with panels = pack(W). Any number of rows; each row's
    result is bit-identical whatever the other rows. Needs the kernel (native_gemv.usable)."""
    return native_gemv.load_kernel().gemm_panels(x, panels, out_features, bias, native_gemv.THREADS)
