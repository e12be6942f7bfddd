#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// Every kernel computes in fp32 on rows converted into a float buffer, in plain loops the compiler
// vectorizes for this CPU (-march=native: AVX-512 where it has it, AVX2 otherwise): bf16 -> fp32 is
// a shift, fp32 -> bf16 rounds to nearest even as c10::BFloat16 does (finite values: -ffast-math),
// and exp is libmvec's vector exp. fp32 rows are read in place. Where the compiler does not
// vectorize a loop (gathers, a first-index search), AVX-512 and AVX2 intrinsics do, with the
// plain loop for the rest of a row and for other CPUs.
//
// A parallel region costs a few microseconds to wake the other threads (far more on a loaded
// machine, where a woken thread may wait for a core), which is more than a decode step's whole
// pass over a small tensor: each kernel splits its rows over threads only in tasks of at least
// this many values.
static constexpr int64_t kValuesPerTask = 64 * 1024;
static inline int64_t rows_per_task(int64_t values_per_row) {
  return std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, values_per_row));
}
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

// One value of a row as a float, and a float stored back (bf16: rounded as to_floats/from_floats do).
static inline float load_float(const float* p) { return *p; }
static inline float load_float(const at::BFloat16* p) {
  const uint32_t u = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
static inline void store_float(float* p, float v) { *p = v; }
static inline void store_float(at::BFloat16* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// One head of D = 2 half values rotated in place: each pair (d, d + half) is read once, both
// rotated values written back, with no copy of the head.
template <typename T>
static inline void rotate_head(T* __restrict x, const float* __restrict c, const float* __restrict s, int64_t half) {
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float lo = load_float(x + d), hi = load_float(x + d + half);
    store_float(x + d, lo * c[d] + hi * s[d]);
    store_float(x + d + half, hi * c[d + half] + lo * s[d + half]);
  }
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
  at::parallel_for(0, num_rows, rows_per_task(qkv.size(1)), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(cosp && !std::is_same_v<T, float> ? 2 * D : 0);
    for (int64_t t = begin; t < end; ++t) {
      T* row = base + t * stride;
      if (cosp) {
        const float* __restrict c = floats(cosp + pp[t] * D, buf.data(), D);
        const float* __restrict s = floats(sinp + pp[t] * D, buf.data() + D, D);
        for (int64_t h = 0; h < H + KV; ++h) rotate_head(row + h * D, c, s, half);
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
  const int64_t *rp = rows.data_ptr<int64_t>(), *cp = cols.data_ptr<int64_t>(), *pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {  // the kernel writes without bounds checks
    const int64_t r = rp[t], c = cp[t], p = pp[t];
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

// The same for bf16 rows, each fp32 step rounded as scalar fp32 code rounds it, so that the one
// rounding to bf16 lands where fp32 SiLU-times-up rounded to bf16 lands (torch's bf16 ops round
// twice, after the SiLU and after the product): exp is taken in double and stored as float
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

// SiLU of every bf16 value, as silu_row_rounded computes it (indexed by the value's bits): a bf16
// gate has only 65,536 values, so a bf16 row looks each up instead of taking a double exp per
// value, and lands on the very same fp32 and bf16 results. Built once, on first use.
static const float* bf16_silu_table() {
  static const std::vector<float> table = [] {
    constexpr int64_t n = 1 << 16;
    std::vector<float> g(2 * n, 1.f), out(n);  // the gate's every value, times an up of 1 (exact)
    for (int64_t b = 0; b < n; ++b) {
      const uint32_t u = static_cast<uint32_t>(b) << 16;
      std::memcpy(&g[b], &u, sizeof(float));
    }
    silu_row_rounded(g.data(), out.data(), n);
    return out;
  }();
  return table.data();
}

// o[i] = round_bf16(table[gate[i]] * up[i]) over I values of a bf16 row (gate, then up).
static void silu_row_bf16(const uint16_t* g, uint16_t* o, int64_t I, const float* table) {
  int64_t i = 0;
#if defined(__AVX512F__)
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  for (; i + 16 <= I; i += 16) {
    const __m512i gi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i)));
    const __m512i ui = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + I + i)));
    const __m512 prod = _mm512_mul_round_ps(_mm512_i32gather_ps(gi, table, 4),
                                            _mm512_castsi512_ps(_mm512_slli_epi32(ui, 16)), R);
    const __m512i u = _mm512_castps_si512(prod);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm512_cvtepi32_epi16(r));
  }
