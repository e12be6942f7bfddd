#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
// 16 values as fp32 (bf16: widen to 32 bits and shift into the high half).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

static inline float to_float(float x) { return x; }
static inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// q . k over D values, q already fp32.
template <typename T>
static inline float dot(const float* q, const T* k, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; d < D; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// acc += p * v over D values.
template <typename T>
static inline void axpy(float* acc, float p, const T* v, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (; d + 16 <= D; d += 16) _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(acc + d)));
#endif
  for (; d < D; ++d) acc[d] += p * to_float(v[d]);
}

#if defined(__AVX512F__)
// How many keys ahead the loops below ask for: a row's keys are one contiguous run, but a step's
// rows start cold (their K/V were written steps ago), and the hardware prefetcher alone keeps too
// few lines in flight for the two loops' few instructions per key.
static constexpr int64_t kAhead = 16;
template <typename T>
static inline void prefetch_key(const T* p, int64_t D) {
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}
#endif

// The keys (or values) of the job a thread runs next, asked for into L2 while this job runs, a
// share of them at each of its keys: a job's own prefetches start cold at its first key, and its
// run (a few KiB) is too short for the hardware prefetcher to get far ahead on.
template <typename T>
struct NextRun {
  const T* run = nullptr;  // none: this is the thread's last job
  int64_t len = 0;
  int64_t per_key = 0;  // keys of it asked for at each key of this job

  NextRun(const T* r, int64_t n, int64_t this_len) : run(r), len(n), per_key(r ? (n + this_len - 1) / this_len : 0) {}
  void at(int64_t l, int64_t D) const {
    for (int64_t j = l * per_key; j < std::min(len, (l + 1) * per_key); ++j)
      for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(run + j * D) + b, 0, 2);
  }
};

#if defined(__AVX512F__)

// score[g * len + l] = q_g . k_l for the G query heads sharing one K/V head (q fp32, scaled).
// Where D is 16 C values (C up to 8, known when compiled so a key stays in registers), each key is
// widened to fp32 once for all G heads; the sums are the same FMAs in the same order as `dot`'s,
// so either path gives the same scores.
template <int C, typename T>
static void scores_c(const float* qf, const T* k, int64_t len, int64_t G, const NextRun<T>& next, float* score) {
  constexpr int64_t D = 16 * C;
  for (int64_t l = 0; l < len; ++l) {
    if (l + kAhead < len) prefetch_key(k + (l + kAhead) * D, D);
    next.at(l, D);
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load16(k + l * D + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], acc);
      score[g * len + l] = _mm512_reduce_add_ps(acc);
    }
  }
}

// acc[g] = sum_l p[g * len + l] * v_l, each value widened once for all G heads (as `scores_c`),
// the G * C sums held in registers for the whole row (the same FMAs in the same order as the
// loop below that serves other G, which reads and writes them through memory at every key).
template <int C, int G, typename T>
static void weighted_sum_cg(const float* p, const T* v, int64_t len, const NextRun<T>& next, float* acc) {
  constexpr int64_t D = 16 * C;
  __m512 a[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < len; ++l) {
    if (l + kAhead < len) prefetch_key(v + (l + kAhead) * D, D);
    next.at(l, D);
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(v + l * D + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * len + l]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pg, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

// acc[g] += sum_l p[g * len + l] * v_l.
template <int C, typename T>
static void weighted_sum_c(const float* p, const T* v, int64_t len, int64_t G, const NextRun<T>& next, float* acc) {
  switch (G) {
    case 1: return weighted_sum_cg<C, 1>(p, v, len, next, acc);
    case 2: return weighted_sum_cg<C, 2>(p, v, len, next, acc);
    case 3: return weighted_sum_cg<C, 3>(p, v, len, next, acc);
    case 4: return weighted_sum_cg<C, 4>(p, v, len, next, acc);
  }
  constexpr int64_t D = 16 * C;
  for (int64_t l = 0; l < len; ++l) {
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(v + l * D + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * len + l]);
      float* ag = acc + g * D;
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(ag + 16 * c, _mm512_fmadd_ps(pg, vv[c], _mm512_loadu_ps(ag + 16 * c)));
    }
  }
}
#endif

template <typename T>
static void scores(const float* qf, const T* k, int64_t len, int64_t G, int64_t D, const NextRun<T>& next,
                   float* score) {
#if defined(__AVX512F__)
  switch (D) {
    case 32: return scores_c<2>(qf, k, len, G, next, score);
    case 64: return scores_c<4>(qf, k, len, G, next, score);
    case 128: return scores_c<8>(qf, k, len, G, next, score);
  }
#endif
  for (int64_t l = 0; l < len; ++l) {
    next.at(l, D);
    for (int64_t g = 0; g < G; ++g) score[g * len + l] = dot(qf + g * D, k + l * D, D);
  }
}

