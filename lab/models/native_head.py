"""The LM head's greedy screen: a few rows' argmax token ids over a Q8_0 head without computing their logits.

A greedy verify step needs only the argmax of each of its rows, but the head still computes all V logits a row:
SmolLM2's 49152 x 576 Q8_0 head is ~0.37 of a one-token step for every extra verify row on a CPU without AMX
(docs/speculative.md, "What a verify row costs without AMX"), while a row's argmax is almost always clear by a
margin far above what 8-bit inputs would blur. So for each input row x this
1. quantizes x to int8 per block of 32 columns (x ~ S_b X, |x - S_b X| <= S_b / 2 a column);
2. screens every vocabulary row j against it in integers: s_j = sum_b d_jb S_b (q_jb . X_b), with the head's own
   Q8_0 blocks (w = d q) as unsigned bytes q + 128 and AVX-512 VNNI (`vpdpbusd`: 64 byte products an
   instruction, four times the fp32 FMAs' rate), next to a bound E_j = sum_b |d_jb| |q_jb|_1 S_b / 2 on how far
   s_j can be from the exact logit, widened by 1/32 and by twice what the roundings of both sides can add: each is
   at most (in + nb + 8) u sum |w x| with sum |w x| <= 254 E (u = 2^-24; 0.9 % of E at SmolLM2's 576 columns);
3. keeps the candidates whose s_j + E_j reaches the largest s_k - E_k (on SmolLM2's answers one or two a row, at
   most a few dozen), and computes their exact logits with the block GEMV itself (lab/models/native_gemv.py), in the
   order its quads sum a row: the order of every row of the full head's call wherever the head's rows split over the
   threads in multiples of 4 (SmolLM2's 49152 at 1-4, 6, 8, 12 or 16 threads);
4. returns each row's first candidate with the largest exact logit.
No row outside the candidates can reach the largest exact logit (its exact value is below its s + E, which is below
the best candidate's s - E, which is at most that candidate's exact value), and ties keep the lowest token id, so
the ids equal `argmax_rows` of the head's logits (`gemv` over its blocks), bit for bit: greedy output does not
change. A call with a non-finite value (or one above 1e15) takes the full head.

The screen is a second copy of the head's integers, transposed so that one 64-byte load holds 4 columns of 16
vocabulary rows (G = V / 16 groups, each nb = in / 32 blocks of 8 such loads), and per group and block the 16 rows'
d and |d| |q|_1 as fp16 (the latter rounded up): 28 + 3.4 MB for SmolLM2. At one or two rows both heads take about
the time their bytes take to arrive (the screen ~1.2x faster: the full head also widens every weight to fp32); from
three rows on the full head is bound by its FMAs and the screen, a quarter of the arithmetic, is 2-2.5x faster up to
7 rows (docs/benchmarks.md, "The head's greedy screen").

The screen values themselves are a drafter's products (`Int8Weight`, engine.proposer.weights=int8): x W^T with x
rounded to int8 per 32 columns, within E of the exact products, 64 byte products an instruction against an fp32
FMA's 16. A drafter's outputs need not be exact (the target verifies every draft), and its few rows through the fp32
block GEMV were bound by their FMAs: a DFlash draft on SmolLM2 1.28 -> 0.93 ms (experiments/bench_drafter.py).

Owns: the screen's layout, its argmax and its products. Ignores: when a step may use them (only the head's argmax is
read: DecoderModel.greedy_tokens and the engines decide; PackedLinear takes the products for a drafter's linears).
The source is compiled into native_gemv's extension (one build), whose `load_kernel` gates it; `supported()` adds
the CPU's AVX-512 VNNI.
"""

from __future__ import annotations

import torch

from lab.models import native_gemv, weight_blocks

GROUP_ROWS = 16           # vocabulary rows a 64-byte screen load holds (4 columns each)
MAX_ROWS = 64             # input rows one kernel call takes
BOUND_SLACK = 1.0 / 32    # E is widened by this share, on top of twice the worst case of both sides' roundings

