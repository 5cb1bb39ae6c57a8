"""GGUF blocks through AMX tiles: a verify step's rows for the price of one (CPUs with AMX-BF16).

On the GGUF blocks (lab/models/weight_blocks.py) a batch-1 step is compute-bound: the AVX kernel widens each block
once and then pays a full fp32 pass of FMAs per input row, so a verify step of k + 1 tokens costs ~1 + 0.3 k plain
steps (docs/speculative.md, session 31) and speculation barely pays. Intel's AMX tile unit multiplies an M x 32
bf16 tile by a 32 x 16 one (up to 8192 multiply-adds) in ~2.7 ns for M <= 8 and ~4.4 ns for M = 16 (measured here),
~16x the FMA units. Here every block is widened once into a bf16 tile (its q are small integers: exact in bf16),
and the arithmetic of up to 16 rows is three tile products per block (one per piece of x):

    y[r, n] = sum_b  d[n, b] * sum_k x[r, 32b + k] q[n, 32b + k]  +  m[n, b] * sum_k x[r, 32b + k]

- x is split into three bf16 pieces x = x1 + x2 + x3 (each the rounding residue of the last), which hold its 24
  bits: every product x_i q is exact, and the tile unit sums them in fp32. The result is the fp32 dot product in
  another summation order (and d q + m applied per block rather than rounded per weight): within fp32 rounding of
  the fp32 weights' GEMV, ~5e-8 of sum |terms|, not bit-identical to it. A row's result does not depend on the
  other rows of its call, so a verify step's logits are exactly those of the decodes it replaces.
- Weights are repacked once, per 16 output rows and per block of 32 inputs, into the order a tile reads
  (`pack`): Q4_1 d[16], m[16] (fp16, as the GGUF stores them), then 256 bytes whose 32-byte chunk c holds, at
  byte 2n + e, q[n][4c + e] in its low nibble and q[n][4c + 2 + e] in its high one (B rows 2c and 2c + 1 in AMX's
  pair-interleaved layout); Q8_0 d[16] (fp16), then 512 bytes, byte 32kk + 2n + e = q[n][2kk + e]. 0.625 / 1.0625
  bytes a weight (the AVX blocks hold d and m in fp32: 0.75 / 1.125), as a 3-D tensor (out / 16, in / 32,
  bytes), which is how `gemv` tells them from the blocks.

Measured on SmolLM2's 120 projections (experiments/bench_gemv.py --tiles, 1 thread, docs/benchmarks.md): 1-4 rows
cost ~1 one-row call, 8 rows 1.4, 16 rows 2.0, 64 rows 6.4, against 1.3-1.6, 2.8, 4.4 and 14.8 on the AVX blocks;
one row 6.2 ms against 8.6. The Q8_0 head's one row is slower (2.0 against 1.5 ms: 8-bit q widen in 5 ops, 4-bit
ones in 2). Up to 16 rows the sums stay in registers (session 39: projections 4-18 % and the head 23-39 % faster
than a read-modify-write of memory per row and block, the same bits). Where the rest goes (session 39's
attribution, docs/benchmarks.md): no one part dominates; widening, the tile products, the store and the scaling each
take 15-30 % at 16 rows, and the tile unit runs one instruction at a time (~6.5 cycles a product up to 8 rows, 11 at
16; a store ~11 at any rows): more tiles in flight do not overlap, and widening a few blocks ahead did not help.

Linux hands a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM); `available` asks once.

Owns: the tile layout, its kernel and whether it can run. Ignores: which module streams what (PackedLinear,
ModelRunner's `model.block_kernel`).
"""

from __future__ import annotations

import torch

from lab.models import native_gemv, weight_blocks

TILE_ROWS = 16                  # output rows per tile (a B tile's 16 columns)
TILE_BYTES = {"q4_1": 320, "q8_0": 544}
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16")

