#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// y = x W^T (* scale) + bias + residual for a few rows of x: one pass over each weight row for
// all of x's rows. What differs between weight types is only how a vector of weights meets a
// vector of x (a "Dot" below); the blocking, the tails, the epilogue and the threading are one
// template for all of them.

#if defined(__AVX2__)
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Each Dot: X and W (element types of x and of the weights), L (elements per step), Acc (an
// accumulator vector), zero(), madd(acc, x, w) over L elements, and sum(acc) where Acc is not
// AVX-512's (whose sums `reduce` takes 16 at a time).
#if defined(__AVX512F__)
struct Int8Dot {  // int8 weights widened to fp32, fp32 activations
  using X = float;
  using W = int8_t;
  using Acc = __m512;
  static constexpr int L = 16;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc madd(Acc acc, const X* x, const W* w) {
    const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
    return _mm512_fmadd_ps(wv, _mm512_loadu_ps(x), acc);
  }
};
struct F32Dot {
  using X = float;
  using W = float;
  using Acc = __m512;
  static constexpr int L = 16;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc madd(Acc acc, const X* x, const W* w) { return _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_loadu_ps(x), acc); }
};
#elif defined(__AVX2__)
struct Int8Dot {
  using X = float;
  using W = int8_t;
  using Acc = __m256;
  static constexpr int L = 8;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc madd(Acc acc, const X* x, const W* w) {
    const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
    return _mm256_fmadd_ps(wv, _mm256_loadu_ps(x), acc);
  }
  static float sum(Acc acc) { return hsum(acc); }
};
struct F32Dot {
  using X = float;
  using W = float;
  using Acc = __m256;
  static constexpr int L = 8;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc madd(Acc acc, const X* x, const W* w) { return _mm256_fmadd_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(x), acc); }
  static float sum(Acc acc) { return hsum(acc); }
};
#else
template <class XT, class WT>
struct ScalarDot {
  using X = XT;
  using W = WT;
  using Acc = float;
  static constexpr int L = 1;
  static Acc zero() { return 0.f; }
  static Acc madd(Acc acc, const X* x, const W* w) { return acc + static_cast<float>(*x) * static_cast<float>(*w); }
  static float sum(Acc acc) { return acc; }
};
using Int8Dot = ScalarDot<float, int8_t>;
using F32Dot = ScalarDot<float, float>;
#endif

#if defined(__AVX512BF16__)
#define SKINNY_BF16 1
struct Bf16Dot {  // bf16 pairs multiplied and summed into fp32 lanes (AVX512_BF16)
  using X = at::BFloat16;
  using W = at::BFloat16;
  using Acc = __m512;
  static constexpr int L = 32;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc madd(Acc acc, const X* x, const W* w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_loadu_si512(w));
  }
};
#endif

// Plain row-major weights: prefetch the weight rows this many blocks ahead while reading this
// block's: a block reads NB streams at once, more than the hardware prefetcher runs far enough
// ahead on.
constexpr int PREFETCH_BLOCKS = 4;
// Blocked weights (`dense_layout`): 8 rows interleaved by vectors, [N / 8][K / L][8][L], so a
// thread reads its weights as one sequential stream, which the hardware prefetcher follows where
// it loses the 8 short strided streams of plain rows (rows of a few hundred values). Ahead of it,
// this many bytes are prefetched into L2 (a block or two of rows: with several rows of x a block
// is read once from memory and again from L1 for each pair of x rows, and the next block must be
// on its way meanwhile; into L1 they would push out the block being read).
constexpr int BLOCK_ROWS = 8;
constexpr int64_t PREFETCH_BYTES = 16384;

#if defined(__AVX512F__)
// out[c] = the sum of acc[c]'s lanes for C <= 16 accumulators at once: a transposing tree of
// shuffles and adds (15 adds for 16 sums, against about 10 instructions a sum one at a time),
// which matters where K is a few hundred.
static inline void sum16(const __m512* acc, int C, float* out) {
  __m512 v[16];
  for (int c = 0; c < 16; ++c) v[c] = c < C ? acc[c] : _mm512_setzero_ps();
  for (int c = 0; c < 8; ++c)  // [a0+a1, a2+a3, b0+b1, b2+b3] per 128-bit lane
    v[c] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * c], v[2 * c + 1], 0x88), _mm512_shuffle_ps(v[2 * c], v[2 * c + 1], 0xDD));
  for (int c = 0; c < 4; ++c)  // [a, b, c, d] per 128-bit lane
    v[c] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * c], v[2 * c + 1], 0x88), _mm512_shuffle_ps(v[2 * c], v[2 * c + 1], 0xDD));
  for (int c = 0; c < 2; ++c)  // 128-bit lanes summed in pairs
    v[c] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * c], v[2 * c + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * c], v[2 * c + 1], 0xDD));
  v[0] = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
  alignas(64) float all[16];
  _mm512_store_ps(all, v[0]);
  std::memcpy(out, all, C * sizeof(float));
}
#endif

