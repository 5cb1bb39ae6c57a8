"""C++ fp32 kernels for batch-1 decode on CPU: the GEMV y = x W^T (+ bias) for one input row or a few (W (out,
in) row-major; a few rows: a verify step's k + 1 tokens, a small decode batch), and the small per-layer ops
around it (RMSNorm, SiLU-and-mul, one token's attention over a contiguous KV cache).

At batch 1 every projection is a matrix-vector product that streams its weight from DRAM once per token,
so the step's speed is the speed at which the weights are read. MKL's sgemv (through F.linear) reads them
well below the machine's bandwidth on this 2-core CPU (docs/benchmarks.md, "Native GEMV"); this kernel
sweeps W as four side-by-side sequential DRAM streams (four rows at a time, one from each quarter of the
matrix, one 8-wide FMA accumulator per weight row and input row, input rows in pairs so each weight load
serves two, or three: a verify step of 3 tokens reads each weight once) with a masked tail for `in % 8`, its
rows split over torch's intra-op threads (THREADS below, at::parallel_for). `gemv_f16` is the same sweep over
fp16 weights widened in registers (F16C): half the bytes, for drafters, whose outputs need not be exact.
The other kernels replace chains of 3-10 small torch ops whose dispatch cost, not their arithmetic,
dominated the rest of the step (docs/profiling.md).

The same extension carries lab/models/native_gemm.py's panel GEMM (its source is spliced in below), so one
build serves both. They are compiled on first use with torch's cpp_extension (cached under ~/.cache/torch_extensions, as
lab/kv_cache/native_attention.py). Without a compiler or AVX2/FMA/F16C, `AVAILABLE` stays False after
`load_kernel()` and every caller keeps its torch ops (F.linear, F.rms_norm, SDPA).

Owns: the kernels and whether they can run. Ignores: which module calls them (PackedLinear, RMSNorm, MLP,
ContiguousKVCache decide, through `usable`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

KERNEL_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Four horizontal sums at once: returns (sum a, sum b, sum c, sum d).
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 ab = _mm256_hadd_ps(a, b);           // a01 a23 b01 b23 | a45 a67 b45 b67
  __m256 cd = _mm256_hadd_ps(c, d);
  __m256 abcd = _mm256_hadd_ps(ab, cd);       // a0123 b0123 c0123 d0123 | a4567 ...
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

struct Tail {                 // the last in % 8 columns, loaded under a mask
  int64_t n8, rem;
  __m256i mask;
  __m256 x;
  Tail(const float* x_, int64_t in) : n8(in & ~int64_t(7)), rem(in - n8) {
    alignas(32) int32_t bits[8];
    for (int i = 0; i < 8; ++i) bits[i] = i < rem ? -1 : 0;
    mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(bits));
    x = rem ? _mm256_maskload_ps(x_ + n8, mask) : _mm256_setzero_ps();
  }
};

// One row, the plain way: for the few rows the four streams leave over.
static inline float dot_row(const float* __restrict w, const float* __restrict x, int64_t in, const Tail& t) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t k = 0; k < t.n8; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a);
  if (t.rem) a = _mm256_fmadd_ps(_mm256_maskload_ps(w + t.n8, t.mask), t.x, a);
  return hsum8(a);
}

// Four weight rows against one input row -> (y0, y1, y2, y3); one 8-wide accumulator per row.
// NOTE: dot_quad2 sums every (weight row, input row) pair in exactly this order, so an input row gives
// bit-identical outputs whether it comes alone or with others (a verify step's logits equal a decode's).
static inline __m128 dot_quad(const float* w0, const float* w1, const float* w2, const float* w3,
                              const float* __restrict x, const Tail& t) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (int64_t k = 0; k < t.n8; k += 8) {
    const __m256 u = _mm256_loadu_ps(x + k);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), u, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), u, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), u, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), u, a3);
  }
  if (t.rem) {
    a0 = _mm256_fmadd_ps(_mm256_maskload_ps(w0 + t.n8, t.mask), t.x, a0);
    a1 = _mm256_fmadd_ps(_mm256_maskload_ps(w1 + t.n8, t.mask), t.x, a1);
    a2 = _mm256_fmadd_ps(_mm256_maskload_ps(w2 + t.n8, t.mask), t.x, a2);
    a3 = _mm256_fmadd_ps(_mm256_maskload_ps(w3 + t.n8, t.mask), t.x, a3);
  }
  return hsum4x8(a0, a1, a2, a3);
}

// Four weight rows against two input rows: each weight vector is loaded once and used twice.
static inline void dot_quad2(const float* w0, const float* w1, const float* w2, const float* w3,
                             const float* __restrict xa, const float* __restrict xb, const Tail& ta, const Tail& tb,
                             __m128* ya, __m128* yb) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
  for (int64_t k = 0; k < ta.n8; k += 8) {
    const __m256 u = _mm256_loadu_ps(xa + k), v = _mm256_loadu_ps(xb + k);
    __m256 w = _mm256_loadu_ps(w0 + k); a0 = _mm256_fmadd_ps(w, u, a0); b0 = _mm256_fmadd_ps(w, v, b0);
    w = _mm256_loadu_ps(w1 + k); a1 = _mm256_fmadd_ps(w, u, a1); b1 = _mm256_fmadd_ps(w, v, b1);
    w = _mm256_loadu_ps(w2 + k); a2 = _mm256_fmadd_ps(w, u, a2); b2 = _mm256_fmadd_ps(w, v, b2);
    w = _mm256_loadu_ps(w3 + k); a3 = _mm256_fmadd_ps(w, u, a3); b3 = _mm256_fmadd_ps(w, v, b3);
  }
  if (ta.rem) {
    __m256 w = _mm256_maskload_ps(w0 + ta.n8, ta.mask); a0 = _mm256_fmadd_ps(w, ta.x, a0); b0 = _mm256_fmadd_ps(w, tb.x, b0);
    w = _mm256_maskload_ps(w1 + ta.n8, ta.mask); a1 = _mm256_fmadd_ps(w, ta.x, a1); b1 = _mm256_fmadd_ps(w, tb.x, b1);
    w = _mm256_maskload_ps(w2 + ta.n8, ta.mask); a2 = _mm256_fmadd_ps(w, ta.x, a2); b2 = _mm256_fmadd_ps(w, tb.x, b2);
    w = _mm256_maskload_ps(w3 + ta.n8, ta.mask); a3 = _mm256_fmadd_ps(w, ta.x, a3); b3 = _mm256_fmadd_ps(w, tb.x, b3);
  }
  *ya = hsum4x8(a0, a1, a2, a3);
  *yb = hsum4x8(b0, b1, b2, b3);
}

// Four weight rows against three input rows: 12 accumulators, each weight vector loaded once and used three
// times, so a verify step of 3 tokens streams each quad from DRAM once with no second pass over it from L1.
// The same order per (weight row, input row) as dot_quad and dot_quad2: bit-identical results.
static inline void dot_quad3(const float* w0, const float* w1, const float* w2, const float* w3,
                             const float* __restrict xa, const float* __restrict xb, const float* __restrict xc,
                             const Tail& ta, const Tail& tb, const Tail& tc, __m128* ya, __m128* yb, __m128* yc) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
  __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
  for (int64_t k = 0; k < ta.n8; k += 8) {
    const __m256 u = _mm256_loadu_ps(xa + k), v = _mm256_loadu_ps(xb + k), x = _mm256_loadu_ps(xc + k);
    __m256 w = _mm256_loadu_ps(w0 + k);
    a0 = _mm256_fmadd_ps(w, u, a0); b0 = _mm256_fmadd_ps(w, v, b0); c0 = _mm256_fmadd_ps(w, x, c0);
    w = _mm256_loadu_ps(w1 + k);
    a1 = _mm256_fmadd_ps(w, u, a1); b1 = _mm256_fmadd_ps(w, v, b1); c1 = _mm256_fmadd_ps(w, x, c1);
    w = _mm256_loadu_ps(w2 + k);
    a2 = _mm256_fmadd_ps(w, u, a2); b2 = _mm256_fmadd_ps(w, v, b2); c2 = _mm256_fmadd_ps(w, x, c2);
    w = _mm256_loadu_ps(w3 + k);
    a3 = _mm256_fmadd_ps(w, u, a3); b3 = _mm256_fmadd_ps(w, v, b3); c3 = _mm256_fmadd_ps(w, x, c3);
  }
  if (ta.rem) {
    __m256 w = _mm256_maskload_ps(w0 + ta.n8, ta.mask);
    a0 = _mm256_fmadd_ps(w, ta.x, a0); b0 = _mm256_fmadd_ps(w, tb.x, b0); c0 = _mm256_fmadd_ps(w, tc.x, c0);
    w = _mm256_maskload_ps(w1 + ta.n8, ta.mask);
    a1 = _mm256_fmadd_ps(w, ta.x, a1); b1 = _mm256_fmadd_ps(w, tb.x, b1); c1 = _mm256_fmadd_ps(w, tc.x, c1);
    w = _mm256_maskload_ps(w2 + ta.n8, ta.mask);
    a2 = _mm256_fmadd_ps(w, ta.x, a2); b2 = _mm256_fmadd_ps(w, tb.x, b2); c2 = _mm256_fmadd_ps(w, tc.x, c2);
    w = _mm256_maskload_ps(w3 + ta.n8, ta.mask);
    a3 = _mm256_fmadd_ps(w, ta.x, a3); b3 = _mm256_fmadd_ps(w, tb.x, b3); c3 = _mm256_fmadd_ps(w, tc.x, c3);
  }
  *ya = hsum4x8(a0, a1, a2, a3);
  *yb = hsum4x8(b0, b1, b2, b3);
  *yc = hsum4x8(c0, c1, c2, c3);
}

static inline void store_quad(float* y, int64_t i0, int64_t Q, __m128 v) {
  alignas(16) float s[4];
  _mm_store_ps(s, v);
  y[i0] = s[0]; y[i0 + Q] = s[1]; y[i0 + 2 * Q] = s[2]; y[i0 + 3 * Q] = s[3];
}

// Rows [r0, r1) of Y = X W^T (+ bias) for M input rows: X (M, in) contiguous, Y (M, out), W (out, in)
// row-major with row stride ld.
// NOTE: the range is cut into 4 equal quarters read side by side (rows r0 + j, r0 + Q + j, ...), so the core
// keeps 4 long sequential DRAM streams in flight instead of one: on this CPU one thread then reads
// 23-27 GB/s against 15-18 for the same loop over consecutive rows (experiments/bench_gemv.py).
// Every weight quad is read from DRAM once for all M rows (pairs of input rows share each load; later
// pairs find the quad in L1), so a few rows cost little more than one: a verify step's k + 1 tokens, a
// small decode batch.
static void gemv_rows(const float* __restrict w, int64_t ld, const float* __restrict x, int64_t M,
                      const float* bias, float* __restrict y, int64_t out, int64_t in, int64_t r0, int64_t r1) {
  std::vector<Tail> tails;
  tails.reserve(M);
  for (int64_t m = 0; m < M; ++m) tails.emplace_back(x + m * in, in);
  const int64_t Q = (r1 - r0) / 4;
  for (int64_t j = 0; j < Q; ++j) {
    const int64_t i0 = r0 + j;
    const float* w0 = w + i0 * ld; const float* w1 = w0 + Q * ld; const float* w2 = w1 + Q * ld;
    const float* w3 = w2 + Q * ld;
    int64_t m = 0;
    // NOTE: input rows in threes, then a pair: 3 and 5 rows (verify steps of k = 2, 4) pass over the quad once
    // and twice instead of twice and three times.
    for (; m + 3 <= M; m += 3) {
      __m128 ya, yb, yc;
      dot_quad3(w0, w1, w2, w3, x + m * in, x + (m + 1) * in, x + (m + 2) * in, tails[m], tails[m + 1],
                tails[m + 2], &ya, &yb, &yc);
      store_quad(y + m * out, i0, Q, ya);
      store_quad(y + (m + 1) * out, i0, Q, yb);
      store_quad(y + (m + 2) * out, i0, Q, yc);
    }
    for (; m + 2 <= M; m += 2) {
      __m128 ya, yb;
      dot_quad2(w0, w1, w2, w3, x + m * in, x + (m + 1) * in, tails[m], tails[m + 1], &ya, &yb);
      store_quad(y + m * out, i0, Q, ya);
      store_quad(y + (m + 1) * out, i0, Q, yb);
    }
    if (m < M) store_quad(y + m * out, i0, Q, dot_quad(w0, w1, w2, w3, x + m * in, tails[m]));
  }
  for (int64_t r = r0 + 4 * Q; r < r1; ++r)
    for (int64_t m = 0; m < M; ++m) y[m * out + r] = dot_row(w + r * ld, x + m * in, in, tails[m]);
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = r0; r < r1; ++r) y[m * out + r] += bias[r];
}

// What both GEMVs (fp32 and fp16 weights) check and share: W (out, in) row-major, x (..., in) with M <= 64 rows.
struct GemvShape { int64_t out, in, ld, M; };

static GemvShape check_gemv(const char* name, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1 && w.stride(0) >= w.size(1), name, ": W must be row-major (out, in)");
  const int64_t out = w.size(0), in = w.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in && x.numel() >= in, name, ": x must have rows of ", in, " values");
  const int64_t M = x.numel() / in;
  TORCH_CHECK(M <= 64, name, ": at most 64 rows (", M, " given); larger batches belong to a GEMM");
  return {out, in, w.stride(0), M};
}

static at::Tensor gemv_output(const at::Tensor& x, int64_t out) {
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  return at::empty(sizes, x.options());
}

// Calls rows(r0, r1) over [0, out). NOTE: max_threads 1 (see THREADS in native_gemv.py) runs on the calling
// thread; otherwise each thread takes one contiguous block of rows, at least 256 KiB of weight, at most
// max_threads blocks (0: as many as torch's intra-op threads).
template <typename Rows>
static void split_rows(int64_t out, int64_t row_bytes, int64_t max_threads, const Rows& rows) {
  if (max_threads == 1) {
    rows(0, out);
    return;
  }
  int64_t grain = std::max<int64_t>(16, (int64_t(1) << 18) / std::max<int64_t>(row_bytes, 1));
  if (max_threads > 1) grain = std::max(grain, (out + max_threads - 1) / max_threads);
  at::parallel_for(0, out, grain, rows);
}

// ---- Weights as GGUF blocks (lab/models/weight_blocks.py): the same fp32 values, a fifth of the bytes ----
// A Q4_1 block (24 bytes) holds 32 weights d * q + m: d, m fp32 (fp16 values), then 16 bytes, byte j = q[j] |
// q[j + 16] << 4; a Q8_0 block (36 bytes) holds d * q: d fp32 (an fp16 value), then q[0..31] int8. Widened in
// registers, d * q is exact (an fp16 d times |q| <= 127) and the FMA rounds d * q + m once, as the dequantizer
// did: each weight is its fp32 expansion's value, bit for bit. The products are then summed in dot_quad's
// order (one 8-wide accumulator per weight row and input row, 8 columns at a time), so the outputs are
// bit-identical to the fp32 GEMV's over the expanded weights, for any number of input rows.
// Where the CPU has AVX-512F/VL (checked at run time: blocks_avx512), every row count runs quad_in_pairs: two weight
// rows' 8-wide accumulators to a 16-wide register, so the same sums take half the instructions, and up to 9 input
// rows keep them in the 32 vector registers AVX-512 gives (AVX2 has 16, enough for 3): the outputs are the AVX2
// path's, bit for bit.
#define LAB_AVX512 __attribute__((target("avx512f,avx512vl")))

static int g_blocks_avx512 = -1;   // -1: not decided yet; 0: AVX2; 1: AVX-512

// mode -1: ask; 0: AVX2 only; 1: AVX-512 where the CPU has it. Returns whether AVX-512 is used from now on.
bool blocks_avx512(int64_t mode) {
  if (mode >= 0 || g_blocks_avx512 < 0)
    g_blocks_avx512 = mode != 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  return g_blocks_avx512 == 1;
}

struct Q4_1Block {
  static constexpr int64_t kBytes = 24;
  static inline void widen(const uint8_t* b, __m256 w[4]) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const float* dm = reinterpret_cast<const float*>(b);
    const __m256 d = _mm256_broadcast_ss(dm), m = _mm256_broadcast_ss(dm + 1);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8));
    const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);   // q[0..15], q[16..31]
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
  }
};

struct Q8_0Block {
  static constexpr int64_t kBytes = 36;
  static inline void widen(const uint8_t* b, __m256 w[4]) {
    const __m256 d = _mm256_broadcast_ss(reinterpret_cast<const float*>(b));
    for (int c = 0; c < 4; ++c) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 4 + 8 * c));
      w[c] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  }
};

// Four block rows (row b0 + i * quarter_bytes for i < 4) against R input rows, widened in registers once for
// all R: 4R accumulators + 4 widened vectors fit AVX2's 16 registers up to R = 3.
template <class Block, int R>
static inline void quad_in_registers(const uint8_t* b0, int64_t quarter_bytes, int64_t nb, const float* __restrict x,
                                     int64_t in, float* y, int64_t out, int64_t i0, int64_t Q) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < 4; ++i) {
      __m256 w[4];
      Block::widen(b0 + i * quarter_bytes + b * Block::kBytes, w);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * in + b * 32;
        for (int c = 0; c < 4; ++c) acc[r][i] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(xb + 8 * c), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_quad(y + r * out, i0, Q, hsum4x8(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

// ---- The same sums in AVX-512 registers, two weight rows to a register ----
// A 16-wide register holds the 8-wide accumulators of two weight rows side by side ([row a | row b]), and each
// 8 columns of an input row are loaded once into both halves: one 16-wide FMA does what two 8-wide ones did,
// lane for lane the same products summed in the same order, so the outputs are the 8-wide code's, bit for bit.
// Widening two rows' blocks into one register halves that work too. 2R accumulators + 8 widened vectors fit the
// 32 registers up to R = 9 input rows (10 spilled on the Q8_0 head); more rows run in chunks of at most 9 over the
// quad (then in L1).

// [s(a) x 8 | s(b) x 8] for two fp32 scalars (a block's d or m in two rows)
LAB_AVX512 static inline __m512 pair_scalars(const float* a, const float* b) {
  return _mm512_mask_broadcastss_ps(_mm512_set1_ps(*a), 0xFF00, _mm_load_ss(b));
}

struct Q4_1Pair {
  // Blocks a and b -> w[c] = [row a's columns 8c..8c+7 | row b's], each d q + m rounded once as Q4_1Block::widen.
  LAB_AVX512 static inline void widen(const uint8_t* a, const uint8_t* b, __m512 w[4]) {
    const __m512 d = pair_scalars(reinterpret_cast<const float*>(a), reinterpret_cast<const float*>(b));
    const __m512 m = pair_scalars(reinterpret_cast<const float*>(a) + 1, reinterpret_cast<const float*>(b) + 1);
    const __m128i qa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 8));
    const __m128i qb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8));
    const __m512i low4 = _mm512_set1_epi32(0x0F);
    // bytes 0-7 hold columns 0-7 (low nibbles) and 16-23 (high); bytes 8-15 columns 8-15 and 24-31
    const __m512i first = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(qa, qb));
    const __m512i second = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(qa, qb));
    w[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(first, low4)), m);
    w[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(second, low4)), m);
    w[2] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(first, 4)), m);
    w[3] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(second, 4)), m);
  }
};

struct Q8_0Pair {
  // Blocks a and b -> w[c] = [row a's columns 8c..8c+7 | row b's], each d q as Q8_0Block::widen.
  LAB_AVX512 static inline void widen(const uint8_t* a, const uint8_t* b, __m512 w[4]) {
    const __m512 d = pair_scalars(reinterpret_cast<const float*>(a), reinterpret_cast<const float*>(b));
    for (int h = 0; h < 2; ++h) {
      const __m128i qa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 4 + 16 * h));
      const __m128i qb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4 + 16 * h));
      w[2 * h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(qa, qb))));
      w[2 * h + 1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(qa, qb))));
    }
  }
};

template <class Block> struct PairOf;
template <> struct PairOf<Q4_1Block> { using type = Q4_1Pair; };
template <> struct PairOf<Q8_0Block> { using type = Q8_0Pair; };

// quad_in_registers' sums for R <= 9 input rows, two weight rows to a 16-wide register (bit-identical).
template <class Block, int R>
LAB_AVX512 static void quad_in_pairs(const uint8_t* b0, int64_t quarter_bytes, int64_t nb, const float* __restrict x,
                                     int64_t in, float* y, int64_t out, int64_t i0, int64_t Q) {
  using Pair = typename PairOf<Block>::type;
  __m512 acc[R][2];                                  // [r][0] = weight rows 0 | 1, [r][1] = rows 2 | 3
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = b0 + b * Block::kBytes;
    __m512 w01[4], w23[4];
    Pair::widen(blk, blk + quarter_bytes, w01);
    Pair::widen(blk + 2 * quarter_bytes, blk + 3 * quarter_bytes, w23);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * in + b * 32;
      for (int c = 0; c < 4; ++c) {
        const __m512 u = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(xb + 8 * c))));
        acc[r][0] = _mm512_fmadd_ps(w01[c], u, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w23[c], u, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 a0 = _mm512_castps512_ps256(acc[r][0]);
    const __m256 a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][0]), 1));
    const __m256 a2 = _mm512_castps512_ps256(acc[r][1]);
    const __m256 a3 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][1]), 1));
    store_quad(y + r * out, i0, Q, hsum4x8(a0, a1, a2, a3));
  }
}

// One quad against M input rows (any M), in chunks of at most 9 rows as even as they come.
template <class Block>
LAB_AVX512 static void quad_avx512(const uint8_t* b0, int64_t quarter_bytes, int64_t nb, const float* x, int64_t M,
                                   int64_t in, float* y, int64_t out, int64_t i0, int64_t Q) {
  const int64_t chunks = (M + 8) / 9;
  for (int64_t k = 0, m = 0; k < chunks; ++k) {
    const int64_t rows = (M - m) / (chunks - k);
    const float* xm = x + m * in;
    float* ym = y + m * out;
    switch (rows) {
#define LAB_PAIR_ROWS(R) case R: quad_in_pairs<Block, R>(b0, quarter_bytes, nb, xm, in, ym, out, i0, Q); break;
      LAB_PAIR_ROWS(1) LAB_PAIR_ROWS(2) LAB_PAIR_ROWS(3) LAB_PAIR_ROWS(4) LAB_PAIR_ROWS(5)
      LAB_PAIR_ROWS(6) LAB_PAIR_ROWS(7) LAB_PAIR_ROWS(8) default: LAB_PAIR_ROWS(9)
#undef LAB_PAIR_ROWS
    }
    m += rows;
  }
}

template <class Block>
static inline void widen_row(const uint8_t* b, int64_t nb, float* w) {
  for (int64_t j = 0; j < nb; ++j) {
    __m256 v[4];
    Block::widen(b + j * Block::kBytes, v);
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(w + 32 * j + 8 * c, v[c]);
  }
}

// Rows [r0, r1) of Y = X W^T (+ bias) for M input rows, W as blocks (out rows of ld bytes, in = 32 nb columns):
// gemv_rows' four side-by-side streams. With AVX-512 any number of input rows widen each block in registers, once
// per 9 rows (quad_avx512); with AVX2 up to 3 do, and more widen the four rows into an L1 scratch once and run
// gemv_rows' own quad kernels over it.
template <class Block>
static void gemv_block_rows(const uint8_t* __restrict w, int64_t ld, const float* __restrict x, int64_t M,
                            const float* bias, float* __restrict y, int64_t out, int64_t in, int64_t r0, int64_t r1) {
  const int64_t nb = in / 32, Q = (r1 - r0) / 4;
  const bool pairs = blocks_avx512(-1);
  std::vector<float> scratch(!pairs && M > 3 ? 4 * in : 0);
  std::vector<Tail> tails;
  if (!pairs && M > 3) {
    tails.reserve(M);
    for (int64_t m = 0; m < M; ++m) tails.emplace_back(x + m * in, in);
  }
  for (int64_t j = 0; j < Q; ++j) {
    const int64_t i0 = r0 + j;
    const uint8_t* b0 = w + i0 * ld;
    if (pairs) {
      quad_avx512<Block>(b0, Q * ld, nb, x, M, in, y, out, i0, Q);
    } else if (M <= 3) {
      switch (M) {
        case 1: quad_in_registers<Block, 1>(b0, Q * ld, nb, x, in, y, out, i0, Q); break;
        case 2: quad_in_registers<Block, 2>(b0, Q * ld, nb, x, in, y, out, i0, Q); break;
        default: quad_in_registers<Block, 3>(b0, Q * ld, nb, x, in, y, out, i0, Q); break;
      }
    } else {
      float* s = scratch.data();
      for (int i = 0; i < 4; ++i) widen_row<Block>(b0 + i * Q * ld, nb, s + i * in);
      int64_t m = 0;
      for (; m + 3 <= M; m += 3) {
        __m128 ya, yb, yc;
        dot_quad3(s, s + in, s + 2 * in, s + 3 * in, x + m * in, x + (m + 1) * in, x + (m + 2) * in, tails[m],
                  tails[m + 1], tails[m + 2], &ya, &yb, &yc);
        store_quad(y + m * out, i0, Q, ya);
        store_quad(y + (m + 1) * out, i0, Q, yb);
        store_quad(y + (m + 2) * out, i0, Q, yc);
      }
      for (; m + 2 <= M; m += 2) {
        __m128 ya, yb;
        dot_quad2(s, s + in, s + 2 * in, s + 3 * in, x + m * in, x + (m + 1) * in, tails[m], tails[m + 1], &ya, &yb);
        store_quad(y + m * out, i0, Q, ya);
        store_quad(y + (m + 1) * out, i0, Q, yb);
      }
      if (m < M) store_quad(y + m * out, i0, Q, dot_quad(s, s + in, s + 2 * in, s + 3 * in, x + m * in, tails[m]));
    }
  }
  if (r0 + 4 * Q < r1) {               // the rows the four streams leave over, one at a time
    std::vector<float> row(in);
    for (int64_t r = r0 + 4 * Q; r < r1; ++r) {
      widen_row<Block>(w + r * ld, nb, row.data());
      for (int64_t m = 0; m < M; ++m) {
        const Tail t(x + m * in, in);
        y[m * out + r] = dot_row(row.data(), x + m * in, in, t);
      }
    }
  }
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = r0; r < r1; ++r) y[m * out + r] += bias[r];
}

%(TILES_SOURCE)s

// x (..., in) with M rows (M <= 64); w (out, in / 32 * bytes per block): uint8 = Q4_1 blocks, int8 = Q8_0; bias
// (out,) fp32 or None -> (..., out), bit-identical to gemv over the weights the blocks expand to. A 3-D w holds
// the blocks in AMX tile order (lab/models/native_tiles.py): within fp32 rounding, not bit-identical.
at::Tensor gemv_blocks(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias, int64_t max_threads) {
  if (w.dim() == 3) return gemv_tiles(x, w, bias, max_threads);
  const bool q4 = w.scalar_type() == at::kByte;
  TORCH_CHECK(q4 || w.scalar_type() == at::kChar, "gemv_blocks: W must be uint8 (Q4_1) or int8 (Q8_0) blocks");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gemv_blocks: x must be fp32");
  const int64_t bytes = q4 ? Q4_1Block::kBytes : Q8_0Block::kBytes;
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) % bytes == 0,
              "gemv_blocks: W must be contiguous (out, blocks * ", bytes, " bytes)");
  const int64_t out = w.size(0), in = w.size(1) / bytes * 32, ld = w.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in && x.numel() >= in, "gemv_blocks: x must have rows of ", in, " values");
  const int64_t M = x.numel() / in;
  TORCH_CHECK(M <= 64, "gemv_blocks: at most 64 rows (", M, " given); larger batches belong to a GEMM");
  at::Tensor xc = x.contiguous();
  at::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == out, "gemv_blocks: bias must be fp32 (out,)");
    bp = bc.data_ptr<float>();
  }
  at::Tensor y = gemv_output(x, out);
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const float* xp = xc.data_ptr<float>(); float* yp = y.data_ptr<float>();
  // NOTE: the fp32 GEMV's split (its row bytes), so every row lands in a quad or among the leftover rows as there:
  // the two sum a quad's rows and a leftover row in different orders.
  split_rows(out, in * 4, max_threads, [&](int64_t r0, int64_t r1) {
    if (q4) gemv_block_rows<Q4_1Block>(wp, ld, xp, M, bp, yp, out, in, r0, r1);
    else gemv_block_rows<Q8_0Block>(wp, ld, xp, M, bp, yp, out, in, r0, r1);
  });
  return y;
}

// x (..., in) with M rows in all (M <= 64); w (out, in) with unit stride along `in`, or GGUF blocks (gemv_blocks);
// bias (out,) or None -> (..., out).
at::Tensor gemv(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias, int64_t max_threads) {
  if (w.scalar_type() == at::kByte || w.scalar_type() == at::kChar) return gemv_blocks(x, w, bias, max_threads);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "gemv: fp32 only");
  const GemvShape g = check_gemv("gemv", x, w);
  const int64_t out = g.out, in = g.in, ld = g.ld, M = g.M;
  at::Tensor xc = x.contiguous();
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == out, "gemv: bias must be fp32 (out,)");
    bp = bc.data_ptr<float>();
  }
  at::Tensor y = gemv_output(x, out);
  const float* wp = w.data_ptr<float>(); const float* xp = xc.data_ptr<float>(); float* yp = y.data_ptr<float>();
  split_rows(out, in * 4, max_threads, [&](int64_t r0, int64_t r1) { gemv_rows(wp, ld, xp, M, bp, yp, out, in, r0, r1); });
  return y;
}

// The same GEMV over fp16 weights (W (out, in) as IEEE half, row-major): half the bytes to stream, each weight
// widened to fp32 in registers (F16C), the arithmetic in fp32. For drafters, whose outputs need not be exact
// (the target verifies every draft): never for the target's own weights.
static inline __m256 load_h8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

static inline float dot_row_f16(const at::Half* __restrict w, const float* __restrict x, int64_t in) {
  __m256 a = _mm256_setzero_ps();
  const int64_t n8 = in & ~int64_t(7);
  for (int64_t k = 0; k < n8; k += 8) a = _mm256_fmadd_ps(load_h8(w + k), _mm256_loadu_ps(x + k), a);
  float s = hsum8(a);
  for (int64_t k = n8; k < in; ++k) s += static_cast<float>(w[k]) * x[k];
  return s;
}

// Rows [r0, r1) of Y = X W^T for M input rows, four side-by-side weight streams as gemv_rows, input rows in pairs.
static void gemv_f16_rows(const at::Half* __restrict w, int64_t ld, const float* __restrict x, int64_t M,
                          float* __restrict y, int64_t out, int64_t in, int64_t r0, int64_t r1) {
  const int64_t n8 = in & ~int64_t(7);
  const int64_t Q = n8 == in ? (r1 - r0) / 4 : 0;    // NOTE: a ragged `in` takes the plain loop below
  for (int64_t j = 0; j < Q; ++j) {
    const int64_t i0 = r0 + j;
    const at::Half* w0 = w + i0 * ld; const at::Half* w1 = w0 + Q * ld; const at::Half* w2 = w1 + Q * ld;
    const at::Half* w3 = w2 + Q * ld;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
      const float* xa = x + m * in; const float* xb = xa + in;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
      for (int64_t k = 0; k < n8; k += 8) {
        const __m256 u = _mm256_loadu_ps(xa + k), v = _mm256_loadu_ps(xb + k);
        __m256 t = load_h8(w0 + k); a0 = _mm256_fmadd_ps(t, u, a0); b0 = _mm256_fmadd_ps(t, v, b0);
        t = load_h8(w1 + k); a1 = _mm256_fmadd_ps(t, u, a1); b1 = _mm256_fmadd_ps(t, v, b1);
        t = load_h8(w2 + k); a2 = _mm256_fmadd_ps(t, u, a2); b2 = _mm256_fmadd_ps(t, v, b2);
        t = load_h8(w3 + k); a3 = _mm256_fmadd_ps(t, u, a3); b3 = _mm256_fmadd_ps(t, v, b3);
      }
      store_quad(y + m * out, i0, Q, hsum4x8(a0, a1, a2, a3));
      store_quad(y + (m + 1) * out, i0, Q, hsum4x8(b0, b1, b2, b3));
    }
    if (m < M) {
      const float* xa = x + m * in;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int64_t k = 0; k < n8; k += 8) {
        const __m256 u = _mm256_loadu_ps(xa + k);
        a0 = _mm256_fmadd_ps(load_h8(w0 + k), u, a0);
        a1 = _mm256_fmadd_ps(load_h8(w1 + k), u, a1);
        a2 = _mm256_fmadd_ps(load_h8(w2 + k), u, a2);
        a3 = _mm256_fmadd_ps(load_h8(w3 + k), u, a3);
      }
      store_quad(y + m * out, i0, Q, hsum4x8(a0, a1, a2, a3));
    }
  }
  for (int64_t r = r0 + 4 * Q; r < r1; ++r)
    for (int64_t m = 0; m < M; ++m) y[m * out + r] = dot_row_f16(w + r * ld, x + m * in, in);
}

// x (..., in) fp32 with M rows (M <= 64); w (out, in) fp16 with unit stride along `in`; bias (out,) fp32 or None
// -> (..., out) fp32.
at::Tensor gemv_f16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias, int64_t max_threads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kHalf, "gemv_f16: fp32 x, fp16 W");
  const GemvShape g = check_gemv("gemv_f16", x, w);
  const int64_t out = g.out, in = g.in, ld = g.ld, M = g.M;
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->numel() == out), "gemv_f16: bias must be fp32 (out,)");
  at::Tensor xc = x.contiguous();
  at::Tensor y = gemv_output(x, out);
  const at::Half* wp = w.data_ptr<at::Half>(); const float* xp = xc.data_ptr<float>(); float* yp = y.data_ptr<float>();
  split_rows(out, in * 2, max_threads, [&](int64_t r0, int64_t r1) { gemv_f16_rows(wp, ld, xp, M, yp, out, in, r0, r1); });
  if (has_bias) y.add_(*bias);
  return y;
}

// exp for x <= 0 (softmax after subtracting the max; SiLU's exp(-|g|)): Cephes' polynomial, ~1e-7 relative.
static inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// x (..., H) -> x * rsqrt(mean(x^2) + eps) * w, row by row (HF's RMSNorm in fp32).
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: fp32 only");
  const int64_t H = w.numel();
  TORCH_CHECK(x.size(-1) == H, "rms_norm: last dim must be ", H);
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  const float* xp = xc.data_ptr<float>(); const float* wp = wc.data_ptr<float>(); float* yp = y.data_ptr<float>();
  const int64_t rows = H ? xc.numel() / H : 0, h8 = H & ~int64_t(7);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * H; float* yr = yp + r * H;
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= H; k += 16) {
      const __m256 u = _mm256_loadu_ps(xr + k), v = _mm256_loadu_ps(xr + k + 8);
      a = _mm256_fmadd_ps(u, u, a); b = _mm256_fmadd_ps(v, v, b);
    }
    for (; k < h8; k += 8) { const __m256 u = _mm256_loadu_ps(xr + k); a = _mm256_fmadd_ps(u, u, a); }
    float ss = hsum8(_mm256_add_ps(a, b));
    for (; k < H; ++k) ss += xr[k] * xr[k];
    const float inv = 1.f / std::sqrt(ss / float(H) + float(eps));
    const __m256 iv = _mm256_set1_ps(inv);
    for (k = 0; k < h8; k += 8)
      _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), iv), _mm256_loadu_ps(wp + k)));
    for (; k < H; ++k) yr[k] = xr[k] * inv * wp[k];
  }
  return y;
}

// (x + a, RMSNorm(x + a) * w) for x, a (..., H): the residual add and the next norm in one pass.
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor a, at::Tensor w, double eps) {
  TORCH_CHECK(x.sizes() == a.sizes() && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat,
              "add_rms_norm: x and a must be fp32 of one shape");
  at::Tensor sum = at::add(x, a);
  return {sum, rms_norm(sum, w, eps)};
}

// RoPE, HF's non-interleaved convention: x (B, T, H, D) with unit stride in D and rows of H * D; cos and
// signed_sin (B, T, 1, D) with unit stride in D (first half of signed_sin negated, as RotaryEmbedding
// serves it) -> x * cos + roll(x, D / 2) * signed_sin, contiguous (B, T, H, D).
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 4 && sin.dim() == 4 && x.scalar_type() == at::kFloat &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rope: fp32 (B, T, H, D)");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && x.stride(3) == 1 && x.stride(2) == D && cos.stride(3) == 1 && sin.stride(3) == 1 &&
              cos.size(0) == B && cos.size(1) == T && cos.size(3) == D && sin.sizes() == cos.sizes(),
              "rope: unsupported layout");
  at::Tensor out = at::empty({B, T, H, D}, x.options());
  const float* xp = x.data_ptr<float>(); const float* cp = cos.data_ptr<float>(); const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t h8 = half & ~int64_t(7);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* c = cp + b * cos.stride(0) + t * cos.stride(1);
      const float* sn = sp + b * sin.stride(0) + t * sin.stride(1);
      for (int64_t h = 0; h < H; ++h) {
        const float* xr = xp + b * x.stride(0) + t * x.stride(1) + h * D;
        float* o = op + ((b * T + t) * H + h) * D;
        int64_t d = 0;
        for (; d < h8; d += 8) {
          const __m256 lo = _mm256_loadu_ps(xr + d), hi = _mm256_loadu_ps(xr + half + d);
          _mm256_storeu_ps(o + d, _mm256_fmadd_ps(hi, _mm256_loadu_ps(sn + d), _mm256_mul_ps(lo, _mm256_loadu_ps(c + d))));
          _mm256_storeu_ps(o + half + d, _mm256_fmadd_ps(lo, _mm256_loadu_ps(sn + half + d),
                                                          _mm256_mul_ps(hi, _mm256_loadu_ps(c + half + d))));
        }
        for (; d < half; ++d) {
          const float lo = xr[d], hi = xr[half + d];
          o[d] = lo * c[d] + hi * sn[d];
          o[half + d] = hi * c[half + d] + lo * sn[half + d];
        }
      }
    }
  return out;
}

// x (..., V) -> (...) int64: each row's first index of its largest value, NaN counting as largest (the first NaN),
// as torch.argmax(-1). Two vectorised passes over a row (its max, then where it first occurs) instead of torch's
// scalar index-tracking loop, ~7x faster on a 49152-token head's rows, which are still in cache from the head.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) > 0, "argmax_rows: fp32 (..., V), V > 0");
  at::Tensor xc = x.contiguous();
  const int64_t V = xc.size(-1), rows = xc.numel() / V, v8 = V & ~int64_t(7);
  at::Tensor out = at::empty(xc.sizes().slice(0, xc.dim() - 1), xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>(); int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xp + r * V;
    __m256 best = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (int64_t i = 0; i < v8; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      best = _mm256_max_ps(best, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, best);
    float top = lanes[0];
    for (int j = 1; j < 8; ++j) top = lanes[j] > top ? lanes[j] : top;
    bool nan = _mm256_movemask_ps(unordered) != 0;
    for (int64_t i = v8; i < V; ++i) {
      nan = nan || std::isnan(row[i]);
      top = row[i] > top ? row[i] : top;
    }
    int64_t index = 0;
    if (nan) {
      while (!std::isnan(row[index])) ++index;
    } else {
      const __m256 target = _mm256_set1_ps(top);
      int64_t i = 0;
      for (; i < v8; i += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ));
        if (hits) break;
      }
      while (row[i] != top) ++i;
      index = i;
    }
    op[r] = index;
  }
  return out;
}

// gu (..., 2I) = [gate | up] -> silu(gate) * up (..., I), row by row.
at::Tensor silu_mul(at::Tensor gu) {
  TORCH_CHECK(gu.scalar_type() == at::kFloat && gu.size(-1) % 2 == 0, "silu_mul: fp32 (..., 2I)");
  at::Tensor gc = gu.contiguous();
  const int64_t I = gc.size(-1) / 2, rows = I ? gc.numel() / (2 * I) : 0, i8 = I & ~int64_t(7);
  auto sizes = gc.sizes().vec();
  sizes.back() = I;
  at::Tensor y = at::empty(sizes, gc.options());
  const float* gp = gc.data_ptr<float>(); float* yp = y.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gp + r * 2 * I; const float* u = g + I; float* yr = yp + r * I;
    int64_t k = 0;
    for (; k < i8; k += 8) {
      const __m256 gv = _mm256_loadu_ps(g + k);
      // NOTE: sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) for g < 0; no overflow.
      const __m256 e = exp256(_mm256_or_ps(gv, sign));
      const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
      const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), gv);
      _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + k)));
    }
    for (; k < I; ++k) yr[k] = g[k] / (1.f + std::exp(-g[k])) * u[k];
  }
  return y;
}

// Softmax attention of G query heads (q (G, D)) over n keys of one KV head, stored in blocks of bs
// consecutive D-wide rows: key t at kb[t / bs] + (t % bs) * D, value t likewise in vb (a contiguous cache
// is one block). out (G, D); s: room for attention_scores_size(G, n) floats. Scores, max, exp and sums in fp32.
// NOTE: the query heads of a group (up to 3 at a time, GQA) share every load of a key and of a value row:
// SmolLM2's 3 heads per KV head used to read the keys and values 3 times, in a loop that was compute-bound
// even on cached K/V (28 cycles per head and key on this CPU; docs/profiling.md).
// NOTE: each key's score is one 8-wide FMA chain over D reduced by hsum4x8, and each output sums the keys
// in order in one chain, so nothing depends on how the keys are split into blocks: a paged decode is
// bit-identical to `ar`'s decode over the same keys in one contiguous cache.
static inline int64_t attention_scores_ld(int64_t n) { return (n + 7) & ~int64_t(7); }
static inline int64_t attention_scores_size(int64_t G, int64_t n) { return G * attention_scores_ld(n); }

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

static inline void prefetch_rows(const float* rows, int64_t count, int64_t D) {
  const char* p = reinterpret_cast<const char*>(rows);
  for (int64_t offset = 0; offset < count * D * int64_t(sizeof(float)); offset += 64) _mm_prefetch(p + offset, _MM_HINT_T0);
}

// The rows one attention pass serves: OneRow (8 lanes), or TwoRows of one sequence (consecutive tokens of a verify
// step: the same blocks) in AVX-512 registers, row 0's 8 lanes below and row 1's above, so each K or V chunk is loaded
// once for both rows and one FMA serves both. score_keys and accumulate_values are written once over them, and every
// lane runs the same 8-wide arithmetic (the FMA chains in key order, the hsum4x8 tree), so a row's output does not
// depend on which served it, bit for bit. TwoRows is compiled for AVX-512 (its callers are flattened into
// attend_kv_head_pair) and used where the CPU has it (attention_pairs).
struct OneRow {
  using Vec = __m256;
  const float* q;             // GC heads of D values
  int64_t D;
  float* s;                   // scores, then numerators: GC rows of stride ld
  int64_t ld;
  float* out;                 // GC heads of D values
  const float* inv;           // GC: 1 / the numerators' sum
  static inline Vec zero() { return _mm256_setzero_ps(); }
  static inline Vec chunk(const float* p) { return _mm256_loadu_ps(p); }          // 8 values of a key or a value
  static inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  inline Vec query(int g, int64_t d) const { return _mm256_loadu_ps(q + g * D + d); }
  inline void scores4(int g, int64_t key, const Vec* acc, __m128 scale) const {
    _mm_storeu_ps(s + g * ld + key, _mm_mul_ps(hsum4x8(acc[0], acc[1], acc[2], acc[3]), scale));
  }
  inline void score1(int g, int64_t key, Vec acc, __m128 scale) const {
    const __m256 zero = _mm256_setzero_ps();
    s[g * ld + key] = _mm_cvtss_f32(_mm_mul_ps(hsum4x8(acc, zero, zero, zero), scale));
  }
  inline Vec weight(int g, int64_t key) const { return _mm256_broadcast_ss(s + g * ld + key); }
  inline void output(int g, int64_t d, Vec acc) const {
    _mm256_storeu_ps(out + g * D + d, _mm256_mul_ps(acc, _mm256_set1_ps(inv[g])));
  }
};

LAB_AVX512 static inline __m256 upper_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

LAB_AVX512 static inline __m512 pair_of(float lo, float hi) {       // lo in the lower 8 lanes, hi in the upper
  return _mm512_mask_broadcastss_ps(_mm512_set1_ps(lo), 0xFF00, _mm_set_ss(hi));
}

struct TwoRows {
  using Vec = __m512;
  const float* pairs;         // (head g, chunk c): row 0's 8 query values, then row 1's
  int64_t D;
  float* s[2];
  int64_t ld;
  float* out[2];
  const float* inv[2];
  LAB_AVX512 static inline Vec zero() { return _mm512_setzero_ps(); }
  LAB_AVX512 static inline Vec chunk(const float* p) {                          // 8 values, in both halves
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
  }
  LAB_AVX512 static inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  LAB_AVX512 inline Vec query(int g, int64_t d) const { return _mm512_load_ps(pairs + (g * D + d) * 2); }
  LAB_AVX512 inline void scores4(int g, int64_t key, const Vec* acc, __m128 scale) const {
    const __m256 lo0 = _mm512_castps512_ps256(acc[0]), lo1 = _mm512_castps512_ps256(acc[1]);
    const __m256 lo2 = _mm512_castps512_ps256(acc[2]), lo3 = _mm512_castps512_ps256(acc[3]);
    _mm_storeu_ps(s[0] + g * ld + key, _mm_mul_ps(hsum4x8(lo0, lo1, lo2, lo3), scale));
    _mm_storeu_ps(s[1] + g * ld + key, _mm_mul_ps(hsum4x8(upper_half(acc[0]), upper_half(acc[1]), upper_half(acc[2]),
                                                          upper_half(acc[3])), scale));
  }
  LAB_AVX512 inline void score1(int g, int64_t key, Vec acc, __m128 scale) const {
    const __m256 zero = _mm256_setzero_ps();
    s[0][g * ld + key] = _mm_cvtss_f32(_mm_mul_ps(hsum4x8(_mm512_castps512_ps256(acc), zero, zero, zero), scale));
    s[1][g * ld + key] = _mm_cvtss_f32(_mm_mul_ps(hsum4x8(upper_half(acc), zero, zero, zero), scale));
  }
  LAB_AVX512 inline Vec weight(int g, int64_t key) const { return pair_of(s[0][g * ld + key], s[1][g * ld + key]); }
  LAB_AVX512 inline void output(int g, int64_t d, Vec acc) const {
    const __m512 o = _mm512_mul_ps(acc, pair_of(inv[0][g], inv[1][g]));
    _mm256_storeu_ps(out[0] + g * D + d, _mm512_castps512_ps256(o));
    _mm256_storeu_ps(out[1] + g * D + d, upper_half(o));
  }
};

// s_g[t] = sc * q_g . k_t for the rows' GC heads over keys [0, n), 4 keys at a time.
template <class Rows, int GC>
static inline void score_keys(const Rows& rows, int64_t D, const float* const* kb, const float* const* vb, int64_t bs,
                              int64_t n, float sc) {
  using Vec = typename Rows::Vec;
  const __m128 scale = _mm_set1_ps(sc);
  const int64_t nb = (n + bs - 1) / bs;
  for (int64_t j = 0, base = 0; base < n; ++j, base += bs) {
    const float* kj = kb[j];
    const int64_t m = std::min(bs, n - base);
    int64_t t = 0;
    for (; t + 4 <= m; t += 4) {
      const float* k0 = kj + t * D;
      // NOTE: each key quad requests the same rows of the next block's keys and of this block's values:
      // blocks are scattered pieces where the hardware prefetcher stops at every boundary.
      if (j + 1 < nb) prefetch_rows(kb[j + 1] + t * D, 4, D);
      prefetch_rows(vb[j] + t * D, 4, D);
      Vec acc[GC][4];
      for (int g = 0; g < GC; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = Rows::zero();
      for (int64_t d = 0; d < D; d += 8) {
        const Vec x0 = Rows::chunk(k0 + d), x1 = Rows::chunk(k0 + D + d);
        const Vec x2 = Rows::chunk(k0 + 2 * D + d), x3 = Rows::chunk(k0 + 3 * D + d);
        for (int g = 0; g < GC; ++g) {
          const Vec qv = rows.query(g, d);
          acc[g][0] = Rows::fma(x0, qv, acc[g][0]);
          acc[g][1] = Rows::fma(x1, qv, acc[g][1]);
          acc[g][2] = Rows::fma(x2, qv, acc[g][2]);
          acc[g][3] = Rows::fma(x3, qv, acc[g][3]);
        }
      }
      for (int g = 0; g < GC; ++g) rows.scores4(g, base + t, acc[g], scale);
    }
    for (; t < m; ++t) {                     // the block's last keys, with the same per-key arithmetic
      const float* kt = kj + t * D;
      Vec acc[GC];
      for (int g = 0; g < GC; ++g) acc[g] = Rows::zero();
      for (int64_t d = 0; d < D; d += 8) {
        const Vec x = Rows::chunk(kt + d);
        for (int g = 0; g < GC; ++g) acc[g] = Rows::fma(x, rows.query(g, d), acc[g]);
      }
      for (int g = 0; g < GC; ++g) rows.score1(g, base + t, acc[g], scale);
    }
  }
}

// s[0:n] -> exp(s - max), zeros in s[n:ld]; returns 1 / sum.
static inline float softmax_numerators(float* s, int64_t n) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  float mx = hmax8(mv);
  for (int64_t u = t; u < n; ++u) mx = s[u] > mx ? s[u] : mx;
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mxv));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (t < n) {                               // the last n % 8 scores, under a mask; zeros past n
    const __m256 live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(float(n - t)), _CMP_LT_OQ);
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mxv)), live);
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  return 1.f / hsum8(sum);
}


// out_g = inv_g * sum_t s_g[t] v_t for the rows' GC heads over keys [0, n), 32 columns of D at a time (12
// accumulators at GC = 3).
template <class Rows, int GC>
static inline void accumulate_values(const Rows& rows, int64_t D, const float* const* vb, int64_t bs, int64_t n) {
  using Vec = typename Rows::Vec;
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) {
    Vec acc[GC][4];
    for (int g = 0; g < GC; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = Rows::zero();
    for (int64_t j = 0, base = 0; base < n; ++j, base += bs) {
      const float* vj = vb[j] + d0;
      const int64_t m = std::min(bs, n - base);
      for (int64_t u = 0; u < m; ++u) {
        const float* vt = vj + u * D;
        Vec p[GC];
        for (int g = 0; g < GC; ++g) p[g] = rows.weight(g, base + u);
        for (int i = 0; i < 4; ++i) {
          const Vec v = Rows::chunk(vt + 8 * i);
          for (int g = 0; g < GC; ++g) acc[g][i] = Rows::fma(p[g], v, acc[g][i]);
        }
      }
    }
    for (int g = 0; g < GC; ++g)
      for (int i = 0; i < 4; ++i) rows.output(g, d0 + 8 * i, acc[g][i]);
  }
  for (; d0 < D; d0 += 8) {
    Vec acc[GC];
    for (int g = 0; g < GC; ++g) acc[g] = Rows::zero();
    for (int64_t j = 0, base = 0; base < n; ++j, base += bs) {
      const int64_t m = std::min(bs, n - base);
      for (int64_t u = 0; u < m; ++u) {
        const Vec v = Rows::chunk(vb[j] + u * D + d0);
        for (int g = 0; g < GC; ++g) acc[g] = Rows::fma(rows.weight(g, base + u), v, acc[g]);
      }
    }
    for (int g = 0; g < GC; ++g) rows.output(g, d0, acc[g]);
  }
}

// One row's scores for GC heads (stride ld, computed over keys [0, n), n >= its own) -> its softmax numerators over
// its own keys, 1 / their sum per head into inv, and 0 at the keys it may not see. `hidden`: keys the query may not
// see (a tree of drafts: a node sees its ancestors, not its siblings), bit b for key own - 1 - b. Their scores go to
// -inf before the softmax and their numerators to exactly 0 after it: exp256 clamps at e^-87, which adds nothing to a
// sum that holds the maximum's 1, so the sums over the keys a row sees are the ones a plain row over the same keys
// computes, with zeros between them; keys past its own (the longer row's of a pair) get 0 too.
template <int GC>
static inline void row_numerators(float* s, int64_t ld, int64_t own, int64_t n, uint64_t hidden, float* inv) {
  for (uint64_t bits = hidden; bits; bits &= bits - 1)
    for (int g = 0; g < GC; ++g) s[g * ld + own - 1 - __builtin_ctzll(bits)] = -INFINITY;
  for (int g = 0; g < GC; ++g) {
    inv[g] = softmax_numerators(s + g * ld, own);
    std::fill(s + g * ld + own, s + g * ld + n, 0.f);
  }
  for (uint64_t bits = hidden; bits; bits &= bits - 1)
    for (int g = 0; g < GC; ++g) s[g * ld + own - 1 - __builtin_ctzll(bits)] = 0.f;
}

// attend(gc, g) for each group of at most 3 of a KV head's G query heads (12 accumulators a pass at 3).
template <class Attend>
static inline void by_query_groups(int64_t G, Attend attend) {
  for (int64_t g = 0; g < G; g += 3) {
    const int64_t gc = std::min<int64_t>(3, G - g);
    if (gc == 3) attend(std::integral_constant<int, 3>(), g);
    else if (gc == 2) attend(std::integral_constant<int, 2>(), g);
    else attend(std::integral_constant<int, 1>(), g);
  }
}

// One query row's G heads (q, out: G x D) over the n keys of one KV head, in blocks kb/vb of bs keys.
// NOTE: flatten inlines the struct, lambda and templates into one body, as hand-written loops (else ~1.5x slower)
__attribute__((flatten)) static void attend_kv_head(const float* q, int64_t G, int64_t D, const float* const* kb,
                                                    const float* const* vb, int64_t bs, int64_t n, float sc, float* out,
                                                    float* s, uint64_t hidden = 0) {
  by_query_groups(G, [&](auto gc, int64_t g) {
    constexpr int GC = decltype(gc)::value;
    float inv[GC];
    const OneRow rows{q + g * D, D, s, attention_scores_ld(n), out + g * D, inv};
    score_keys<OneRow, GC>(rows, D, kb, vb, bs, n, sc);
    row_numerators<GC>(s, rows.ld, n, n, hidden, inv);
    accumulate_values<OneRow, GC>(rows, D, vb, bs, n);
  });
}

static int g_attention_pairs = 1;
constexpr int64_t kMaxPairedHeadDim = 256;

// mode -1: ask; 0: off; 1: on where the CPU has AVX-512 (blocks_avx512). Whether paged_decode attends consecutive
// rows of one sequence two at a time (TwoRows) from now on.
bool attention_pairs(int64_t mode) {
  if (mode >= 0) g_attention_pairs = int(mode != 0);
  return g_attention_pairs == 1 && blocks_avx512(-1);
}

// attend_kv_head for two rows of one sequence with n0 and n1 keys (kb/vb cover the longer); D <= kMaxPairedHeadDim;
// s0, s1: a row's scores each. Row r's output is attend_kv_head's for it alone, bit for bit.
LAB_AVX512 __attribute__((flatten)) static void attend_kv_head_pair(
    const float* q0, const float* q1, int64_t G, int64_t D, const float* const* kb, const float* const* vb, int64_t bs,
    int64_t n0, int64_t n1, float sc, float* out0, float* out1, float* s0, float* s1, uint64_t hidden0,
    uint64_t hidden1) {
  const int64_t n = std::max(n0, n1), ld = attention_scores_ld(n);
  alignas(64) float pairs[3 * kMaxPairedHeadDim * 2];
  by_query_groups(G, [&](auto gc, int64_t g) {
    constexpr int GC = decltype(gc)::value;
    for (int h = 0; h < GC; ++h)
      for (int64_t d = 0; d < D; d += 8) {
        _mm256_store_ps(pairs + (h * D + d) * 2, _mm256_loadu_ps(q0 + (g + h) * D + d));
        _mm256_store_ps(pairs + (h * D + d) * 2 + 8, _mm256_loadu_ps(q1 + (g + h) * D + d));
      }
    float inv0[GC], inv1[GC];
    const TwoRows rows{pairs, D, {s0, s1}, ld, {out0 + g * D, out1 + g * D}, {inv0, inv1}};
    score_keys<TwoRows, GC>(rows, D, kb, vb, bs, n, sc);
    row_numerators<GC>(s0, ld, n0, n, hidden0, inv0);
    row_numerators<GC>(s1, ld, n1, n, hidden1, inv1);
    accumulate_values<TwoRows, GC>(rows, D, vb, bs, n);
  });
}

// NOTE: little work (a decode over a short context) stays on one thread: waking another costs more than the
// few microseconds saved.
static inline int64_t attention_grain(int64_t items, int64_t keys_per_item, int64_t G, int64_t D) {
  return items * keys_per_item * G * D >= (int64_t(1) << 18) ? 1 : std::max<int64_t>(items, 1);
}

// One decode token of one sequence on a contiguous KV cache: write k, v at `pos`, attend q over keys [0, pos].
// q (..., Hq, D), k/v (..., Hkv, D) of this token; k_cache/v_cache (Hkv, L, D) contiguous -> out shaped as q.
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                            int64_t pos, double scale) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes(), "decode_attention: caches must be contiguous (Hkv, L, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "decode_attention: fp32 only");
  const int64_t H = k_cache.size(0), L = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(D % 8 == 0, "decode_attention: head_dim must be a multiple of 8");
  TORCH_CHECK(pos >= 0 && pos < L, "decode_attention: position ", pos, " outside the cache");
  at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  TORCH_CHECK(kc.numel() == H * D && vc.numel() == H * D && qc.numel() % (H * D) == 0, "decode_attention: shapes");
  const int64_t G = qc.numel() / (H * D), n = pos + 1;
  at::Tensor out = at::empty(q.sizes(), q.options());
  float* kcp = k_cache.data_ptr<float>(); float* vcp = v_cache.data_ptr<float>();
  const float* qp = qc.data_ptr<float>(); float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    std::memcpy(kcp + (h * L + pos) * D, kc.data_ptr<float>() + h * D, D * sizeof(float));
    std::memcpy(vcp + (h * L + pos) * D, vc.data_ptr<float>() + h * D, D * sizeof(float));
  }
  const float sc = float(scale);
  at::parallel_for(0, H, attention_grain(H, n, G, D), [&](int64_t h0, int64_t h1) {
    std::vector<float> scores(attention_scores_size(G, n));
    for (int64_t h = h0; h < h1; ++h) {
      const float* kh = kcp + h * L * D; const float* vh = vcp + h * L * D;
      attend_kv_head(qp + h * G * D, G, D, &kh, &vh, L, n, sc, op + h * G * D, scores.data());
    }
  });
  return out;
}

// Many queries over paged KV: row b attends its lens[b] first keys through its block table (a decode, or one
// token of a verify step). q (B, Hkv, G, D); k/v stores (Hkv, num_blocks, block_size, D); tables
// (B, max_blocks) int64; lens (B,) int64; hidden (B,) int64 or empty: row b does not see key lens[b] - 1 - j
// where bit j of hidden[b] is set (a tree of drafts' siblings) -> out (B, Hkv, G, D). fp32, contiguous; q's rows
// may be apart (any stride along B: the query heads of a fused QKV row, not copied out).
void paged_decode(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor tables, at::Tensor lens, at::Tensor hidden,
                  double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.stride(3) == 1 && q.stride(2) == q.size(3) &&
              q.stride(1) == q.size(2) * q.size(3) && k.is_contiguous() && v.is_contiguous() &&
              out.is_contiguous() && tables.is_contiguous() && lens.is_contiguous() && k.sizes() == v.sizes() &&
              out.sizes() == q.sizes(), "paged_decode: q (B, Hkv, G, D) contiguous within a row, contiguous out, "
              "stores (Hkv, NB, bs, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && tables.scalar_type() == at::kLong &&
              lens.scalar_type() == at::kLong, "paged_decode: fp32 tensors, int64 tables and lens");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t NB = k.size(1), bs = k.size(2), max_nb = tables.size(1);
  TORCH_CHECK(D % 8 == 0 && k.size(0) == H && k.size(3) == D, "paged_decode: head_dim must be a multiple of 8");
  const float* qp = q.data_ptr<float>(); const float* kp = k.data_ptr<float>(); const float* vp = v.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>(); const int64_t* lp = lens.data_ptr<int64_t>();
  TORCH_CHECK(hidden.numel() == 0 || (hidden.numel() == B && hidden.is_contiguous() &&
              hidden.scalar_type() == at::kLong), "paged_decode: hidden must be empty or (B,) int64");
  const int64_t* hp = hidden.numel() ? hidden.data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_nb * bs, "paged_decode: row ", b, " has ", lp[b], " keys for ", max_nb,
                " blocks of ", bs);
    TORCH_CHECK(!hp || (hp[b] >= 0 && !(hp[b] & 1) && (lp[b] >= 63 || (hp[b] >> lp[b]) == 0)),
                "paged_decode: row ", b, " hides its own key or keys it does not have");
    max_len = std::max(max_len, lp[b]);
  }
  const float sc = float(scale);
  const int64_t q_row = q.stride(0);
  // NOTE: units of one row, or of two consecutive rows of one sequence (the same blocks) where pairs are on
  std::vector<int64_t> firsts;
  const bool pairs = D <= kMaxPairedHeadDim && attention_pairs(-1);
  for (int64_t b = 0; b < B; ++b) {
    firsts.push_back(b);
    if (pairs && b + 1 < B) {
      const int64_t blocks = (std::max(lp[b], lp[b + 1]) + bs - 1) / bs;
      if (std::equal(tp + b * max_nb, tp + b * max_nb + blocks, tp + (b + 1) * max_nb)) ++b;
    }
  }
  const int64_t units = int64_t(firsts.size());
  firsts.push_back(B);
  at::parallel_for(0, units * H, attention_grain(B * H, max_len, G, D), [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(2 * attention_scores_size(G, max_len));
    std::vector<const float*> kb(max_nb), vb(max_nb);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = firsts[i / H], h = i % H;
      const bool paired = firsts[i / H + 1] - b == 2;
      const int64_t longest = paired ? std::max(lp[b], lp[b + 1]) : lp[b];
      for (int64_t j = 0; j * bs < longest; ++j) {
        const int64_t block = tp[b * max_nb + j];
        kb[j] = kp + (h * NB + block) * bs * D;
        vb[j] = vp + (h * NB + block) * bs * D;
      }
      const float* qb = qp + b * q_row + h * G * D;
      float* ob = op + (b * H + h) * G * D;
      if (paired)
        attend_kv_head_pair(qb, qb + q_row, G, D, kb.data(), vb.data(), bs, lp[b], lp[b + 1], sc, ob, ob + H * G * D,
                            scores.data(), scores.data() + scores.size() / 2, hp ? uint64_t(hp[b]) : 0,
                            hp ? uint64_t(hp[b + 1]) : 0);
      else
        attend_kv_head(qb, G, D, kb.data(), vb.data(), bs, lp[b], sc, ob, scores.data(), hp ? uint64_t(hp[b]) : 0);
    }
  });
}

// The decoder layers of one batch-1 decode token in one call: the same kernels, in the same order, as
// DecoderModel's per-module path (bit-identical), without ~25 Python-level ops per layer between them.
// x (1, 1, H): the embedded token. layers[i] = {input_norm (H), qkv_w, qkv_b (numel 0: none), o_w, post_norm (H),
// gate_up_w, down_w}; k_rows[i], v_rows[i] (Hkv, L, D) contiguous caches; cos, sin (1, 1, 1, D) of the token's
// position `pos`. Returns the residual stream after the last layer, (1, 1, H), before the final norm.
at::Tensor decode_layers(at::Tensor x, std::vector<std::vector<at::Tensor>> layers, std::vector<at::Tensor> k_rows,
                         std::vector<at::Tensor> v_rows, at::Tensor cos, at::Tensor sin, int64_t pos,
                         int64_t num_heads, int64_t num_kv_heads, double eps, double scale, int64_t max_threads) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(1) == 1, "decode_layers: x must be (1, 1, H)");
  TORCH_CHECK(k_rows.size() == layers.size() && v_rows.size() == layers.size(), "decode_layers: one cache per layer");
  const int64_t D = k_rows.empty() ? 0 : k_rows[0].size(2), qk_size = (num_heads + num_kv_heads) * D;
  at::Tensor h = x;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<at::Tensor>& p = layers[i];
    TORCH_CHECK(p.size() == 7, "decode_layers: 7 tensors per layer");
    const c10::optional<at::Tensor> qkv_bias = p[2].numel() ? c10::optional<at::Tensor>(p[2]) : c10::nullopt;
    at::Tensor qkv = gemv(rms_norm(h, p[0], eps), p[1], qkv_bias, max_threads);                   // (1, 1, Nqkv)
    at::Tensor qk = rope(qkv.narrow(-1, 0, qk_size).view({1, 1, num_heads + num_kv_heads, D}), cos, sin);
    at::Tensor v = qkv.narrow(-1, qk_size, num_kv_heads * D).view({1, 1, num_kv_heads, D});
    at::Tensor attn = decode_attention(qk.narrow(2, 0, num_heads), qk.narrow(2, num_heads, num_kv_heads), v,
                                       k_rows[i], v_rows[i], pos, scale);                          // (1, 1, Hq, D)
    at::Tensor o = gemv(attn.reshape({1, 1, num_heads * D}), p[3], c10::nullopt, max_threads);
    std::vector<at::Tensor> sum_normed = add_rms_norm(h, o, p[4], eps);
    at::Tensor gate_up = gemv(sum_normed[1], p[5], c10::nullopt, max_threads);
    h = at::add(sum_normed[0], gemv(silu_mul(gate_up), p[6], c10::nullopt, max_threads));
  }
  return h;
}

// Each token's K (or V) rows, rows (N, Hkv, D) with contiguous heads, into slot slots[n] of every KV head of
// store (Hkv, NB, bs, D), contiguous: what index_copy_ along the flat slots did, without its ~2.5 us a call (60 a
// SmolLM2 step).
static void write_kv_rows(at::Tensor& store, const at::Tensor& rows, const int64_t* slots) {
  const int64_t N = rows.size(0), H = rows.size(1), D = rows.size(2), S = store.numel() / (H * D);
  TORCH_CHECK(store.is_contiguous() && rows.stride(2) == 1 && rows.stride(1) == D &&
              rows.scalar_type() == at::kFloat && store.scalar_type() == at::kFloat,
              "write_kv_rows: fp32 rows (N, Hkv, D) with contiguous heads");
  float* sp = store.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(sp + (h * S + slots[n]) * D, rp + n * rows.stride(0) + h * D, D * sizeof(float));
}

// Every store (Hkv, NB, bs, D) of `stores`, contiguous: the rows at flat slots src[i] copied to dst[i] in each KV
// head (a tree's accepted path moved to a chain's positions); all sources are read before any destination is written,
// as index_select then index_copy_ did, without their ~2.5 us a call (120 for SmolLM2's 30 layers).
void copy_slots(std::vector<at::Tensor> stores, at::Tensor src, at::Tensor dst) {
  TORCH_CHECK(src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong && src.is_contiguous() &&
              dst.is_contiguous() && src.numel() == dst.numel(), "copy_slots: src and dst must be int64 (N,) alike");
  const int64_t N = src.numel();
  const int64_t* sp = src.data_ptr<int64_t>(); const int64_t* dp = dst.data_ptr<int64_t>();
  std::vector<float> rows;
  for (at::Tensor& store : stores) {
    TORCH_CHECK(store.dim() == 4 && store.is_contiguous() && store.scalar_type() == at::kFloat,
                "copy_slots: stores must be contiguous fp32 (Hkv, NB, bs, D)");
    const int64_t H = store.size(0), D = store.size(3), S = store.size(1) * store.size(2);
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < S && dp[i] >= 0 && dp[i] < S, "copy_slots: slot outside the store");
    float* base = store.data_ptr<float>();
    rows.resize(size_t(N * H * D));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < N; ++i)
        std::memcpy(rows.data() + (h * N + i) * D, base + (h * S + sp[i]) * D, D * sizeof(float));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < N; ++i)
        std::memcpy(base + (h * S + dp[i]) * D, rows.data() + (h * N + i) * D, D * sizeof(float));
  }
}

// The decoder layers of one step on the paged (block) KV cache whose every request feeds a few tokens (decodes,
// verify steps: NativeAttention's kernel rows), in one call: the per-module path's kernels in its order
// (bit-identical, as decode_layers), for N <= NATIVE_MAX_ROWS tokens in all, so every projection is the few-row
// GEMV there too. x (1, N, H) embedded; layers as decode_layers; k_stores[i], v_stores[i] (Hkv, NB, bs, D); cos,
// sin (1, N, 1, D); slots (N,) each token's flat storage index; tables (N, max_blocks), lens (N,), hidden (N,) or
// empty, int64: each token's block table, its key count and the keys it does not see (paged_decode's rows).
// Returns {the residual stream after the last layer (1, N, H), then the stream after each layer of `capture`, in
// order}.
std::vector<at::Tensor> paged_step_layers(at::Tensor x, std::vector<std::vector<at::Tensor>> layers,
                                          std::vector<at::Tensor> k_stores, std::vector<at::Tensor> v_stores,
                                          at::Tensor cos, at::Tensor sin, at::Tensor slots, at::Tensor tables,
                                          at::Tensor lens, at::Tensor hidden, int64_t num_heads,
                                          int64_t num_kv_heads, double eps,
                                          double scale, int64_t max_threads, std::vector<int64_t> capture) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "paged_step_layers: x must be (1, N, H)");
  TORCH_CHECK(k_stores.size() == layers.size() && v_stores.size() == layers.size(),
              "paged_step_layers: one store per layer");
  const int64_t N = x.size(1), D = k_stores.empty() ? 0 : k_stores[0].size(3), G = num_heads / num_kv_heads;
  const int64_t q_size = num_heads * D, qk_size = (num_heads + num_kv_heads) * D;
  TORCH_CHECK(slots.numel() == N && lens.numel() == N && tables.size(0) == N, "paged_step_layers: one row per token");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "paged_step_layers: slots must be int64");
  const int64_t* slot_ids = slots.data_ptr<int64_t>();
  const int64_t store_slots = k_stores.empty() ? 0 : k_stores[0].numel() / (num_kv_heads * D);
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(slot_ids[n] >= 0 && slot_ids[n] < store_slots, "paged_step_layers: slot ", slot_ids[n],
                " outside the store");
  std::vector<at::Tensor> out{at::Tensor()};
  size_t next_capture = 0;
  at::Tensor h = x;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<at::Tensor>& p = layers[i];
    TORCH_CHECK(p.size() == 7, "paged_step_layers: 7 tensors per layer");
    const c10::optional<at::Tensor> qkv_bias = p[2].numel() ? c10::optional<at::Tensor>(p[2]) : c10::nullopt;
    at::Tensor qkv = gemv(rms_norm(h, p[0], eps), p[1], qkv_bias, max_threads);                   // (1, N, Nqkv)
    at::Tensor qk = rope(qkv.narrow(-1, 0, qk_size).view({1, N, num_heads + num_kv_heads, D}), cos, sin);
    at::Tensor k = qk[0].narrow(1, num_heads, num_kv_heads);                                     // (N, Hkv, D)
    at::Tensor v = qkv.narrow(-1, qk_size, num_kv_heads * D).view({1, N, num_kv_heads, D})[0];   // (N, Hkv, D)
    write_kv_rows(k_stores[i], k, slot_ids);
    write_kv_rows(v_stores[i], v, slot_ids);
    at::Tensor queries = qk[0].narrow(1, 0, num_heads).view({N, num_kv_heads, G, D});          // rows apart
    at::Tensor attn = at::empty({N, num_kv_heads, G, D}, x.options());
    paged_decode(queries, k_stores[i], v_stores[i], tables, lens, hidden, scale, attn);
    at::Tensor o = gemv(attn.view({1, N, q_size}), p[3], c10::nullopt, max_threads);
    std::vector<at::Tensor> sum_normed = add_rms_norm(h, o, p[4], eps);
    at::Tensor gate_up = gemv(sum_normed[1], p[5], c10::nullopt, max_threads);
    h = at::add(sum_normed[0], gemv(silu_mul(gate_up), p[6], c10::nullopt, max_threads));
    if (next_capture < capture.size() && capture[next_capture] == int64_t(i)) {
      out.push_back(h);
      ++next_capture;
    }
  }
  TORCH_CHECK(next_capture == capture.size(), "paged_step_layers: capture must list existing layers (< ", layers.size(), ") in increasing order");
  out[0] = h;
  return out;
}

%(GEMM_SOURCE)s

%(HEAD_SOURCE)s

// NOTE: the GIL is released inside every kernel, as torch's own ops do, so the `concurrent` engine's
// thread-mode workers are not serialised on it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("gemv", &gemv, release());
  m.def("blocks_avx512", &blocks_avx512, release());
  m.def("attention_pairs", &attention_pairs, release());
  m.def("tiles_permitted", &tiles_permitted, release());
  m.def("gemv_f16", &gemv_f16, release());
  m.def("rms_norm", &rms_norm, release());
  m.def("add_rms_norm", &add_rms_norm, release());
  m.def("rope", &rope, release());
  m.def("silu_mul", &silu_mul, release());
  m.def("argmax_rows", &argmax_rows, release());
  m.def("decode_attention", &decode_attention, release());
  m.def("paged_decode", &paged_decode, release());
  m.def("decode_layers", &decode_layers, release());
  m.def("paged_step_layers", &paged_step_layers, release());
  m.def("copy_slots", &copy_slots, release());
  m.def("pack_panels", &pack_panels, release());
  m.def("gemm_panels", &gemm_panels, release());
  m.def("head_screen_supported", &head_screen_supported, release());
  m.def("head_argmax", &head_argmax, release());
  m.def("screen_products", &screen_products, release());
}
"""