TILES_SOURCE = r"""
// ---- GGUF blocks in AMX tile order (lab/models/native_tiles.py) ----
#include <sys/syscall.h>
#include <unistd.h>
// NOTE: AMX intrinsics need GCC 11+ or clang; an older compiler still builds the rest of the kernels (tiles off).
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11)
#define LAB_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

struct TileConfig { uint8_t palette, start_row; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static int g_tiles_permitted = -1;

// Asks Linux once for this process's AMX tile state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); whether granted.
bool tiles_permitted() {
  if (g_tiles_permitted < 0) g_tiles_permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return g_tiles_permitted == 1;
}

// 16 bf16 -> 16 fp32 (exact: a bf16 is an fp32's top half)
LAB_AMX static inline __m512 bf16_to_fp32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x (M, in) fp32 -> xs (nb, 3, Mp, 32) bf16: x = x1 + x2 + x3, each the bf16 rounding of what the last left
// (rows M .. Mp zero); sums (M, nb): each row's sum over each block of 32.
LAB_AMX static void split_bf16(const float* x, int64_t M, int64_t Mp, int64_t in, uint16_t* xs, float* sums) {
  const int64_t nb = in / 32;
  std::memset(xs, 0, size_t(nb) * 3 * Mp * 64);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * in + b * 32;
      __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      sums[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
      for (int p = 0; p < 3; ++p) {
        const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);           // lo's 16 values, then hi's
        _mm512_storeu_si512(xs + ((b * 3 + p) * Mp + r) * 32, h);
        lo = _mm512_sub_ps(lo, bf16_to_fp32(_mm512_castsi512_si256(h)));  // exact: the residue of the rounding
        hi = _mm512_sub_ps(hi, bf16_to_fp32(_mm512_extracti64x4_epi64(h, 1)));
      }
    }
}

struct Q4_1Tiles {
  static constexpr int64_t kBytes = 320, kQuants = 64;
  static constexpr bool kMin = true;
  // 256 bytes of nibbles -> the 16 B rows (16 outputs x 2 inputs, bf16) of one block
  LAB_AMX static inline void widen(const uint8_t* q, uint16_t* b) {
    const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);     // bf16 of 15 .. 0
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c)));
      _mm512_store_si512(b + 64 * c, _mm512_permutexvar_epi16(_mm512_and_si512(v, low4), table));
      _mm512_store_si512(b + 64 * c + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
    }
  }
};

struct Q8_0Tiles {
  static constexpr int64_t kBytes = 544, kQuants = 32;
  static constexpr bool kMin = false;
  LAB_AMX static inline void widen(const uint8_t* q, uint16_t* b) {
    for (int kk = 0; kk < 16; ++kk) {
      const __m128i* p = reinterpret_cast<const __m128i*>(q + 32 * kk);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
      _mm512_store_si512(b + 32 * kk, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));     // |q| <= 128: exact
    }
  }
};

// Output tiles [t0, t1) of y = x W^T for M rows (xs, sums from split_bf16), two at a time (kPair). Tiles 0-2: x's
// three pieces for one block and up to 16 rows; 3-4: the two output tiles' weights for that block; 5-6: their
// products, summed over the pieces by the tile unit, then stored and scaled by the block's d (and m) in AVX.
// NOTE: measured on SmolLM2's shapes, this beat the pieces stacked as the rows of one tile (5 rows x 3 pieces, summed
// with AVX: one product per block instead of three) at every row count past 1 (at 8 rows 10.3 against 12.5 ms,
// docs/benchmarks.md).
static constexpr int kPair = 2;

LAB_AMX static void configure_tiles(int64_t rows) {
  alignas(64) TileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = (t == 3 || t == 4) ? 16 : uint8_t(rows);
    config.colsb[t] = 64;
  }
  // NOTE: GCC does not see ldtilecfg read `config` and drops the stores above when this is a function of its own
  // (the tiles are then unconfigured: SIGILL); the empty asm makes them happen.
  asm volatile("" : : "m"(config) : "memory");
  _tile_loadconfig(&config);
}

// One block of `pair` output tiles (blocks[h]): their q widened into B tiles 3-4.
template <class T>
LAB_AMX static inline void load_weights(const uint8_t* const* blocks, int pair, uint16_t (*wide)[16 * 32]) {
  for (int h = 0; h < pair; ++h) T::widen(blocks[h] + T::kQuants, wide[h]);
  _tile_loadd(3, wide[0], 64);
  if (pair == 2) _tile_loadd(4, wide[1], 64);
}

// x's three pieces (xa, one piece every `piece` values) times tiles 3-4 -> products[h] (rows x 16, fp32).
LAB_AMX static inline void multiply_pieces(const uint16_t* xa, int64_t piece, int pair, float (*products)[16 * 16]) {
  _tile_loadd(0, xa, 64);
  _tile_loadd(1, xa + piece, 64);
  _tile_loadd(2, xa + 2 * piece, 64);
  _tile_zero(5);
  _tile_dpbf16ps(5, 0, 3);
  _tile_dpbf16ps(5, 1, 3);
  _tile_dpbf16ps(5, 2, 3);
  _tile_stored(5, products[0], 64);
  if (pair == 2) {
    _tile_zero(6);
    _tile_dpbf16ps(6, 0, 4);
    _tile_dpbf16ps(6, 1, 4);
    _tile_dpbf16ps(6, 2, 4);
    _tile_stored(6, products[1], 64);
  }
}

// A block's d (and m) for its 16 output rows, fp16 -> fp32.
template <class T>
LAB_AMX static inline void block_scales(const uint8_t* block, __m512& d, __m512& m) {
  const __m256i* dm = reinterpret_cast<const __m256i*>(block);
  d = _mm512_cvtph_ps(_mm256_loadu_si256(dm));
  m = T::kMin ? _mm512_cvtph_ps(_mm256_loadu_si256(dm + 1)) : _mm512_setzero_ps();
}

// M <= 16 rows: both output tiles' sums stay in registers (2 M zmm; past 8 rows the compiler spills some) instead of
// a read-modify-write of memory per row and block: SmolLM2's projections 4-18 % faster at 1-16 rows, the head 23-39 %
// (docs/benchmarks.md, session 39). Each row's arithmetic is tile_rows_in_memory's, in its order: the same bits.
template <class T, int M>
LAB_AMX static void tile_rows_in_registers(const uint8_t* w, int64_t nb, const uint16_t* xs, const float* sums,
                                           float* y, int64_t out, int64_t t0, int64_t t1) {
  configure_tiles(M);
  alignas(64) uint16_t wide[kPair][16 * 32];
  alignas(64) float products[kPair][16 * 16];
  for (int64_t t = t0; t < t1; t += kPair) {
    const int pair = int(std::min<int64_t>(kPair, t1 - t));
    __m512 acc[kPair][M];
    for (int h = 0; h < kPair; ++h)
      for (int r = 0; r < M; ++r) acc[h][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blocks[kPair] = {w + (t * nb + b) * T::kBytes, w + ((t + pair - 1) * nb + b) * T::kBytes};
      load_weights<T>(blocks, pair, wide);
      multiply_pieces(xs + b * 3 * M * 32, M * 32, pair, products);
      for (int h = 0; h < pair; ++h) {
        __m512 d, m;
        block_scales<T>(blocks[h], d, m);
        for (int r = 0; r < M; ++r) {
          acc[h][r] = _mm512_fmadd_ps(d, _mm512_load_ps(products[h] + 16 * r), acc[h][r]);
          if constexpr (T::kMin) acc[h][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[r * nb + b]), acc[h][r]);
        }
      }
    }
    for (int h = 0; h < pair; ++h)
      for (int r = 0; r < M; ++r) _mm512_storeu_ps(y + r * out + (t + h) * 16, acc[h][r]);
  }
  _tile_release();
}

// Any M <= 64 rows (Mp = M, or M rounded up to 16 past 16): the sums in memory, 16 rows of tiles at a time.
template <class T>
LAB_AMX static void tile_rows_in_memory(const uint8_t* w, int64_t nb, const uint16_t* xs, const float* sums,
                                        int64_t M, int64_t Mp, float* y, int64_t out, int64_t t0, int64_t t1) {
  configure_tiles(std::min<int64_t>(Mp, 16));
  alignas(64) uint16_t wide[kPair][16 * 32];
  alignas(64) float products[kPair][16 * 16];
  alignas(64) float acc[64 * kPair * 16];    // (row, tile of the pair, 16 outputs)
  for (int64_t t = t0; t < t1; t += kPair) {
    const int pair = int(std::min<int64_t>(kPair, t1 - t));
    std::memset(acc, 0, size_t(M) * kPair * 16 * sizeof(float));
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blocks[kPair] = {w + (t * nb + b) * T::kBytes, w + ((t + pair - 1) * nb + b) * T::kBytes};
      __m512 d[kPair], m[kPair];
      for (int h = 0; h < pair; ++h) block_scales<T>(blocks[h], d[h], m[h]);
      load_weights<T>(blocks, pair, wide);
      for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
        multiply_pieces(xs + (b * 3 * Mp + m0) * 32, Mp * 32, pair, products);
        const int64_t m1 = std::min<int64_t>(M, m0 + 16);
        for (int h = 0; h < pair; ++h)
          for (int64_t r = m0; r < m1; ++r) {
            float* row = acc + (r * kPair + h) * 16;
            __m512 a = _mm512_fmadd_ps(d[h], _mm512_load_ps(products[h] + 16 * (r - m0)), _mm512_load_ps(row));
            if constexpr (T::kMin) a = _mm512_fmadd_ps(m[h], _mm512_set1_ps(sums[r * nb + b]), a);
            _mm512_store_ps(row, a);
          }
      }
    }
    for (int64_t r = 0; r < M; ++r)
      for (int h = 0; h < pair; ++h)
        _mm512_storeu_ps(y + r * out + (t + h) * 16, _mm512_load_ps(acc + (r * kPair + h) * 16));
  }
  _tile_release();
}

template <class T>
LAB_AMX static void tile_rows(const uint8_t* w, int64_t nb, const uint16_t* xs, const float* sums, int64_t M,
                              int64_t Mp, float* y, int64_t out, int64_t t0, int64_t t1) {
  switch (M) {
#define LAB_TILE_ROWS(rows) case rows: return tile_rows_in_registers<T, rows>(w, nb, xs, sums, y, out, t0, t1);
    LAB_TILE_ROWS(1) LAB_TILE_ROWS(2) LAB_TILE_ROWS(3) LAB_TILE_ROWS(4) LAB_TILE_ROWS(5) LAB_TILE_ROWS(6)
    LAB_TILE_ROWS(7) LAB_TILE_ROWS(8) LAB_TILE_ROWS(9) LAB_TILE_ROWS(10) LAB_TILE_ROWS(11) LAB_TILE_ROWS(12)
    LAB_TILE_ROWS(13) LAB_TILE_ROWS(14) LAB_TILE_ROWS(15) LAB_TILE_ROWS(16)
#undef LAB_TILE_ROWS
    default: return tile_rows_in_memory<T>(w, nb, xs, sums, M, Mp, y, out, t0, t1);
  }
}

// x (..., in) with M <= 64 rows; w (out / 16, in / 32, 320) uint8 = Q4_1 tiles, (out / 16, in / 32, 544) int8 =
// Q8_0 tiles (native_tiles.pack); bias (out,) fp32 or None -> (..., out).
at::Tensor gemv_tiles(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias, int64_t max_threads) {
  TORCH_CHECK(tiles_permitted(), "gemv_tiles: this process has no AMX tile state (CPU without AMX, or Linux refused)");
  const bool q4 = w.scalar_type() == at::kByte;
  const int64_t bytes = q4 ? Q4_1Tiles::kBytes : Q8_0Tiles::kBytes;
  TORCH_CHECK((q4 || w.scalar_type() == at::kChar) && w.dim() == 3 && w.is_contiguous() && w.size(2) == bytes,
              "gemv_tiles: W must be contiguous (out / 16, in / 32, 320) uint8 or (out / 16, in / 32, 544) int8 tiles");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gemv_tiles: x must be fp32");
  const int64_t tiles = w.size(0), nb = w.size(1), out = tiles * 16, in = nb * 32;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in && x.numel() >= in, "gemv_tiles: x must have rows of ", in, " values");
  const int64_t M = x.numel() / in;
  TORCH_CHECK(M <= 64, "gemv_tiles: at most 64 rows (", M, " given); larger batches belong to a GEMM");
  const int64_t Mp = M <= 16 ? M : (M + 15) / 16 * 16;
  at::Tensor xc = x.contiguous();
  std::vector<uint16_t> xs(size_t(nb) * 3 * Mp * 32);
  std::vector<float> sums(size_t(M) * nb);
  split_bf16(xc.data_ptr<float>(), M, Mp, in, xs.data(), sums.data());
  at::Tensor y = gemv_output(x, out);
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  // NOTE: threads take whole pairs of output tiles (split_rows over pairs); a tile's result does not depend on its
  // pair or thread.
  split_rows((tiles + kPair - 1) / kPair, kPair * nb * bytes, max_threads, [&](int64_t g0, int64_t g1) {
    const int64_t t1 = std::min(tiles, kPair * g1);
    if (q4) tile_rows<Q4_1Tiles>(wp, nb, xs.data(), sums.data(), M, Mp, yp, out, kPair * g0, t1);
    else tile_rows<Q8_0Tiles>(wp, nb, xs.data(), sums.data(), M, Mp, yp, out, kPair * g0, t1);
  });
  if (bias.has_value() && bias->defined()) {
    at::Tensor bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == out, "gemv_tiles: bias must be fp32 (out,)");
    y.add_(bc);
  }
  return y;
}
#else
bool tiles_permitted() { return false; }
at::Tensor gemv_tiles(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias, int64_t max_threads) {
  TORCH_CHECK(false, "gemv_tiles: this build's compiler has no AMX intrinsics (GCC 11+ or clang)");
  return x;
}
#endif
"""


