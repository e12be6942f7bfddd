#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>

static inline float to_float(float x) { return x; }
static inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

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
    float tmp[1024];
    for (int64_t t = begin; t < end; ++t) {
      T* row = base + t * stride;
      if (cosp) {
        const T* c = cosp + pp[t] * D;
        const T* s = sinp + pp[t] * D;
        for (int64_t h = 0; h < H + KV; ++h) {
          T* x = row + h * D;
          for (int64_t d = 0; d < D; ++d)
            tmp[d] = to_float(x[d]) * to_float(c[d]) + to_float(x[(d + half) % D]) * to_float(s[d]);
          for (int64_t d = 0; d < D; ++d) x[d] = static_cast<T>(tmp[d]);
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

// gate_up: [T, 2 I] -> [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
template <typename T>
static void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t num_rows = gate_up.size(0), I = out.size(1), gs = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, num_rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gp + t * gs;
      T* o = op + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float a = to_float(g[i]);
        o[i] = static_cast<T>(a / (1.f + std::exp(-a)) * to_float(g[I + i]));
      }
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

// out = x * rsqrt(mean(x^2) + eps) * weight, row by row (fp32 sums for either dtype)
template <typename T>
static void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t num_rows = x.size(0), H = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* r = xp + t * xs;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < H; ++i) sum += to_float(r[i]) * to_float(r[i]);
      const float inv = 1.f / std::sqrt(sum / H + static_cast<float>(eps));
      T* o = op + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = static_cast<T>(to_float(r[i]) * inv * to_float(wp[i]));
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
