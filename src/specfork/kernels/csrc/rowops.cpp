// Row-wise steps shared by the decoder and the draft head: RMSNorm, the gated activation and
// the rotary embedding. Each output row depends only on its own input row.
#include "rowops.h"

#include <cmath>

#include "vecmath.h"

namespace sf {

namespace {

#if SF_X86
SF_AVX512 void rmsnorm_avx512(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float ss = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) ss = std::fma(x[i], x[i], ss);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m512 s = _mm512_set1_ps(inv);
  for (i = 0; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), s), _mm512_loadu_ps(w + i)));
  for (; i < n; ++i) y[i] = x[i] * inv * w[i];
}

SF_AVX2 void rmsnorm_avx2(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum256(acc);
  for (; i < n; ++i) ss = std::fma(x[i], x[i], ss);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m256 s = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), _mm256_loadu_ps(w + i)));
  for (; i < n; ++i) y[i] = x[i] * inv * w[i];
}

SF_AVX2 void act_avx2(const float* gate, const float* up, int64_t n, bool gelu, float* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 a = gelu ? gelu_tanh256(g) : silu256(g);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(a, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) y[i] = (gelu ? gelu_tanh1(gate[i]) : silu1(gate[i])) * up[i];
}

#endif  // SF_X86

}  // namespace

void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* y) {
#if SF_X86
  if (isa_level() == kAvx512) return rmsnorm_avx512(x, w, n, eps, y);
  if (isa_level() == kAvx2) return rmsnorm_avx2(x, w, n, eps, y);
#endif
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss = std::fma(x[i], x[i], ss);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

namespace {

#if SF_X86
SF_AVX512 void act_avx512(const float* gate, const float* up, int64_t n, bool gelu, float* y) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 a = gelu ? gelu_tanh512(g) : silu512(g);
    _mm512_storeu_ps(y + i, _mm512_mul_ps(a, _mm512_loadu_ps(up + i)));
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    const __m512 a = gelu ? gelu_tanh512(g) : silu512(g);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, up + i)));
  }
}

#endif  // SF_X86

}  // namespace

void activation(const float* gate, const float* up, int64_t n, bool gelu, float* y) {
#if SF_X86
  if (isa_level() == kAvx512) return act_avx512(gate, up, n, gelu, y);
  if (isa_level() == kAvx2) return act_avx2(gate, up, n, gelu, y);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = (gelu ? gelu_tanh1(gate[i]) : silu1(gate[i])) * up[i];
}

void rope_tables(const float* inv, float scaling, const int64_t* pos, int64_t T, int64_t half,
                 std::vector<float>& cos_t, std::vector<float>& sin_t) {
  cos_t.resize(T * half);
  sin_t.resize(T * half);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t i = 0; i < half; ++i) {
      const float f = static_cast<float>(pos[r]) * inv[i];
      cos_t[r * half + i] = std::cos(f) * scaling;
      sin_t[r * half + i] = std::sin(f) * scaling;
    }
}

void rope_rows(float* x, int64_t ld, int64_t r0, int64_t r1, int64_t nheads, int64_t head_dim,
               const std::vector<float>& cos_t, const std::vector<float>& sin_t) {
  const int64_t half = head_dim / 2;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t h = 0; h < nheads; ++h) {
      float* v = x + r * ld + h * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float c = cos_t[r * half + i], s = sin_t[r * half + i];
        const float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
      }
    }
}

}  // namespace sf
