#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// sums[j] = x[j] . w over K values, for MB rows of x (fp32, row stride K). With few rows each row
// keeps U independent sums, so the loop is not held up by one chain of dependent FMAs.
template <int MB>
static inline void dot_rows(const float* x, const int8_t* w, int64_t K, float* sums) {
  int64_t k = 0;
#if defined(__AVX2__)
  constexpr int U = MB >= 4 ? 1 : 4 / MB;
  __m256 acc[MB][U];
  for (int j = 0; j < MB; ++j)
    for (int u = 0; u < U; ++u) acc[j][u] = _mm256_setzero_ps();
  for (; k + 8 * U <= K; k += 8 * U) {
    for (int u = 0; u < U; ++u) {
      const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k + 8 * u));
      const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(packed));
      for (int j = 0; j < MB; ++j) acc[j][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * K + k + 8 * u), acc[j][u]);
    }
  }
  for (int j = 0; j < MB; ++j) {
    for (int u = 1; u < U; ++u) acc[j][0] = _mm256_add_ps(acc[j][0], acc[j][u]);
    sums[j] = hsum(acc[j][0]);
  }
#else
  for (int j = 0; j < MB; ++j) sums[j] = 0.f;
#endif
  for (; k < K; ++k)
    for (int j = 0; j < MB; ++j) sums[j] += x[j * K + k] * w[k];
}

template <int MB>
static void rows_block(const float* x, int64_t K, const int8_t* q, const float* scales, const float* bias,
                       const float* residual, float* y, int64_t N, int64_t n0, int64_t n1) {
  float sums[MB];
  for (int64_t n = n0; n < n1; ++n) {
    dot_rows<MB>(x, q + n * K, K, sums);
    for (int j = 0; j < MB; ++j) {
      float v = sums[j] * scales[n] + (bias ? bias[n] : 0.f);
      y[j * N + n] = v + (residual ? residual[j * N + n] : 0.f);
    }
  }
}

using Block = void (*)(const float*, int64_t, const int8_t*, const float*, const float*, const float*, float*,
                       int64_t, int64_t, int64_t);
static const Block BLOCKS[8] = {rows_block<1>, rows_block<2>, rows_block<3>, rows_block<4>,
                                rows_block<5>, rows_block<6>, rows_block<7>, rows_block<8>};

// y = (x q^T) * scales + bias + residual; x [M, K], q [N, K] int8, scales [N]; y in x's dtype.
at::Tensor int8_linear(at::Tensor x, at::Tensor q, at::Tensor scales, c10::optional<at::Tensor> bias,
                       c10::optional<at::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "int8_linear: x [M, K] against q [N, K]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "int8_linear: q must be contiguous int8");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(scales.numel() == N && (!bias || bias->numel() == N), "int8_linear: one scale (and bias) per row of q");
  TORCH_CHECK(!residual || (residual->size(0) == M && residual->size(1) == N), "int8_linear: residual is not [M, N]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  const at::Tensor bf = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor rf = residual ? residual->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  const float* bp = bias ? bf.data_ptr<float>() : nullptr;
  const float* rp = residual ? rf.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 8) {  // each weight row stays in L1 across the blocks of 8 rows
      const int64_t mb = std::min<int64_t>(8, M - m);
      BLOCKS[mb - 1](xp + m * K, K, qp, sp, bp, rp ? rp + m * N : nullptr, yp + m * N, N, n0, n1);
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}