HEAD_SOURCE = r"""
// ---- The LM head's greedy screen (lab/models/native_head.py) ------------------------------------------------
#define LAB_VNNI __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512vnni,f16c")))
constexpr int64_t GROUP_ROWS = 16;

bool head_screen_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}

// One group of 16 vocabulary rows against N input rows: acc[r] = their screen values s and, with Bounds, err[r] =
// their bound E. w: the group's screen bytes (nb blocks x 8 loads x 64: load c of block b holds columns 32 b + 4 c
// .. + 3 of the 16 rows, 4 bytes a row, q + 128); sc: per block the 16 rows' d, then their |d| |q|_1 (fp16). The
// input rows come interleaved, as ScreenRows lays them out.
template <int N, bool Bounds>
LAB_VNNI static inline void group_sums(const uint8_t* w, const uint16_t* sc, int64_t nb, const int8_t* X,
                                       const float* xs, const float* xh, const int32_t* base, __m512* acc,
                                       __m512* err) {
  for (int r = 0; r < N; ++r) acc[r] = err[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += 512, sc += 32, X += 32 * N, xs += N, xh += N, base += N) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
    __m512i dot[N];
    for (int r = 0; r < N; ++r) dot[r] = _mm512_set1_epi32(base[r]);
    for (int c = 0; c < 8; ++c) {
      const __m512i wc = _mm512_loadu_si512(w + 64 * c);
      const int32_t* x4 = reinterpret_cast<const int32_t*>(X + 4 * N * c);
      for (int r = 0; r < N; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], wc, _mm512_set1_epi32(x4[r]));
    }
    for (int r = 0; r < N; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(xs[r])), acc[r]);
    if (Bounds) {
      const __m512 e = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16)));
      for (int r = 0; r < N; ++r) err[r] = _mm512_fmadd_ps(e, _mm512_set1_ps(xh[r]), err[r]);
    }
  }
}

// The screen of one group against N input rows: its values plus their bound into ub (N, V) and, per row, the
// group's largest s + E (gub) and s - E (glb).
template <int N>
LAB_VNNI static void screen_group(const uint8_t* w, const uint16_t* sc, int64_t nb, const int8_t* X, const float* xs,
                                  const float* xh, const int32_t* base, float* ub, int64_t V, float* gub, float* glb,
                                  int64_t G, int64_t g) {
  __m512 acc[N], err[N];
  group_sums<N, true>(w, sc, nb, X, xs, xh, base, acc, err);
  for (int r = 0; r < N; ++r) {
    const __m512 upper = _mm512_add_ps(acc[r], err[r]);
    _mm512_storeu_ps(ub + r * V + GROUP_ROWS * g, upper);
    gub[r * G + g] = _mm512_reduce_max_ps(upper);
    glb[r * G + g] = _mm512_reduce_max_ps(_mm512_sub_ps(acc[r], err[r]));
  }
}

// The screen values alone of one group against N input rows, plus the bias (or not), into y (N, V): int8 products
// for a drafter's linears (screen_products).
template <int N>
LAB_VNNI static void product_group(const uint8_t* w, const uint16_t* sc, int64_t nb, const int8_t* X, const float* xs,
                                   const int32_t* base, const float* bias, float* y, int64_t V, int64_t g) {
  __m512 acc[N], err[N];
  group_sums<N, false>(w, sc, nb, X, xs, xs, base, acc, err);
  const __m512 add = bias ? _mm512_loadu_ps(bias + GROUP_ROWS * g) : _mm512_setzero_ps();
  for (int r = 0; r < N; ++r) _mm512_storeu_ps(y + r * V + GROUP_ROWS * g, _mm512_add_ps(acc[r], add));
}

// Up to 8 input rows quantized for screen_group, interleaved so that its loads walk one stream each: X (nb, 8, N, 4)
// int8, the 4 columns load c of block b meets; xs, xh, base (nb, N): S_b, S_b / 2 widened (native_head.py), and
// -128 sum X_b (the unsigned weights' q + 128 adds 128 sum X_b to each product).
struct ScreenRows {
  int64_t n;
  std::vector<int8_t> X;
  std::vector<float> xs, xh;
  std::vector<int32_t> base;
};

// Rows [m0, m0 + n) of x (rows of 32 nb values) -> ScreenRows; false where a value is not finite, or so large that
// the screen's sums could overflow.
static bool quantize_rows(const float* x, int64_t m0, int64_t n, int64_t nb, double slack, ScreenRows& q) {
  // NOTE: E's widening: the slack, plus twice what the roundings of the screen and of the exact GEMV can add, each at
  // most (in + nb + 8) u sum |w x| <= (in + nb + 8) u 254 E (u = 2^-24)
  const float widen = float(1.0 + slack + 2.0 * double(33 * nb + 8) * 254.0 * std::ldexp(1.0, -24));
  q.n = n;
  q.X.assign(32 * nb * n, 0);
  q.xs.assign(nb * n, 0.0f);
  q.xh.assign(nb * n, 0.0f);
  q.base.assign(nb * n, 0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + (m0 + r) * 32 * nb + 32 * b;
      float amax = 0.0f;
      bool finite = true;
      for (int k = 0; k < 32; ++k) {
        finite = finite && std::isfinite(xb[k]);
        amax = std::max(amax, std::fabs(xb[k]));
      }
      if (!finite || amax > 1e15f) return false;    // NOTE: 1e15 x 127 x 65504 x in stays far below FLT_MAX
      const float S = amax / 127.0f;
      int32_t sum = 0;
      for (int k = 0; k < 32; ++k) {
        const int32_t v = S > 0.0f ? std::max(-127, std::min(127, int32_t(std::nearbyint(xb[k] / S)))) : 0;
        q.X[32 * n * b + 4 * n * (k / 4) + 4 * r + k % 4] = int8_t(v);
        sum += v;
      }
      q.xs[n * b + r] = S;
      q.xh[n * b + r] = 0.5f * S * widen;
      q.base[n * b + r] = -128 * sum;
    }
  return true;
}

// M input rows quantized in chunks of at most 8 (their sums stay in registers), as even as they come (12 rows as 6 +
// 6): chunk k holds rows first[k] ..; false where a value is not finite or too large (quantize_rows).
static bool screen_chunks(const float* x, int64_t M, int64_t nb, double slack, std::vector<ScreenRows>& chunks,
                          std::vector<int64_t>& first) {
  chunks.resize((M + 7) / 8);
  first.resize(chunks.size());
  for (int64_t k = 0, m = 0, K = int64_t(chunks.size()); k < K; ++k) {
    const int64_t n = (M - m) / (K - k);
    first[k] = m;
    if (!quantize_rows(x, m, n, nb, slack, chunks[k])) return false;
    m += n;
  }
  return true;
}

static void check_screen(const char* name, const at::Tensor& screen, const at::Tensor& scales, int64_t G, int64_t nb) {
  TORCH_CHECK(screen.scalar_type() == at::kByte && screen.is_contiguous() && screen.numel() == G * nb * 512 &&
              scales.scalar_type() == at::kShort && scales.is_contiguous() && scales.numel() == G * nb * 32, name,
              ": screen / scales do not match the blocks (HeadScreen)");
}

// x (..., in) fp32 with M rows (1-64); screen uint8 (G, nb * 512); scales int16 (G, nb * 32) holding fp16 bits;
// blocks int8 (16 G, nb * 36), the head's Q8_0 blocks -> (...) int64: argmax_rows(gemv_blocks(x, blocks)).
at::Tensor head_argmax(const at::Tensor& x, const at::Tensor& screen, const at::Tensor& scales,
                       const at::Tensor& blocks, double slack, int64_t max_threads) {
  TORCH_CHECK(blocks.scalar_type() == at::kChar && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) % 36 == 0, "head_argmax: blocks must be contiguous Q8_0 (V, nb * 36) int8");
  const int64_t nb = blocks.size(1) / 36, in = 32 * nb, V = blocks.size(0), G = V / GROUP_ROWS;
  TORCH_CHECK(V % GROUP_ROWS == 0, "head_argmax: the head's rows must be a multiple of 16");
  check_screen("head_argmax", screen, scales, G, nb);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == in && x.numel() >= in,
              "head_argmax: x must be fp32 rows of ", in, " values");
  const int64_t M = x.numel() / in;
  TORCH_CHECK(M <= 64, "head_argmax: at most 64 rows (", M, " given)");
  at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const auto full_head = [&] { return argmax_rows(gemv_blocks(xc, blocks, c10::nullopt, max_threads)); };
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  std::vector<ScreenRows> chunks;
  std::vector<int64_t> first;
  if (!screen_chunks(xp, M, nb, slack, chunks, first))
    return full_head();                      // NOTE: NaN, inf: the full head decides
  // NOTE: ub is written whole before it is read: left uninitialised (zeroing it cost ~0.2 MB of stores a row)
  std::unique_ptr<float[]> ub(new float[M * V]);
  std::vector<float> gub(M * G), glb(M * G);
  const uint8_t* sp = screen.data_ptr<uint8_t>();
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  split_rows(G, nb * 576, max_threads, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (size_t k = 0; k < chunks.size(); ++k) {
        const ScreenRows& q = chunks[k];
        const int64_t r0 = first[k];
        float *u = ub.get() + r0 * V, *gu = gub.data() + r0 * G, *gl = glb.data() + r0 * G;
        const uint8_t* w = sp + g * nb * 512;
        const uint16_t* sc = cp + g * nb * 32;
        switch (q.n) {
#define LAB_SCREEN_ROWS(N) \
          case N: screen_group<N>(w, sc, nb, q.X.data(), q.xs.data(), q.xh.data(), q.base.data(), u, V, gu, gl, G, g); \
            break;
          LAB_SCREEN_ROWS(1) LAB_SCREEN_ROWS(2) LAB_SCREEN_ROWS(3) LAB_SCREEN_ROWS(4) LAB_SCREEN_ROWS(5)
          LAB_SCREEN_ROWS(6) LAB_SCREEN_ROWS(7) default: LAB_SCREEN_ROWS(8)
#undef LAB_SCREEN_ROWS
        }
      }
  });
  // Every row's candidates, one sorted list for all rows: a row's exact argmax is the first largest over any
  // superset of its own candidates (the others' exact logits are below it).
  std::vector<int64_t> cand;
  for (int64_t r = 0; r < M; ++r) {
    const float* gl = glb.data() + r * G;
    const float* gu = gub.data() + r * G;
    const float best_lower = *std::max_element(gl, gl + G);
    for (int64_t g = 0; g < G; ++g) {
      if (!(gu[g] >= best_lower)) continue;
      const float* u = ub.get() + r * V + GROUP_ROWS * g;
      for (int k = 0; k < GROUP_ROWS; ++k)
        if (u[k] >= best_lower) cand.push_back(GROUP_ROWS * g + k);
    }
  }
  std::sort(cand.begin(), cand.end());
  cand.erase(std::unique(cand.begin(), cand.end()), cand.end());
  const int64_t C = int64_t(cand.size());
  // NOTE: cannot happen (the row with the largest s - E is its own row's candidate), but never answer without one
  if (C == 0) return full_head();
  // NOTE: a multiple of 4 rows on one thread: every row then lies in one of the GEMV's quads, which sum a row in
  // the order the full head's quads do (its rows all lie in quads where V splits evenly over its threads).
  const int64_t C4 = (C + 3) / 4 * 4;
  at::Tensor picked = at::empty({C4, blocks.size(1)}, blocks.options());
  const int8_t* bp = blocks.data_ptr<int8_t>();
  int8_t* pp = picked.data_ptr<int8_t>();
  for (int64_t i = 0; i < C4; ++i)
    std::memcpy(pp + i * blocks.size(1), bp + cand[std::min(i, C - 1)] * blocks.size(1), blocks.size(1));
  at::Tensor exact = gemv_blocks(xc.view({M, in}), picked, c10::nullopt, 1);     // (M, C4)
  const float* ep = exact.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    int64_t best = 0;
    for (int64_t i = 1; i < C; ++i)
      if (ep[r * C4 + i] > ep[r * C4 + best]) best = i;
    op[r] = cand[best];
  }
  return out;
}

// x (..., in) fp32 with M rows (1-64); screen uint8 (G, nb * 512) and scales int16 (G, nb * 32) of a Q8_0 weight
// (V = 16 G, in = 32 nb); bias (V,) fp32 or None -> (..., V) fp32: each row's screen values s, i.e. x W^T with x
// rounded to int8 per block of 32 columns (within E of the exact products), plus the bias; every row NaN when any
// input is not finite. A drafter's products (native_head.Int8Weight), never a target's.
at::Tensor screen_products(const at::Tensor& x, const at::Tensor& screen, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& bias, int64_t max_threads) {
  TORCH_CHECK(screen.dim() == 2 && screen.size(1) % 512 == 0, "screen_products: screen must be (G, nb * 512)");
  const int64_t G = screen.size(0), nb = screen.size(1) / 512, in = 32 * nb, V = G * GROUP_ROWS;
  check_screen("screen_products", screen, scales, G, nb);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == in && x.numel() >= in,
              "screen_products: x must be fp32 rows of ", in, " values");
  const int64_t M = x.numel() / in;
  TORCH_CHECK(M <= 64, "screen_products: at most 64 rows (", M, " given)");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == V),
              "screen_products: bias must be contiguous fp32 (", V, ",)");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = V;
  at::Tensor y = at::empty(shape, x.options());
  at::Tensor xc = x.contiguous();
  std::vector<ScreenRows> chunks;
  std::vector<int64_t> first;
  if (!screen_chunks(xc.data_ptr<float>(), M, nb, 0.0, chunks, first)) return y.fill_(NAN);
  const uint8_t* sp = screen.data_ptr<uint8_t>();
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  split_rows(G, nb * 576, max_threads, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (size_t k = 0; k < chunks.size(); ++k) {
        const ScreenRows& q = chunks[k];
        const uint8_t* w = sp + g * nb * 512;
        const uint16_t* sc = cp + g * nb * 32;
        float* out = yp + first[k] * V;
        switch (q.n) {
#define LAB_PRODUCT_ROWS(N) \
          case N: product_group<N>(w, sc, nb, q.X.data(), q.xs.data(), q.base.data(), bp, out, V, g); break;
          LAB_PRODUCT_ROWS(1) LAB_PRODUCT_ROWS(2) LAB_PRODUCT_ROWS(3) LAB_PRODUCT_ROWS(4) LAB_PRODUCT_ROWS(5)
          LAB_PRODUCT_ROWS(6) LAB_PRODUCT_ROWS(7) default: LAB_PRODUCT_ROWS(8)
#undef LAB_PRODUCT_ROWS
        }
      }
  });
  return y;
}
"""