def available() -> bool:
    """Whether `gemv` can take tiles here: the native kernel built, a CPU with AMX-BF16, and Linux's grant of the
    tile state to this process."""
    if not native_gemv.cpu_has(*CPU_FLAGS):   # NOTE: AMX-BF16 and the AVX-512 parts the kernel uses
        return False
    kernel = native_gemv.load_kernel()
    return kernel is not None and bool(kernel.tiles_permitted())


def pack(blocks: torch.Tensor) -> torch.Tensor | None:
    """GGUF blocks (out, in / 32 * bytes) (weight_blocks' layout) -> the same values in tile order (out / 16,
    in / 32, tile bytes), or None where `out` is not a multiple of 16 or a d or m is not an fp16 value."""
    fmt = weight_blocks.block_format(blocks)
    out = blocks.shape[0]
    if out % TILE_ROWS:
        return None
    nb = blocks.shape[1] // weight_blocks.block_bytes(fmt)
    tiles = out // TILE_ROWS
    raw = blocks.view(torch.uint8).reshape(out, nb, weight_blocks.block_bytes(fmt))
    scales32 = raw[..., :8 if fmt == "q4_1" else 4].contiguous().view(torch.float32)   # (out, nb, 2 | 1): d(, m)
    scales = scales32.to(torch.float16)
    if not torch.equal(scales.to(torch.float32), scales32):
        return None
    if fmt == "q4_1":
        nibbles = raw[..., 8:].to(torch.int16)                                      # (out, nb, 16)
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)                       # (out, nb, 32)
        # q[n][4c + 2h + e] -> chunk c, byte 2n + e, nibble h
        q = q.view(tiles, TILE_ROWS, nb, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)         # (tiles, nb, c, n, e, h)
        quants = (q[..., 0] | (q[..., 1] << 4)).to(torch.uint8).reshape(tiles, nb, 256)
        d_m = scales.view(tiles, TILE_ROWS, nb, 2).permute(0, 2, 3, 1).contiguous()  # (tiles, nb, 2, 16)
        head = d_m.view(torch.uint8).reshape(tiles, nb, 64)
        return torch.cat([head, quants], dim=-1).contiguous()
    d = scales                                                                      # (out, nb, 1)
    q = raw[..., 4:].view(tiles, TILE_ROWS, nb, 16, 2).permute(0, 2, 3, 1, 4)        # (tiles, nb, kk, n, e)
    head = d.view(tiles, TILE_ROWS, nb).permute(0, 2, 1).contiguous().view(torch.uint8)   # (tiles, nb, 32)
    return torch.cat([head, q.reshape(tiles, nb, 512)], dim=-1).contiguous().view(torch.int8)