// out[c] = the sum of acc[c]'s lanes, c < C.
template <class D>
static inline void reduce(typename D::Acc* acc, int C, float* out) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<typename D::Acc, __m512>) {
    for (int c0 = 0; c0 < C; c0 += 16) sum16(acc + c0, std::min(16, C - c0), out + c0);
  } else
#endif
    for (int c = 0; c < C; ++c) out[c] = D::sum(acc[c]);
}

// sums[j * NB + i] = x[j] . w[i] over K for MB rows of x (row stride K) and NB weight rows from
// w, the first of them: plain (BLK false), row i at w + i * K and its value k at + k, with `left`
// weight rows from w on (the prefetches stay within them); blocked, row i at w + i * L and its
// value k at + k * BLOCK_ROWS (K a multiple of L), prefetched up to `end`.
template <class D, int MB, int NB, bool BLK>
static inline void dot_block(const typename D::X* x, const typename D::W* w, int64_t K, int64_t left,
                             const typename D::W* end, float* sums) {
  using X = typename D::X;
  using W = typename D::W;
  constexpr int L = D::L;
  constexpr int64_t KS = BLK ? BLOCK_ROWS : 1;
  const int64_t row_stride = BLK ? L : K;
  typename D::Acc acc[MB][NB];
  const W* ahead[NB];  // plain: the row each weight row prefetches, the last one near w's end
  if constexpr (!BLK)
    for (int i = 0; i < NB; ++i) ahead[i] = w + std::min<int64_t>(i + PREFETCH_BLOCKS * NB, left - 1) * K;
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NB; ++i) acc[j][i] = D::zero();
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    if constexpr (BLK) {
      const W* at = w + k * KS;
      if (at + PREFETCH_BYTES / static_cast<int64_t>(sizeof(W)) < end)  // NB rows' vectors at k: NB * L values in a row
        for (int i = 0; i < NB * L * static_cast<int>(sizeof(W)); i += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(at) + PREFETCH_BYTES + i, 0, 2);  // into L2
    } else {
      for (int i = 0; i < NB; ++i) __builtin_prefetch(ahead[i] + k);
    }
    for (int i = 0; i < NB; ++i)
      for (int j = 0; j < MB; ++j) acc[j][i] = D::madd(acc[j][i], x + j * K + k, w + i * row_stride + k * KS);
  }
  if (!BLK && k < K) {  // the last K % L values, zero-padded to a full step
    X xt[MB][L];
    W wt[L];
    std::memset(xt, 0, sizeof(xt));
    for (int j = 0; j < MB; ++j) std::memcpy(xt[j], x + j * K + k, (K - k) * sizeof(X));
    for (int i = 0; i < NB; ++i) {
      std::memset(wt, 0, sizeof(wt));
      std::memcpy(wt, w + i * K + k, (K - k) * sizeof(W));
      for (int j = 0; j < MB; ++j) acc[j][i] = D::madd(acc[j][i], xt[j], wt);
    }
  }
  reduce<D>(&acc[0][0], MB * NB, sums);
}

// What one call works on; Y is the output's (and the bias's and residual's) element type.
template <class D, class Y>
struct Problem {
  const typename D::X* x;
  const typename D::W* w;  // plain or blocked (`dense_layout`), [N, K] values
  const float* scales;  // per weight row, or null
  const Y* bias;
  const Y* residual;
  Y* y;
  int64_t M, K, N;
};

// Where weight row n starts (its value 0): plain or blocked.
template <class D, class Y, bool BLK>
static inline const typename D::W* weight_row(const Problem<D, Y>& p, int64_t n) {
  if constexpr (BLK) return p.w + (n / BLOCK_ROWS) * BLOCK_ROWS * p.K + (n % BLOCK_ROWS) * D::L;
  return p.w + n * p.K;
}