AVAILABLE: bool = False            # True once load_kernel() has built (or loaded) the extension
# NOTE: threads per GEMV; 0 (the default): torch's intra-op thread count, so `threads=1` runs keep it on the
# calling thread. With OMP_WAIT_POLICY=PASSIVE a second thread measured no faster (waking it is a visible
# share of a 50-150 us call); with OpenMP's default spin-wait it reads the weights ~1.3x faster at one row
# (ar 45.8 vs 32.2 tok/s at 2 threads) and ~1.6x at five rows, where one core is compute-bound
# (docs/benchmarks.md). LAB_GEMV_THREADS=N caps it at N.
THREADS = int(os.environ.get("LAB_GEMV_THREADS", "0"))
_KERNEL: Any = None                # the extension while enabled
_BUILT: Any = None                 # the extension once built (kept while disabled)
_KERNEL_ERROR: str | None = None


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of `flags` (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            listed = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return listed.issuperset(flags)


def load_kernel() -> Any | None:
    """The compiled extension (built once per machine and cached), or None where it cannot run here (the
    reason is warned once). Sets AVAILABLE. LAB_NATIVE_GEMV=0 turns it off (A/B runs, tests)."""
    global _KERNEL, _KERNEL_ERROR, _BUILT, AVAILABLE
    if _KERNEL is None and _KERNEL_ERROR is None:
        if os.environ.get("LAB_NATIVE_GEMV", "1") == "0":
            _KERNEL_ERROR = "turned off by LAB_NATIVE_GEMV=0"
        elif not cpu_has("avx2", "fma", "f16c"):
            _KERNEL_ERROR = "this CPU lacks AVX2/FMA/F16C"
        elif _BUILT is not None:
            _KERNEL = _BUILT
        else:
            try:
                from torch.utils.cpp_extension import load_inline

                from lab.models.native_gemm import GEMM_SOURCE  # NOTE: here, not at the top: they import us
                from lab.models.native_head import HEAD_SOURCE
                from lab.models.native_tiles import TILES_SOURCE

                source = (KERNEL_SOURCE.replace("%(GEMM_SOURCE)s", GEMM_SOURCE)
                          .replace("%(TILES_SOURCE)s", TILES_SOURCE).replace("%(HEAD_SOURCE)s", HEAD_SOURCE))
                _KERNEL = _BUILT = load_inline(
                    "lab_native_gemv", cpp_sources=source,
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], verbose=False)
            except Exception as exc:  # noqa: BLE001 - no compiler, no headers: fall back, say why once
                _KERNEL_ERROR = f"{type(exc).__name__}: {str(exc)[:300]}"
                warnings.warn(f"native decode kernels unavailable, using torch ops: {_KERNEL_ERROR}", stacklevel=2)
        if _KERNEL is not None and os.environ.get("LAB_BLOCKS_AVX512", "1") == "0":
            _KERNEL.blocks_avx512(0)
    AVAILABLE = _KERNEL is not None
    return _KERNEL