def unpack(tiles: torch.Tensor) -> torch.Tensor:
    """Tiles (`pack`'s layout) -> the fp32 weight (out, in) they hold (d * q + m rounded once, as the blocks'):
    the reference the layout is tested against, on any CPU."""
    q4 = tiles.dtype == torch.uint8
    count, nb, _ = tiles.shape
    raw = tiles.view(torch.uint8)
    if q4:
        scales = raw[..., :64].contiguous().view(torch.float16).to(torch.float32).view(count, nb, 2, TILE_ROWS)
        d, m = scales[:, :, 0], scales[:, :, 1]                                   # (tiles, nb, n)
        quants = raw[..., 64:].to(torch.int16).view(count, nb, 8, TILE_ROWS, 2)   # (tiles, nb, c, n, e)
        q = torch.stack([quants & 0x0F, quants >> 4], dim=-1)                      # (tiles, nb, c, n, e, h)
        q = q.permute(0, 3, 1, 2, 5, 4).reshape(count, TILE_ROWS, nb, 32)          # k = 4c + 2h + e
    else:
        d = raw[..., :32].contiguous().view(torch.float16).to(torch.float32)        # (tiles, nb, n)
        m = torch.zeros_like(d)
        quants = raw[..., 32:].contiguous().view(torch.int8).view(count, nb, 16, TILE_ROWS, 2)   # (tiles, nb, kk, n, e)
        q = quants.permute(0, 3, 1, 2, 4).reshape(count, TILE_ROWS, nb, 32)       # k = 2kk + e
    d = d.permute(0, 2, 1).unsqueeze(-1)                                            # (tiles, n, nb, 1)
    m = m.permute(0, 2, 1).unsqueeze(-1)
    return (d * q.to(torch.float32) + m).reshape(count * TILE_ROWS, nb * 32)


def is_tiles(weight: torch.Tensor) -> bool:
    """Whether a tensor `gemv` is handed holds tiles (3-D) rather than blocks or fp32 weights."""
    return weight.dim() == 3 and weight.dtype in (torch.uint8, torch.int8)