template <typename T>
static void weighted_sum(const float* p, const T* v, int64_t len, int64_t G, int64_t D, const NextRun<T>& next,
                         float* acc) {
#if defined(__AVX512F__)
  switch (D) {
    case 32: return weighted_sum_c<2>(p, v, len, G, next, acc);
    case 64: return weighted_sum_c<4>(p, v, len, G, next, acc);
    case 128: return weighted_sum_c<8>(p, v, len, G, next, acc);
  }
#endif
  for (int64_t l = 0; l < len; ++l) {
    next.at(l, D);
    for (int64_t g = 0; g < G; ++g) axpy(acc + g * D, p[g * len + l], v + l * D, D);
  }
}

// out[rows[i], h * D:(h + 1) * D] = softmax(q[rows[i], h] . K[slot, kvh, :len]^T * scale) V[slot, kvh, :len]
template <typename T>
static void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                const at::Tensor& slots, const at::Tensor& lengths, double scale, at::Tensor& out) {
  const int64_t n = rows.size(0), H = q.size(1), D = q.size(2);
  const int64_t KV = k.size(1), Lmax = k.size(2), G = H / KV;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, n * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), score;
    // where job j's keys (and values) start: its row's slot, its K/V head
    const auto run_of = [&](int64_t j) { return (sp[j / KV] * KV + j % KV) * Lmax * D; };
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / KV, kvh = job % KV, row = rp[i], len = lp[i];
      const int64_t base = run_of(job);
      const bool last = job + 1 == end;  // else the thread's next job is asked for while this one runs
      const int64_t next_base = last ? 0 : run_of(job + 1), next_len = last ? 0 : lp[(job + 1) / KV];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qp[row * qs0 + (kvh * G + g) * qs1 + d]) * fscale;
      score.resize(G * len);
      scores(qf.data(), kp + base, len, G, D, NextRun<T>(last ? nullptr : kp + next_base, next_len, len), score.data());
      for (int64_t g = 0; g < G; ++g) {
        float* sg = score.data() + g * len;
        float m = sg[0], sum = 0.f;
        for (int64_t l = 1; l < len; ++l) m = std::max(m, sg[l]);
#pragma omp simd
        for (int64_t l = 0; l < len; ++l) sg[l] = std::exp(sg[l] - m);  // vectorized through libmvec
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < len; ++l) sum += sg[l];
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t l = 0; l < len; ++l) sg[l] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      weighted_sum(score.data(), vp + base, len, G, D, NextRun<T>(last ? nullptr : vp + next_base, next_len, len),
                   acc.data());
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) op[row * os0 + (kvh * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

void decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor rows, at::Tensor slots,
                      at::Tensor lengths, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes() && q.size(1) % k.size(1) == 0);
  TORCH_CHECK(q.size(2) == k.size(3) && out.size(1) == q.size(1) * q.size(2));
  TORCH_CHECK(q.stride(2) == 1 && k.is_contiguous() && v.is_contiguous() && out.stride(1) == 1);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
              k.scalar_type() == out.scalar_type());
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
              lengths.scalar_type() == at::kLong);
  TORCH_CHECK(rows.is_contiguous() && slots.is_contiguous() && lengths.is_contiguous());
  TORCH_CHECK(slots.size(0) == rows.size(0) && lengths.size(0) == rows.size(0));
  for (int64_t i = 0; i < rows.size(0); ++i) {  // the kernel reads without bounds checks
    const int64_t r = rows.data_ptr<int64_t>()[i], s = slots.data_ptr<int64_t>()[i], n = lengths.data_ptr<int64_t>()[i];
    TORCH_CHECK(r >= 0 && r < q.size(0) && r < out.size(0), "decode_attention: row ", r, " out of range");
    TORCH_CHECK(s >= 0 && s < k.size(0), "decode_attention: cache row ", s, " out of range");
    TORCH_CHECK(n >= 1 && n <= k.size(2), "decode_attention: ", n, " keys, the cache holds ", k.size(2));
  }
  if (q.scalar_type() == at::kBFloat16) run<at::BFloat16>(q, k, v, rows, slots, lengths, scale, out);
  else if (q.scalar_type() == at::kFloat) run<float>(q, k, v, rows, slots, lengths, scale, out);
  else TORCH_CHECK(false, "decode_attention: float32 or bfloat16, got ", q.scalar_type());
}