#elif defined(__AVX2__)
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  for (; i + 8 <= I; i += 8) {
    const __m256i gi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i)));
    const __m256i ui = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + I + i)));
    const __m256 prod = _mm256_mul_ps(_mm256_i32gather_ps(table, gi, 4), _mm256_castsi256_ps(_mm256_slli_epi32(ui, 16)));
    const __m256i u = _mm256_castps_si256(prod);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), lsb), 16);
    // 8 values of 32 bits (each below 2^16) to 16: pack within lanes, then put the lanes' halves together
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), packed);
  }
#endif
  for (; i < I; ++i) {
    const uint32_t ub = static_cast<uint32_t>(g[I + i]) << 16;
    float up;
    std::memcpy(&up, &ub, sizeof(up));
    const float v = table[g[i]] * up;
    store_float(reinterpret_cast<at::BFloat16*>(o + i), v);
  }
}

// gate_up: [T, 2 I] -> [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
template <typename T>
static void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t num_rows = gate_up.size(0), I = out.size(1), gs = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  if constexpr (std::is_same_v<T, float>) {
    at::parallel_for(0, num_rows, rows_per_task(I), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_row(gp + t * gs, op + t * I, I);
    });
  } else {
    const float* table = bf16_silu_table();
    const uint16_t* g = reinterpret_cast<const uint16_t*>(gp);
    uint16_t* o = reinterpret_cast<uint16_t*>(op);
    at::parallel_for(0, num_rows, rows_per_task(I), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_row_bf16(g + t * gs, o + t * I, I, table);
    });
  }
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
  // 16 rows a task, not rows_per_task: the loop below is inlined twice (on the calling thread and
  // in a parallel task) and the two copies sum fp32 rows in different orders, so an fp32 row's
  // result (to an ulp) depends on which copy runs it, that is on where the split falls.
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

// The index of the row's largest value, as torch.argmax returns it: the first of equal maxima, or
// the first NaN where there is one. Two vector passes: the maximum (and whether a NaN is there,
// told by its bits: -ffast-math code may not compare NaNs), then the first value equal to it.
static inline bool is_nan_bits(uint32_t b) { return (b & 0x7FFFFFFFu) > 0x7F800000u; }
static int64_t argmax_row(const float* x, int64_t n) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  float m = x[0];
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  {
    __m512 vm = _mm512_set1_ps(m);
    __m512i vn = _mm512_setzero_si512();
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    for (; i + 16 <= n; i += 16) {
      const __m512i v = _mm512_loadu_si512(x + i);
      vm = _mm512_max_ps(vm, _mm512_castsi512_ps(v));
      vn = _mm512_max_epi32(vn, _mm512_and_si512(v, abs));
    }
    m = _mm512_reduce_max_ps(vm);
    nan = _mm512_cmpgt_epi32_mask(vn, inf) != 0;
  }
#elif defined(__AVX2__)
  {
    __m256 vm = _mm256_set1_ps(m);
    __m256i vn = _mm256_setzero_si256();
    const __m256i abs = _mm256_set1_epi32(0x7FFFFFFF);
    for (; i + 8 <= n; i += 8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      vm = _mm256_max_ps(vm, _mm256_castsi256_ps(v));
      vn = _mm256_max_epi32(vn, _mm256_and_si256(v, abs));
    }
    alignas(32) float lanes[8];
    alignas(32) int32_t nl[8];
    _mm256_store_ps(lanes, vm);
    _mm256_store_si256(reinterpret_cast<__m256i*>(nl), vn);
    for (int j = 0; j < 8; ++j) { m = std::max(m, lanes[j]); nan |= nl[j] > 0x7F800000; }
  }
#endif
  for (; i < n; ++i) { m = std::max(m, x[i]); nan |= is_nan_bits(bits[i]); }
  if (nan) {
    for (int64_t j = 0; j < n; ++j) if (is_nan_bits(bits[j])) return j;
  }
  i = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vm, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
#elif defined(__AVX2__)
  const __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(eq);
  }
#endif
  for (; i < n; ++i) if (x[i] == m) return i;
  return 0;  // not reached: m is one of the row's values
}

// bf16 rows are widened into a float buffer first, so the index is the one the fp32 copy of the
// same logits gives (the widening is exact), without writing that copy for every row of a step.
at::Tensor argmax(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "argmax: [rows, n > 0] float32 or bfloat16 rows");
  const int64_t num_rows = x.size(0), n = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({num_rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kFloat) {
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, num_rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) op[t] = argmax_row(xp + t * xs, n);
    });
  } else {
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, num_rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
      std::vector<float> row(n);
      for (int64_t t = begin; t < end; ++t) {
        to_floats(xp + t * xs, row.data(), n);
        op[t] = argmax_row(row.data(), n);
      }
    });
  }
  return out;
}