def supported() -> bool:
    """Whether the screen can run here: the native kernels built, and a CPU with AVX-512 VNNI."""
    kernel = native_gemv.load_kernel()
    return kernel is not None and bool(kernel.head_screen_supported())


def screen_layout(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks, int8 (V, in / 32 * 36) with V a multiple of 16 (`can_screen`) -> their screen: (the unsigned
    bytes q + 128, transposed so that one 64-byte load holds 4 columns of 16 rows: uint8 (G, nb * 512); per group and
    block the 16 rows' d, then their |d| |q|_1 rounded up, as fp16 bits: int16 (G, nb * 32))."""
    if not can_screen(blocks):
        raise ValueError("the screen needs 2-D Q8_0 blocks (int8) with a multiple of 16 rows")
    vocab, row_bytes = blocks.shape
    nb = row_bytes // weight_blocks.Q8_0_BYTES
    parts = blocks.view(vocab, nb, weight_blocks.Q8_0_BYTES)
    d = parts[..., :4].contiguous().view(torch.float32).view(vocab, nb)            # fp16 values
    q = parts[..., 4:].to(torch.int16)                                             # (V, nb, 32)
    groups = vocab // GROUP_ROWS
    # (G, 16, nb, 8, 4) -> (G, nb, 8, 16, 4): load c of block b = 4 columns of the group's 16 rows
    unsigned = (q + 128).to(torch.uint8).view(groups, GROUP_ROWS, nb, 8, 4)
    screen = unsigned.permute(0, 2, 3, 1, 4).contiguous().view(groups, nb * 512)
    bound = d.abs() * q.abs().sum(-1).to(torch.float32)                           # |d| |q|_1 (V, nb)
    bound_half = bound.half()
    below = bound_half.float() < bound
    bound_half[below] = torch.nextafter(bound_half[below], torch.tensor(float("inf"), dtype=torch.float16))
    per_group = torch.stack([d.half(), bound_half], 1).view(groups, GROUP_ROWS, 2, nb)   # (G, 16, 2, nb)
    return screen, per_group.permute(0, 3, 2, 1).contiguous().view(torch.int16).view(groups, nb * 32)


class HeadScreen:
    """A Q8_0 head's screen (the module docstring): `argmax(x)` = argmax_rows(gemv(x, blocks)) for 1-64 rows."""

    def __init__(self, blocks: torch.Tensor) -> None:
        """blocks: the head's Q8_0 blocks, int8 (V, in / 32 * 36), V a multiple of 16 (`can_screen`)."""
        self.screen, self.scales = screen_layout(blocks)
        self.blocks = blocks

    @property
    def nbytes(self) -> int:
        return self.screen.numel() + self.scales.numel() * 2

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) fp32, 1-64 rows -> (...) int64: each row's first token with the largest logit."""
        return native_gemv.load_kernel().head_argmax(x, self.screen, self.scales, self.blocks, BOUND_SLACK,
                                                     native_gemv.THREADS)


class Int8Weight:
    """A drafter linear's weight for 8-bit integer products (`engine.proposer.weights=int8`): its Q8_0 blocks in the
    screen's layout (screen_layout), and `products(x)` = the screen values of x, i.e. x W^T with each input row
    rounded to int8 per block of 32 columns, summed in integers by `vpdpbusd` (64 byte products an instruction
    against an fp32 FMA's 16), so a drafter's few rows cost about what their bytes take to arrive. Within E (the
    module docstring) of the exact products: lossy, so only for drafters, whose every draft the target verifies."""

    def __init__(self, blocks: torch.Tensor | None = None, screen: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None) -> None:
        """From Q8_0 `blocks` (int8 (out, in / 32 * 36), out a multiple of 16: `can_screen`), or from a screen and its
        scales as screen_layout lays them out."""
        self.screen, self.scales = screen_layout(blocks) if blocks is not None else (screen, scales)
        self.out_features = self.screen.shape[0] * GROUP_ROWS

    def products(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) fp32 -> (..., out) fp32: x W^T (+ bias) in 8-bit integer products, each row on its own (more
        than MAX_ROWS go MAX_ROWS at a time: a drafter catching up over a prompt); NaN in every row of a piece of
        MAX_ROWS that holds a non-finite input."""
        kernel = native_gemv.load_kernel()
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= MAX_ROWS:
            return kernel.screen_products(x, self.screen, self.scales, bias, native_gemv.THREADS)
        parts = [kernel.screen_products(part, self.screen, self.scales, bias, native_gemv.THREADS)
                 for part in rows.split(MAX_ROWS)]
        return torch.cat(parts).view(*x.shape[:-1], self.out_features)

    def rows(self, rows: slice) -> "Int8Weight | None":
        """The weight of output rows `rows` (a step-1 slice of whole 16-row groups: a drafter's K and V without Q),
        sharing the bytes; None where `rows` cuts a group."""
        start, stop, step = rows.indices(self.out_features)
        if step != 1 or start % GROUP_ROWS or stop % GROUP_ROWS:
            return None
        groups = slice(start // GROUP_ROWS, stop // GROUP_ROWS)
        return Int8Weight(screen=self.screen[groups], scales=self.scales[groups])


def can_screen(blocks: torch.Tensor | None) -> bool:
    """Whether `blocks` is a head the screen takes: 2-D Q8_0 blocks, its rows a multiple of 16."""
    return (blocks is not None and blocks.dim() == 2 and blocks.dtype == torch.int8
            and blocks.shape[0] % GROUP_ROWS == 0 and blocks.shape[1] % weight_blocks.Q8_0_BYTES == 0)
