#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Every kernel computes in fp32 on rows converted into a float buffer, in plain loops the compiler
// vectorizes for this CPU (-march=native: AVX-512 where it has it, AVX2 otherwise): bf16 -> fp32 is
// a shift, fp32 -> bf16 rounds to nearest even as c10::BFloat16 does (finite values: -ffast-math),
// and exp is libmvec's vector exp. fp32 rows are read in place.
static inline void to_floats(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
static inline void to_floats(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    dst[i] = f;
  }
}
static inline void from_floats(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
static inline void from_floats(const float* src, at::BFloat16* dst, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(u));
    d[i] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

// A row of n values as floats: the row itself (fp32) or a converted copy in `buf` (bf16).
static inline const float* floats(const float* src, float*, int64_t) { return src; }
static inline const float* floats(const at::BFloat16* src, float* buf, int64_t n) {
  to_floats(src, buf, n);
  return buf;
}

template <typename T>
static std::vector<float> table_floats(const T* p, int64_t n) {
  std::vector<float> out(n);
  to_floats(p, out.data(), n);
  return out;
}

// qkv: [T, (H + 2 KV) * D]. Rows of Q and K heads rotated in place when cos is given
// (y[d] = x[d] cos[d] + x[(d + D/2) % D] sin[d], sin's first half negated); K and V rows
// copied to k_cache/v_cache[rows[t], head, cols[t]].
template <typename T>
static void rope_write_impl(at::Tensor& qkv, const at::Tensor& positions, const c10::optional<at::Tensor>& cos,
                            const c10::optional<at::Tensor>& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& rows, const at::Tensor& cols, int64_t H) {
  const int64_t num_rows = qkv.size(0), KV = k_cache.size(1), L = k_cache.size(2), D = k_cache.size(3);
  const int64_t half = D / 2, stride = qkv.stride(0);
  T* base = qkv.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* cp = cols.data_ptr<int64_t>();
  const T* cosp = cos ? cos->data_ptr<T>() : nullptr;
  const T* sinp = sin ? sin->data_ptr<T>() : nullptr;
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(4 * D);
    float *x = buf.data(), *y = x + D, *cbuf = y + D, *sbuf = cbuf + D;
    for (int64_t t = begin; t < end; ++t) {
      T* row = base + t * stride;
      if (cosp) {
        const float* c = floats(cosp + pp[t] * D, cbuf, D);
        const float* s = floats(sinp + pp[t] * D, sbuf, D);
        for (int64_t h = 0; h < H + KV; ++h) {
          T* head = row + h * D;
          to_floats(head, x, D);
#pragma omp simd
          for (int64_t d = 0; d < half; ++d) y[d] = x[d] * c[d] + x[d + half] * s[d];
#pragma omp simd
          for (int64_t d = half; d < D; ++d) y[d] = x[d] * c[d] + x[d - half] * s[d];
          from_floats(y, head, D);
        }
      }
      for (int64_t h = 0; h < KV; ++h) {
        const int64_t dst = ((rp[t] * KV + h) * L + cp[t]) * D;
        std::memcpy(kc + dst, row + (H + h) * D, D * sizeof(T));
        std::memcpy(vc + dst, row + (H + KV + h) * D, D * sizeof(T));
      }
    }
  });
}
void rope_write(at::Tensor qkv, at::Tensor positions, c10::optional<at::Tensor> cos, c10::optional<at::Tensor> sin,
                at::Tensor k_cache, at::Tensor v_cache, at::Tensor rows, at::Tensor cols, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  const int64_t KV = k_cache.size(1), L = k_cache.size(2), D = k_cache.size(3), T = qkv.size(0);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * KV) * D && D <= 1024 && D % 2 == 0,
              "rope_write: qkv is not [T, (H + 2 KV) * D]");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type());
  TORCH_CHECK(positions.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
              cols.scalar_type() == at::kLong);
  TORCH_CHECK(positions.is_contiguous() && rows.is_contiguous() && cols.is_contiguous());
  TORCH_CHECK(positions.size(0) == T && rows.size(0) == T && cols.size(0) == T);
  TORCH_CHECK(cos.has_value() == sin.has_value());
  if (cos) {
    TORCH_CHECK(cos->is_contiguous() && sin->is_contiguous() && cos->size(1) == D && sin->sizes() == cos->sizes());
    TORCH_CHECK(cos->scalar_type() == qkv.scalar_type() && sin->scalar_type() == qkv.scalar_type());
  }
  for (int64_t t = 0; t < T; ++t) {  // the kernel writes without bounds checks
    const int64_t r = rows.data_ptr<int64_t>()[t], c = cols.data_ptr<int64_t>()[t];
    const int64_t p = positions.data_ptr<int64_t>()[t];
    TORCH_CHECK(r >= 0 && r < k_cache.size(0), "rope_write: cache row ", r, " out of range");
    TORCH_CHECK(c >= 0 && c < L, "rope_write: cache column ", c, " out of range");
    TORCH_CHECK(!cos || (p >= 0 && p < cos->size(0)), "rope_write: position ", p, " out of range");
  }
  if (qkv.scalar_type() == at::kBFloat16)
    rope_write_impl<at::BFloat16>(qkv, positions, cos, sin, k_cache, v_cache, rows, cols, num_heads);
  else if (qkv.scalar_type() == at::kFloat)
    rope_write_impl<float>(qkv, positions, cos, sin, k_cache, v_cache, rows, cols, num_heads);
  else TORCH_CHECK(false, "rope_write: float32 or bfloat16, got ", qkv.scalar_type());
}

