// x @ W.T for W stored as ggml-style blocks of 32 weights along K, each output's row of blocks
// split into its blocks' fp16 scales, then (Q4_1) their fp16 minimums, then their codes:
//   Q4_1 (20 bytes a block): weight = d * code + m; 16 code bytes a block, whose low nibbles are
//                            weights 0..15 and high nibbles 16..31 (ggml's order)
//   Q8_0 (34 bytes a block): weight = d * code, 32 int8 codes a block
// The scales lie together so that eight convert in one instruction instead of one each.
// x is rounded per block of 32 to int8 with its own scale (as llama.cpp does on the CPU), so each
// block's dot product is an integer one: on AVX2, 32 byte products summed in three instructions.
// Each weight block is read once per 4 rows of x and multiplied into each of them (8 rows' sums
// and the operands no longer fit AVX2's 16 vector registers), and the weights are walked in
// tiles of columns small enough to stay in cache while every row group of x passes over them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QB_AVX2 1
#endif

namespace {

constexpr int64_t QK = 32;
constexpr int64_t ROWS = 4;         // rows of x per pass over a tile of weights
constexpr int64_t TILE_BYTES = 32 << 10;  // weight bytes of a tile of columns (a core's L1 holds it)
constexpr int64_t SMALL = 8;         // up to this many rows, each thread rounds x itself
// From this many rows the integer products cost more than reading the weights: a tile of columns
// is widened to fp32 in cache and multiplied by torch's fp32 GEMM, x unrounded.
constexpr int64_t WIDEN_ROWS = 48;
constexpr int64_t WIDE_TILE_BYTES = 192 << 10;  // fp32 bytes of a widened tile (in L2)

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef QB_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// blocks [begin, end) of x (float, blocks of 32 in row order) -> int8 codes and per block: the
// scale, and scale * sum(codes); codes round half to even (AVX2 and portable paths alike)
void quantize_rows(const float* x, int64_t begin, int64_t end, int8_t* q, float* d, float* s) {
  for (int64_t i = begin; i < end; ++i) {
    const float* v = x + i * QK;
#ifdef QB_AVX2
    __m256 f[4];
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      f[j] = _mm256_loadu_ps(v + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(_mm256_set1_ps(-0.f), f[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i c[4];
    for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(f[j], inv));  // to nearest even
    const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const int sum = _mm_cvtsi128_si32(s4);
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * QK),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float amax = 0.f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
      const int c = static_cast<int>(std::nearbyint(v[j] * inv));
      q[i * QK + j] = static_cast<int8_t>(c);
      sum += c;
    }
#endif
    const float scale = amax / 127.f;
    d[i] = scale;
    s[i] = scale * static_cast<float>(sum);
  }
}

#ifdef QB_AVX2
inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// sum of u8 * s8 products of 32 lanes, as 8 floats
inline __m256 dot32(__m256i u, __m256i s) {
  const __m256i p16 = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
#endif

constexpr int64_t CHUNK = 32;  // blocks whose scales are worked out before their dot products

// one output column over `Rows` rows of x (a template argument, so the accumulators stay in registers)
template <bool Q4, int Rows>
void rows_of_w(const uint8_t* w, int64_t nb, const int8_t* xq, const float* xd, const float* xs,
               float* out, int64_t ldo) {
  const uint8_t* dh = w;                           // nb fp16 scales
  const uint8_t* mh = w + 2 * nb;                  // Q4_1: nb fp16 minimums
  const uint8_t* qs = w + (Q4 ? 4 : 2) * nb;       // the codes, 16 (Q4_1) or 32 (Q8_0) bytes a block
  constexpr int64_t qbytes = Q4 ? 16 : 32;
  float mins[Rows];
  for (int r = 0; r < Rows; ++r) mins[r] = 0.f;
#ifdef QB_AVX2
  __m256 acc[Rows], macc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
  alignas(32) float sc[Rows][CHUNK];  // the weight's scale times x's, per row and block
  for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {
    const int64_t n = std::min(CHUNK, nb - b0);
    int64_t b = 0;
    for (; b + 8 <= n; b += 8) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + 2 * (b0 + b))));
      for (int r = 0; r < Rows; ++r)
        _mm256_store_ps(sc[r] + b, _mm256_mul_ps(d, _mm256_loadu_ps(xd + r * nb + b0 + b)));
      if (Q4) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mh + 2 * (b0 + b))));
        for (int r = 0; r < Rows; ++r)
          macc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs + r * nb + b0 + b), macc[r]);
      }
    }
    for (; b < n; ++b) {
      const float d = half_to_float(dh + 2 * (b0 + b));
      const float m = Q4 ? half_to_float(mh + 2 * (b0 + b)) : 0.f;
      for (int r = 0; r < Rows; ++r) {
        sc[r][b] = d * xd[r * nb + b0 + b];
        mins[r] += m * xs[r * nb + b0 + b];
      }
    }
    for (b = 0; b < n; ++b) {
      const int64_t blk = b0 + b;
      const uint8_t* q = qs + blk * qbytes;
      if (Q4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
        for (int r = 0; r < Rows; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (r * nb + blk) * QK));
          acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc[r] + b), dot32(codes, xv), acc[r]);
        }
      } else {
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        const __m256i mag = _mm256_sign_epi8(codes, codes);
        for (int r = 0; r < Rows; ++r) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (r * nb + blk) * QK));
          acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc[r] + b), dot32(mag, _mm256_sign_epi8(xv, codes)), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < Rows; ++r) out[r * ldo] = hsum(acc[r]) + hsum(macc[r]) + mins[r];