// Weight rows [n, n + NB) against x's rows [m, m + MB), written out with the epilogue.
template <class D, class Y, int MB, int NB, bool BLK>
static void block(const Problem<D, Y>& p, int64_t m, int64_t n) {
  float sums[MB * NB];
  dot_block<D, MB, NB, BLK>(p.x + m * p.K, weight_row<D, Y, BLK>(p, n), p.K, p.N - n, p.w + p.N * p.K, sums);
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NB; ++i) {
      const int64_t at = (m + j) * p.N + n + i;
      float v = sums[j * NB + i] * (p.scales ? p.scales[n + i] : 1.f);
      if (p.bias) v += static_cast<float>(p.bias[n + i]);
      if (p.residual) v += static_cast<float>(p.residual[at]);
      p.y[at] = static_cast<Y>(v);
    }
}

// Every row of x against weight rows [n, n + NB): x in blocks of 4 rows (2 with 8 weight rows),
// so the NB weight rows are read from memory once and from L1 for the rest.
template <class D, class Y, int NB, bool BLK>
static void rows(const Problem<D, Y>& p, int64_t n) {
  constexpr int MB = NB > 4 ? 2 : 4;
  int64_t m = 0;
  for (; m + MB <= p.M; m += MB) block<D, Y, MB, NB, BLK>(p, m, n);
  switch (p.M - m) {
    case 3:
      if constexpr (MB > 3) block<D, Y, 3, NB, BLK>(p, m, n);
      break;
    case 2: block<D, Y, 2, NB, BLK>(p, m, n); break;
    case 1: block<D, Y, 1, NB, BLK>(p, m, n); break;
  }
}

// Weight rows split across torch's threads in chunks of whole 8-row blocks. A blocked weight goes
// 8 rows at a time against x's rows 2 by 2 (half a block would read every other stretch of its
// stream); a plain one so up to 4 rows of x, and 4 weight rows at a time against more, 4 by 4:
// at most 16 sums in registers. A chunk's last rows that fill no block go one at a time (plain
// weights only: a blocked weight's rows fill whole blocks). The blocking changes no result: each sum runs over K
// in the same order whatever the block and the layout.
template <class D, class Y, bool BLK>
static void run(const Problem<D, Y>& p) {
  at::parallel_for(0, (p.N + 7) / 8, 4, [&](int64_t b0, int64_t b1) {
    const int64_t n1 = std::min(b1 * 8, p.N);
    int64_t n = b0 * 8;
    if (p.M <= 4 || BLK)
      for (; n + 8 <= n1; n += 8) rows<D, Y, 8, BLK>(p, n);
    for (; n + 4 <= n1; n += 4) rows<D, Y, 4, BLK>(p, n);
    for (; n < n1; ++n) rows<D, Y, 1, BLK>(p, n);
  });
}

template <class D, class Y>
static void launch(const at::Tensor& x, const at::Tensor& w, bool blocked, const float* scales,
                   const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual, at::Tensor& y) {
  Problem<D, Y> p{reinterpret_cast<const typename D::X*>(x.data_ptr()),
                  reinterpret_cast<const typename D::W*>(w.data_ptr()),
                  scales,
                  bias ? reinterpret_cast<const Y*>(bias->data_ptr()) : nullptr,
                  residual ? reinterpret_cast<const Y*>(residual->data_ptr()) : nullptr,
                  reinterpret_cast<Y*>(y.data_ptr()),
                  x.size(0),
                  x.size(1),
                  w.size(0)};
  if (blocked)
    run<D, Y, true>(p);
  else
    run<D, Y, false>(p);
}

// Values a step of the dense Dot for weights of this dtype (0: no dense kernel for it on this build).
static int dense_lanes(at::ScalarType dtype) {
  if (dtype == at::kFloat) return F32Dot::L;
#if defined(SKINNY_BF16)
  if (dtype == at::kBFloat16) return Bf16Dot::L;
#endif
  return 0;
}

// Whether `dense_layout` blocks a weight [N, K] of this dtype.
static bool blocks(int64_t N, int64_t K, at::ScalarType dtype) {
  const int L = dense_lanes(dtype);
  return L > 0 && N % BLOCK_ROWS == 0 && K % L == 0;
}

