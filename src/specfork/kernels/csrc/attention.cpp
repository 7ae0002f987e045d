#include "attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"
#include "vecmath.h"

namespace sf {

static inline float load1(const void* base, CacheType type, int64_t i) {
  switch (type) {
    case CacheType::F32: return static_cast<const float*>(base)[i];
    case CacheType::F16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case CacheType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.f;
}

static inline void store1(void* base, CacheType type, int64_t i, float x) {
  switch (type) {
    case CacheType::F32: static_cast<float*>(base)[i] = x; break;
    case CacheType::F16: static_cast<uint16_t*>(base)[i] = f32_to_f16(x); break;
    case CacheType::BF16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(x); break;
  }
}

void write_kv(const KVView& kv, const float* k, const float* v, int64_t ld, int64_t rows,
              int64_t heads_kv, int64_t head_dim, int64_t start) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < heads_kv; ++g)
      for (int64_t d = 0; d < head_dim; ++d) {
        const int64_t at = (g * kv.slots + start + r) * head_dim + d;
        store1(kv.k, kv.type, at, k[r * ld + g * head_dim + d]);
        store1(kv.v, kv.type, at, v[r * ld + g * head_dim + d]);
      }
}

// -- generic ---------------------------------------------------------------------------------

static void head_generic(const float* q, const KVView& kv, const int32_t* idx, int64_t n,
                         int64_t g, const AttnShape& s, float* scores, float* out) {
  const int64_t D = s.head_dim;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t base = (g * kv.slots + idx[j]) * D;
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot = std::fma(q[d], load1(kv.k, kv.type, base + d), dot);
    scores[j] = dot * s.scale;
    top = std::max(top, scores[j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - top);
    sum += scores[j];
  }
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t base = (g * kv.slots + idx[j]) * D;
    for (int64_t d = 0; d < D; ++d) out[d] = std::fma(scores[j], load1(kv.v, kv.type, base + d), out[d]);
  }
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

// -- AVX-512 (head_dim a multiple of 16, at most 256) -----------------------------------------

template <CacheType T>
SF_AVX512 static inline __m512 load16(const void* base, int64_t i) {
  if constexpr (T == CacheType::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else if constexpr (T == CacheType::F16) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i)));
  } else {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <CacheType T>
SF_AVX512 static void head_avx512(const float* q, const KVView& kv, const int32_t* idx, int64_t n,
                                  int64_t g, const AttnShape& s, float* scores, float* out) {
  const int64_t D = s.head_dim, chunks = D / 16;
  __m512 qv[16];
  for (int64_t c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t base = (g * kv.slots + idx[j]) * D;
    __m512 acc = _mm512_mul_ps(qv[0], load16<T>(kv.k, base));
    for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qv[c], load16<T>(kv.k, base + 16 * c), acc);
    scores[j] = _mm512_reduce_add_ps(acc) * s.scale;
    top = std::max(top, scores[j]);
  }
  const __m512 m = _mm512_set1_ps(top);
  __m512 sums = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + j), m));
    _mm512_mask_storeu_ps(scores + j, lanes, e);
    sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(lanes, e));
  }
  const float inv = 1.f / _mm512_reduce_add_ps(sums);
  __m512 acc[16];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t base = (g * kv.slots + idx[j]) * D;
    const __m512 p = _mm512_set1_ps(scores[j]);
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(p, load16<T>(kv.v, base + 16 * c), acc[c]);
  }
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
}

void attention(const float* q, int64_t ldq, const KVView& kv, const Visible& vis,
               const AttnShape& s, float* out) {
  const int64_t group = s.heads / s.heads_kv, D = s.head_dim;
  const bool vec = isa_level() == kAvx512 && D % 16 == 0 && D <= 256;
  int64_t longest = 0;
  for (int64_t r = 0; r < s.rows; ++r) longest = std::max(longest, vis.off[r + 1] - vis.off[r]);
  parallel(s.rows * s.heads, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(longest + 16);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / s.heads, h = item % s.heads, g = h / group;
      const int32_t* idx = vis.idx.data() + vis.off[r];
      const int64_t n = vis.off[r + 1] - vis.off[r];
      const float* qh = q + r * ldq + h * D;
      float* o = out + (r * s.heads + h) * D;
      if (!vec) {
        head_generic(qh, kv, idx, n, g, s, scores.data(), o);
      } else if (kv.type == CacheType::F16) {
        head_avx512<CacheType::F16>(qh, kv, idx, n, g, s, scores.data(), o);
      } else if (kv.type == CacheType::BF16) {
        head_avx512<CacheType::BF16>(qh, kv, idx, n, g, s, scores.data(), o);
      } else {
        head_avx512<CacheType::F32>(qh, kv, idx, n, g, s, scores.data(), o);
      }
    }
  });
}

}  // namespace sf