#else
  float acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const float dw = half_to_float(dh + 2 * b);
    const float mw = Q4 ? half_to_float(mh + 2 * b) : 0.f;
    const uint8_t* q = qs + b * qbytes;
    for (int r = 0; r < Rows; ++r) {
      const int64_t i = r * nb + b;
      const int8_t* xv = xq + i * QK;
      int sum = 0;
      if (Q4) {
        for (int j = 0; j < 16; ++j) sum += (q[j] & 0x0F) * xv[j] + (q[j] >> 4) * xv[j + 16];
      } else {
        for (int j = 0; j < QK; ++j) sum += static_cast<int8_t>(q[j]) * xv[j];
      }
      acc[r] += dw * xd[i] * static_cast<float>(sum) + mw * xs[i];
    }
  }
  for (int r = 0; r < Rows; ++r) out[r * ldo] = acc[r] + mins[r];
#endif
}

// columns [j0, j1) of the weight as fp32 rows of k into `out`
void widen(const uint8_t* w, int64_t nb, bool q4, int64_t j0, int64_t j1, float* out) {
  const int64_t bsize = q4 ? 20 : 34, k = nb * QK;
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* row = w + j * nb * bsize;
    const uint8_t* qs = row + (q4 ? 4 : 2) * nb;
    float* o = out + (j - j0) * k;
    for (int64_t b = 0; b < nb; ++b) {
      const float d = half_to_float(row + 2 * b);
      const float mn = q4 ? half_to_float(row + 2 * nb + 2 * b) : 0.f;
      float* ob = o + b * QK;
#ifdef QB_AVX2
      const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(mn);
      __m128i lo, hi;  // the 32 codes as bytes, weights 0..15 and 16..31
      if (q4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
        lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
        hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
      } else {
        lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 32));
        hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 32 + 16));
      }
      const __m128i parts[2] = {lo, hi};
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 2; ++e) {
          const __m128i eight = e ? _mm_srli_si128(parts[h], 8) : parts[h];
          const __m256i i32 = q4 ? _mm256_cvtepu8_epi32(eight) : _mm256_cvtepi8_epi32(eight);
          _mm256_storeu_ps(ob + 16 * h + 8 * e, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), dv, mv));
        }
#else
      for (int i = 0; i < QK; ++i) {
        const int c = q4 ? ((i < 16 ? qs[b * 16 + i] : qs[b * 16 + i - 16] >> 4) & 0x0F)
                         : static_cast<int8_t>(qs[b * 32 + i]);
        ob[i] = d * static_cast<float>(c) + mn;
      }
#endif
    }
  }
}