static void check(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& residual, const char* name) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": x [M, K] against weight [N, K]");
  TORCH_CHECK(x.is_cpu() && w.is_cpu() && (!bias || bias->is_cpu()) && (!residual || residual->is_cpu()), name,
              ": x, the weight, bias and residual must be CPU tensors");
  TORCH_CHECK(w.is_contiguous() && !w.is_mkldnn(), name, ": the weight must be a plain contiguous tensor");
  TORCH_CHECK(!bias || bias->numel() == w.size(0), name, ": one bias per weight row");
  TORCH_CHECK(!residual || (residual->dim() == 2 && residual->size(0) == x.size(0) && residual->size(1) == w.size(0)),
              name, ": residual is not [M, N]");
}

// The weight dtypes `dense_linear` serves on this build: fp32 always, bf16 with AVX512_BF16.
std::vector<std::string> dense_dtypes() {
#if defined(SKINNY_BF16)
  return {"float32", "bfloat16"};
#else
  return {"float32"};
#endif
}

// The weight's values as `dense_linear` reads them fastest, and whether they are blocked (see
// BLOCK_ROWS): blocked where its rows fill whole blocks and its rows whole vectors, else a plain
// contiguous copy. Same shape [N, K] either way.
std::tuple<at::Tensor, bool> dense_layout(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_cpu() && !w.is_mkldnn(), "dense_layout: a plain CPU weight [N, K]");
  const auto dtype = w.scalar_type();
  const int L = dense_lanes(dtype);
  TORCH_CHECK(L > 0, "dense_layout: no kernel for ", dtype, " weights on this build");
  const int64_t N = w.size(0), K = w.size(1);
  if (!blocks(N, K, dtype)) return {w.contiguous(), false};
  at::Tensor b = w.reshape({N / BLOCK_ROWS, BLOCK_ROWS, K / L, L}).permute({0, 2, 1, 3}).contiguous();
  return {b.view({N, K}), true};
}

// y = x w^T + bias + residual; x [M, K] and w [N, K] of one dtype (fp32, or bf16 where built for
// it), laid out by `dense_layout` (`blocked` as it said), bias and residual in it too; y in it,
// its sums fp32.
at::Tensor dense_linear(at::Tensor x, at::Tensor w, bool blocked, c10::optional<at::Tensor> bias,
                        c10::optional<at::Tensor> residual) {
  check(x, w, bias, residual, "dense_linear");
  const auto dtype = w.scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype && (!bias || bias->scalar_type() == dtype) &&
                  (!residual || residual->scalar_type() == dtype),
              "dense_linear: x, bias and residual must have the weight's dtype");
  x = x.contiguous();
  const c10::optional<at::Tensor> b = bias ? c10::optional<at::Tensor>(bias->contiguous()) : c10::nullopt;
  const c10::optional<at::Tensor> r = residual ? c10::optional<at::Tensor>(residual->contiguous()) : c10::nullopt;
  TORCH_CHECK(!blocked || blocks(w.size(0), w.size(1), dtype), "dense_linear: this weight is never blocked");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (dtype == at::kFloat) {
    launch<F32Dot, float>(x, w, blocked, nullptr, b, r, y);
#if defined(SKINNY_BF16)
  } else if (dtype == at::kBFloat16) {
    launch<Bf16Dot, at::BFloat16>(x, w, blocked, nullptr, b, r, y);
#endif
  } else {
    TORCH_CHECK(false, "dense_linear: no kernel for ", dtype, " weights on this build");
  }
  return y;
}

// y = (x q^T) * scales + bias + residual; x [M, K] (fp32 or bf16), q [N, K] int8, scales [N]; y in x's dtype.
at::Tensor int8_linear(at::Tensor x, at::Tensor q, at::Tensor scales, c10::optional<at::Tensor> bias,
                       c10::optional<at::Tensor> residual) {
  check(x, q, bias, residual, "int8_linear");
  TORCH_CHECK(q.scalar_type() == at::kChar, "int8_linear: q must be int8");
  TORCH_CHECK(scales.numel() == q.size(0), "int8_linear: one scale per row of q");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  const c10::optional<at::Tensor> b = bias ? c10::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : c10::nullopt;
  const c10::optional<at::Tensor> r =
      residual ? c10::optional<at::Tensor>(residual->to(at::kFloat).contiguous()) : c10::nullopt;
  at::Tensor y = at::empty({x.size(0), q.size(0)}, x.options().dtype(at::kFloat));
  launch<Int8Dot, float>(xf, q, false, sf.data_ptr<float>(), b, r, y);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}