def set_enabled(enabled: bool) -> None:
    """Turn the kernels off for this process, or back on (building them if needed); for tests and A/B
    benchmarks. Callers check AVAILABLE on every call, so this takes effect at once."""
    global _KERNEL, _KERNEL_ERROR, AVAILABLE
    _KERNEL, AVAILABLE = None, False
    _KERNEL_ERROR = None if enabled else "turned off by set_enabled(False)"
    if enabled:
        load_kernel()


def blocks_avx512(enabled: bool | None = None) -> bool:
    """Whether GGUF-block GEMVs run two weight rows to a 16-wide register (where this CPU has AVX-512F/VL): half
    the AVX2 path's instructions, up to 9 input rows in registers, outputs bit-identical to the AVX2 path's;
    `enabled` switches it for this process (tests, A/B runs), None only asks. LAB_BLOCKS_AVX512=0 starts a
    process with it off."""
    kernel = load_kernel()
    if kernel is None:
        return False
    return bool(kernel.blocks_avx512(-1 if enabled is None else int(enabled)))


def blocks_isa_fixed() -> bool:
    """Whether LAB_BLOCKS_AVX512 (0 or 1) fixed the block GEMV's instruction set for this process, so that nothing
    measures it (lab/models/block_rows.py: measure_block_isa)."""
    return os.environ.get("LAB_BLOCKS_AVX512") in ("0", "1")