// x @ W.T by fp32 GEMMs over widened tiles of W's columns, each written into its columns of out
void widened_linear(const at::Tensor& x, const uint8_t* w, int64_t nb, bool q4, int64_t n, at::Tensor& out) {
  const int64_t k = nb * QK;
  // the GEMM re-packs x on every call, so the more rows, the wider a tile (fewer calls); a
  // multiple of the threads in tiles, so that they end together
  const int64_t threads = at::get_num_threads();
  const int64_t per_tile = WIDE_TILE_BYTES * std::max<int64_t>(1, x.size(0) / 64);
  const int64_t rounds = std::max<int64_t>(1, (4 * k * n + threads * per_tile - 1) / (threads * per_tile));
  const int64_t tile = (n + threads * rounds - 1) / (threads * rounds);
  const int64_t tiles = (n + tile - 1) / tile;
  const bool inference = c10::InferenceMode::is_enabled();  // the pool's threads do not inherit it
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::optional<c10::InferenceMode> mode;
    if (inference) mode.emplace();
    thread_local std::vector<float> buf;
    buf.resize(tile * k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = t * tile, j1 = std::min(n, j0 + tile);
      widen(w, nb, q4, j0, j1, buf.data());
      const at::Tensor wt = at::from_blob(buf.data(), {j1 - j0, k}, x.options());
      at::Tensor dst = out.narrow(1, j0, j1 - j0);
      at::mm_out(dst, x, wt.t());
    }
  });
}

using Kernel = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const float*, float*, int64_t);

template <bool Q4>
Kernel kernels(int64_t rows) {
  static constexpr Kernel table[ROWS] = {rows_of_w<Q4, 1>, rows_of_w<Q4, 2>, rows_of_w<Q4, 3>, rows_of_w<Q4, 4>};
  return table[rows - 1];
}

at::Tensor qblock_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "qblock_linear: bits must be 4 (Q4_1) or 8 (Q8_0), got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qblock_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "qblock_linear: blocks must be a contiguous 2-D uint8 tensor");
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), nb = k / QK;
  const int64_t bsize = bits == 4 ? 20 : 34;
  TORCH_CHECK(k % QK == 0 && blocks.size(1) == nb * bsize, "qblock_linear: x has ", k,
              " columns, which the weight's blocks of ", blocks.size(1), " bytes a row do not match");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const float* xf = xc.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t tile = std::max<int64_t>(1, TILE_BYTES / (nb * bsize));
  const auto columns = [&](int64_t begin, int64_t end, const int8_t* xq, const float* xd, const float* xs) {
    for (int64_t j0 = begin; j0 < end; j0 += tile) {
      const int64_t j1 = std::min(end, j0 + tile);
      for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        const int64_t rows = std::min(ROWS, m - r0);
        const int64_t off = r0 * nb;
        const auto kernel = bits == 4 ? kernels<true>(rows) : kernels<false>(rows);
        for (int64_t j = j0; j < j1; ++j)
          kernel(w + j * nb * bsize, nb, xq + off * QK, xd + off, xs + off, o + r0 * n + j, n);
      }
    }
  };
  if (m >= WIDEN_ROWS) {
    widened_linear(xc.detach(), w, nb, bits == 4, n, out);  // the op has no gradient, as below
    return out;
  }
  if (m <= SMALL) {  // a few rows: each thread rounds x itself, one parallel region instead of two
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      thread_local std::vector<int8_t> xq;
      thread_local std::vector<float> xd, xs;
      xq.resize(m * k), xd.resize(m * nb), xs.resize(m * nb);
      quantize_rows(xf, 0, m * nb, xq.data(), xd.data(), xs.data());
      columns(begin, end, xq.data(), xd.data(), xs.data());
    });
    return out;
  }
  std::vector<int8_t> xq(m * k);
  std::vector<float> xd(m * nb), xs(m * nb);
  at::parallel_for(0, m * nb, 64, [&](int64_t begin, int64_t end) {
    quantize_rows(xf, begin, end, xq.data(), xd.data(), xs.data());
  });
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    columns(begin, end, xq.data(), xd.data(), xs.data());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tidal, m) { m.def("qblock_linear(Tensor x, Tensor blocks, int bits) -> Tensor"); }

TORCH_LIBRARY_IMPL(tidal, CPU, m) { m.impl("qblock_linear", qblock_linear); }