// o[i] = silu(g[i]) * g[I + i] over I values, for fp32 rows.
static void silu_row(const float* g, float* o, int64_t I) {
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float a = g[i];
    o[i] = a / (1.f + std::exp(-a)) * g[I + i];
  }
}

// The same for bf16 rows, each fp32 step rounded as scalar fp32 code rounds it, so that rounding to
// bf16 lands where torch's own bf16 SiLU-times-up lands: exp is taken in double and stored as float
// (libmvec's float exp is not correctly rounded), and with AVX-512 the add, division and product
// are explicitly rounded intrinsics, which -ffast-math cannot turn into an approximate reciprocal.
static void silu_row_rounded(const float* g, float* o, int64_t I) {
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) o[i] = static_cast<float>(std::exp(-static_cast<double>(g[i])));
  int64_t i = 0;
#if defined(__AVX512F__)
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= I; i += 16) {
    const __m512 d = _mm512_add_round_ps(one, _mm512_loadu_ps(o + i), R);
    const __m512 q = _mm512_div_round_ps(_mm512_loadu_ps(g + i), d, R);
    _mm512_storeu_ps(o + i, _mm512_mul_round_ps(q, _mm512_loadu_ps(g + I + i), R));
  }
#endif
  for (; i < I; ++i) o[i] = g[i] / (1.f + o[i]) * g[I + i];
}

// gate_up: [T, 2 I] -> [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
template <typename T>
static void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t num_rows = gate_up.size(0), I = out.size(1), gs = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, num_rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(3 * I);
    for (int64_t t = begin; t < end; ++t) {
      const float* g = floats(gp + t * gs, buf.data(), 2 * I);
      float* o = buf.data() + 2 * I;
      if constexpr (std::is_same_v<T, float>) silu_row(g, o, I);
      else silu_row_rounded(g, o, I);
      from_floats(o, op + t * I, I);
    }
  });
}

at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0);
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) silu_mul_impl<at::BFloat16>(gate_up, out);
  else if (gate_up.scalar_type() == at::kFloat) silu_mul_impl<float>(gate_up, out);
  else TORCH_CHECK(false, "silu_mul: float32 or bfloat16, got ", gate_up.scalar_type());
  return out;
}

// out = x * rsqrt(mean(x^2) + eps) * weight, row by row (fp32 sums for either dtype); fp32 rows
// in place, bf16 ones through a float copy.
template <typename T>
static void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t num_rows = x.size(0), H = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const std::vector<float> wf = std::is_same_v<T, float> ? std::vector<float>() : table_floats(wp, H);
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(std::is_same_v<T, float> ? 0 : 2 * H);
    for (int64_t t = begin; t < end; ++t) {
      if constexpr (std::is_same_v<T, float>) {
        const float* r = xp + t * xs;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < H; ++i) sum += r[i] * r[i];
        const float inv = 1.f / std::sqrt(sum / H + static_cast<float>(eps));
        float* o = op + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) o[i] = r[i] * inv * wp[i];
      } else {
        float *r = buf.data(), *o = r + H;
        to_floats(xp + t * xs, r, H);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < H; ++i) sum += r[i] * r[i];
        const float inv = 1.f / std::sqrt(sum / H + static_cast<float>(eps));
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) o[i] = r[i] * inv * wf[i];
        from_floats(o, op + t * H, H);
      }
    }
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 1 && weight.size(0) == x.size(1));
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type());
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.scalar_type() == at::kBFloat16) rms_norm_impl<at::BFloat16>(x, weight, eps, out);
  else if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, weight, eps, out);
  else TORCH_CHECK(false, "rms_norm: float32 or bfloat16, got ", x.scalar_type());
  return out;
}