def usable(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether the kernels can take this call: built, fp32 on CPU, and nothing to backpropagate through."""
    return (AVAILABLE and x.dtype == torch.float32 and x.is_cpu
            and not (torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad
                                                                         for p in params))))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) holding 1-64 rows, weight (out, in) with unit stride along `in` -> (..., out); each row's
    result is bit-identical whatever the other rows. `weight` may instead be GGUF blocks (uint8 Q4_1, int8 Q8_0:
    lab/models/weight_blocks.py), read as the fp32 values they expand to, bit for bit, or those blocks in AMX tile
    order (3-D: lab/models/native_tiles.py), within fp32 rounding of them. Needs the kernel."""
    return _KERNEL.gemv(x, weight, bias, THREADS)


def gemv_f16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """gemv over an fp16 weight (out, in), unit stride along `in`: x (..., in) fp32, 1-64 rows -> (..., out) fp32,
    accumulated in fp32. Half the bytes of `gemv`; for drafters only (their outputs need not be exact)."""
    return _KERNEL.gemv_f16(x, weight, bias, THREADS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., H) -> RMSNorm(x) * weight, as F.rms_norm in fp32 (one fused pass per row)."""
    return _KERNEL.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + a, RMSNorm(x + a) * weight): a residual add and the next norm in one call."""
    total, normed = _KERNEL.add_rms_norm(x, a, weight, eps)
    return total, normed


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """lab.models.rope.apply_rope in one pass: x (B, T, H, D), cos/signed_sin (B, T, 1, D) -> (B, T, H, D)."""
    return _KERNEL.rope(x, cos, signed_sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (..., 2I) = [gate | up] -> silu(gate) * up (..., I)."""
    return _KERNEL.silu_mul(gate_up)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., V) fp32 -> int64 (...): torch.argmax(x, -1), the first index of each row's largest value (NaN counting
    as largest), in two vectorised passes a row."""
    return _KERNEL.argmax_rows(x)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, position: int, scale: float) -> torch.Tensor:
    """One token of one sequence: store k, v (..., Hkv, D) at `position` of k_cache/v_cache (Hkv, L, D),
    then softmax-attend q (..., Hq, D) over keys [0, position] (GQA) -> shaped as q."""
    return _KERNEL.decode_attention(q, k, v, k_cache, v_cache, position, scale)


def decode_layers(x: torch.Tensor, layers: list[list[torch.Tensor]], k_rows: list[torch.Tensor],
                  v_rows: list[torch.Tensor], cos: torch.Tensor, signed_sin: torch.Tensor, position: int,
                  num_heads: int, num_kv_heads: int, eps: float, scale: float) -> torch.Tensor:
    """Every decoder layer for one batch-1 decode token in one call: x (1, 1, H) -> (1, 1, H). `layers`: per layer
    [input_norm, qkv_w, qkv_b (empty: none), o_w, post_norm, gate_up_w, down_w]; k_rows/v_rows (Hkv, L, D)."""
    return _KERNEL.decode_layers(x, layers, k_rows, v_rows, cos, signed_sin, position, num_heads, num_kv_heads,
                                 eps, scale, THREADS)


def paged_step_layers(x: torch.Tensor, layers: list[list[torch.Tensor]], k_stores: list[torch.Tensor],
                      v_stores: list[torch.Tensor], cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
                      tables: torch.Tensor, lens: torch.Tensor, hidden: torch.Tensor, num_heads: int,
                      num_kv_heads: int, eps: float, scale: float, capture: list[int]) -> list[torch.Tensor]:
    """Every decoder layer of a step of N <= NATIVE_MAX_ROWS tokens on the paged cache, each token a kernel row of
    paged_decode, in one call: x (1, N, H) -> [stream after the last layer (1, N, H), then after each layer of
    `capture` (increasing)]. k_stores/v_stores (Hkv, NB, bs, D) per layer; slots (N,), tables (N, nb), lens (N,);
    hidden (N,) the keys each row does not see (a tree of drafts), or empty."""
    return _KERNEL.paged_step_layers(x, layers, k_stores, v_stores, cos, signed_sin, slots, tables, lens, hidden,
                                     num_heads, num_kv_heads, eps, scale, THREADS, capture)


def copy_slots(stores: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Each store (Hkv, NB, bs, D), contiguous fp32: the rows at flat slots src (N,) int64 copied to dst (N,) in every
    KV head, all read before any is written (BlockKVCache.move_tokens in one call). Needs the kernel."""
    _KERNEL.copy_slots(stores, src, dst)
