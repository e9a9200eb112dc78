// Attention of a few queries per sequence over its keys, read from the paged KV cache by slot
// (decode and draft verification): out[b, h, r] = softmax_j(q[b, h, r] . k[slot[b, j], h] * scale,
// over the keys j that mask[b, 0, r % Q, j] allows) . v[slot[b, j], h].
// One task per (sequence, KV head); each key and value row is read once for all the queries of
// its KV head. torch's SDPA serves these shapes with its flash kernel, whose fixed cost per call
// is most of a decode step's attention; long queries (prefill) stay with it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TA_AVX2 1
#endif

namespace {

inline float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  float s = 0.f;
#ifdef TA_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  s = _mm_cvtss_f32(r);
#endif
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& kv_slots, const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat, "paged_attention: q must be float32 [B, H, R, D]");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3);
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(1) == H &&
                  k_cache.size(2) == D && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: the caches must be contiguous float32 [slots, ", H, ", ", D, "]");
  TORCH_CHECK(kv_slots.dim() == 2 && kv_slots.size(0) == B && kv_slots.scalar_type() == at::kLong,
              "paged_attention: kv_slots must be int64 [B, K]");
  const int64_t K = kv_slots.size(1), S = k_cache.size(0);
  TORCH_CHECK(mask.dim() == 4 && mask.size(0) == B && mask.size(1) == 1 && mask.size(3) == K &&
                  mask.scalar_type() == at::kBool && mask.size(2) > 0 && R % mask.size(2) == 0,
              "paged_attention: mask must be bool [B, 1, Q, K] with R a multiple of Q");
  const int64_t Q = mask.size(2);
  const at::Tensor qc = q.contiguous(), slots = kv_slots.contiguous(), mc = mask.contiguous();
  at::Tensor out = at::empty({B, H, R, D}, q.options());
  const float *qp = qc.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* mp = mc.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> p;
    p.resize(R * K);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const float* qb = qp + task * R * D;
      float* ob = op + task * R * D;
      const int64_t* sb = sp + b * K;
      const bool* mb = mp + b * Q * K;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t slot = sb[j];
        TORCH_CHECK(slot >= 0 && slot < S, "paged_attention: slot ", slot, " outside the cache's ", S);
        const float* kr = kp + (slot * H + h) * D;
        for (int64_t r = 0; r < R; ++r)
          p[r * K + j] = mb[(r % Q) * K + j] ? dot(qb + r * D, kr, D) * static_cast<float>(scale) : ninf;
      }
      for (int64_t r = 0; r < R; ++r) {
        float* pr = p.data() + r * K;
        const float mx = *std::max_element(pr, pr + K);
        float sum = 0.f;
        for (int64_t j = 0; j < K; ++j) sum += (pr[j] = mx == ninf ? 0.f : std::exp(pr[j] - mx));
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t j = 0; j < K; ++j) pr[j] *= inv;
      }
      std::fill(ob, ob + R * D, 0.f);
      for (int64_t j = 0; j < K; ++j) {
        const float* vr = vp + (sb[j] * H + h) * D;
        for (int64_t r = 0; r < R; ++r) {
          const float w = p[r * K + j];
          if (w == 0.f) continue;
          float* o = ob + r * D;
          for (int64_t i = 0; i < D; ++i) o[i] += w * vr[i];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_slots, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tidal, CPU, m) { m.impl("paged_attention", paged_attention); }
