#include "gemm.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "common.h"

namespace sf {

int64_t block_bytes(Kind kind) {
  switch (kind) {
    case Kind::Q4: return 320;
    case Kind::Q8: return 544;
    case Kind::BF16: return 1024;
    case Kind::F32: return 2048;
    case Kind::Q4F: return 384;
    case Kind::Q8H: return 640;
    case Kind::Q8A: return 640;
  }
  throw std::invalid_argument("unknown weight kind");
}

Activations::Activations(const float* x_, int64_t rows_, int64_t k_, int64_t ld_)
    : x(x_), rows(rows_), k(k_), ld(ld_) {}

// -- activation forms ----------------------------------------------------------------------------

static void quantize_block(const float* x, int8_t* q, float* d, float* ds, int32_t* s) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.f;
  const float inv = scale != 0.f ? 1.f / scale : 0.f;
  int32_t sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    float v = std::nearbyint(x[i] * inv);
    v = std::min(127.f, std::max(-127.f, v));
    q[i] = static_cast<int8_t>(v);
    sum += q[i];
  }
  *d = scale;
  *s = sum;
  *ds = scale * static_cast<float>(sum);
}

#if SF_X86
SF_AVX512 static inline __m512i codes16(__m512 v, __m512 inv) {
  v = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(v, _mm512_set1_ps(127.f)), _mm512_set1_ps(-127.f)));
}

// The same arithmetic as quantize_block, 32 inputs at a time (bitwise the same results).
SF_AVX512 static void quantize_block_avx512(const float* x, int8_t* q, float* d, float* ds,
                                            int32_t* s) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float scale = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(scale != 0.f ? 1.f / scale : 0.f);
  const __m512i a = codes16(lo, inv), b = codes16(hi, inv);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(b));
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
  *d = scale;
  *s = sum;
  *ds = scale * static_cast<float>(sum);
}

SF_AVX512 static void to_bf16_avx512(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // round to nearest even, like f32_to_bf16 (finite values)
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(x + i));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i), _CMP_UNORD_Q);
    const __m512i v = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
  }
  for (; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

// The same arithmetic as quantize_block, 8 inputs at a time (bitwise the same results).
SF_AVX2 static void quantize_block_avx2(const float* x, int8_t* q, float* d, float* ds,
                                        int32_t* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top = _mm256_setzero_ps();
  for (int i = 0; i < kBlock; i += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float scale = _mm_cvtss_f32(m) / 127.f;
  const __m256 inv = _mm256_set1_ps(scale != 0.f ? 1.f / scale : 0.f);
  alignas(32) int32_t codes[kBlock];
  for (int i = 0; i < kBlock; i += 8) {
    __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_max_ps(_mm256_min_ps(v, _mm256_set1_ps(127.f)), _mm256_set1_ps(-127.f));
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes + i), _mm256_cvtps_epi32(v));
  }
  int32_t sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    q[i] = static_cast<int8_t>(codes[i]);
    sum += codes[i];
  }
  *d = scale;
  *s = sum;
  *ds = scale * static_cast<float>(sum);
}

#endif  // SF_X86

// quantize_block with the widest code this CPU runs (all give the same bits).
static void quantize_any(int isa, const float* x, int8_t* q, float* d, float* ds, int32_t* s) {
#if SF_X86
  if (isa == kAvx512) return quantize_block_avx512(x, q, d, ds, s);
  if (isa == kAvx2) return quantize_block_avx2(x, q, d, ds, s);
#endif
  (void)isa;
  quantize_block(x, q, d, ds, s);
}

void Activations::need(Kind kind) {
  const int isa = isa_level();
  if (int8_kind(kind) && !have_q_) {
    const int64_t nb = k / kBlock;
    q.resize(rows * k);
    d.resize(rows * nb);
    ds.resize(rows * nb);
    s.resize(rows * nb);
    auto quantize_rows = [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nb; ++b) {
          const float* in = x + r * ld + b * kBlock;
          const int64_t at = r * nb + b;
          quantize_any(isa, in, &q[r * k + b * kBlock], &d[at], &ds[at], &s[at]);
        }
    };
    if (rows * nb >= 256)  // large inputs (prefill) are worth the threads
      parallel(rows, quantize_rows);
    else
      quantize_rows(0, rows);
    have_q_ = true;
  }
  if (kind == Kind::Q8H && !have_s16_) {
    s16.resize(rows * k / 16);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < k / 16; ++h) {
        int32_t sum = 0;
        for (int j = 0; j < 16; ++j) sum += q[r * k + 16 * h + j];
        s16[r * (k / 16) + h] = sum;
      }
    have_s16_ = true;
  }
  if (kind == Kind::BF16 && !have_bf_) {
    bf.resize(rows * k);
    for (int64_t r = 0; r < rows; ++r) {
#if SF_X86
      if (isa == kAvx512) {
        to_bf16_avx512(x + r * ld, &bf[r * k], k);
        continue;
      }
#endif
      for (int64_t i = 0; i < k; ++i) bf[r * k + i] = f32_to_bf16(x[r * ld + i]);
    }
    have_bf_ = true;
  }
}

// -- generic kernels (any CPU; same arithmetic as the vector kernels for Q4, Q8 and F32) ---------

// Code j of column c in a block of Q4/Q4F nibbles or byte codes (Q8/Q8H store q+128).
static int32_t code_at(Kind kind, const uint8_t* p, int c, int j) {
  if (q4_layout(kind)) {
    const int g = j / 4;
    const uint8_t byte = p[64 * (g / 2) + 4 * c + j % 4];
    return g % 2 == 0 ? (byte & 0x0f) : (byte >> 4);
  }
  return p[64 * (j / 4) + 4 * c + j % 4];
}

// Column c's scale (which = 0) or min (1) of a Q4/Q4F/Q8A block (fp16 for Q4, else float32).
static float q4_scale(Kind kind, const uint8_t* p, int c, int which) {
  const uint8_t* at = p + scales_at(kind);
  if (kind == Kind::Q4) return f16_to_f32(reinterpret_cast<const uint16_t*>(at)[16 * which + c]);
  return reinterpret_cast<const float*>(at)[16 * which + c];
}

// The integer sum of codes j0..j1-1 of column c times the row's int8 activations.
static int32_t int_sum(Kind kind, const uint8_t* p, const int8_t* xq, int c, int j0, int j1) {
  int32_t isum = 0;
  for (int j = j0; j < j1; ++j) isum += code_at(kind, p, c, j) * xq[j];
  return isum;
}

static void tile_generic(const PackedLinear& w, const Activations& a, int64_t tile, int64_t r,
                         float acc[kTile]) {
  const int64_t nb = w.k / kBlock, bytes = block_bytes(w.kind);
  const uint8_t* base = w.data + tile * nb * bytes;
  for (int c = 0; c < kTile; ++c) acc[c] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = base + b * bytes;
    const int64_t at = r * nb + b;
    if (affine(w.kind)) {
      const int8_t* xq = &a.q[r * w.k + b * kBlock];
      for (int c = 0; c < kTile; ++c) {
        const float scale = q4_scale(w.kind, p, c, 0) * a.d[at];
        acc[c] = std::fma(static_cast<float>(int_sum(w.kind, p, xq, c, 0, kBlock)), scale, acc[c]);
        acc[c] = std::fma(q4_scale(w.kind, p, c, 1), a.ds[at], acc[c]);
      }
    } else if (w.kind == Kind::Q8) {
      const int8_t* xq = &a.q[r * w.k + b * kBlock];
      const uint16_t* dw = reinterpret_cast<const uint16_t*>(p + 512);
      for (int c = 0; c < kTile; ++c) {
        const int32_t isum = int_sum(w.kind, p, xq, c, 0, kBlock) - 128 * a.s[at];
        acc[c] = std::fma(static_cast<float>(isum), f16_to_f32(dw[c]) * a.d[at], acc[c]);
      }
    } else if (w.kind == Kind::Q8H) {
      const int8_t* xq = &a.q[r * w.k + b * kBlock];
      const float* dw = reinterpret_cast<const float*>(p + 512);  // [2 halves][16 columns]
      for (int c = 0; c < kTile; ++c)
        for (int h = 0; h < 2; ++h) {
          const int32_t isum = int_sum(w.kind, p, xq, c, 16 * h, 16 * h + 16) - 128 * a.s16[2 * at + h];
          acc[c] = std::fma(static_cast<float>(isum), dw[16 * h + c] * a.d[at], acc[c]);
        }
    } else if (w.kind == Kind::BF16) {
      const uint16_t* wv = reinterpret_cast<const uint16_t*>(p);
      const uint16_t* xb = &a.bf[r * w.k + b * kBlock];
      for (int pr = 0; pr < kBlock / 2; ++pr)
        for (int c = 0; c < kTile; ++c) {
          acc[c] = std::fma(bf16_to_f32(wv[32 * pr + 2 * c + 1]), bf16_to_f32(xb[2 * pr + 1]), acc[c]);
          acc[c] = std::fma(bf16_to_f32(wv[32 * pr + 2 * c]), bf16_to_f32(xb[2 * pr]), acc[c]);
        }
    } else {
      const float* wv = reinterpret_cast<const float*>(p);
      const float* x = a.x + r * a.ld + b * kBlock;
      for (int i = 0; i < kBlock; ++i)
        for (int c = 0; c < kTile; ++c) acc[c] = std::fma(wv[16 * i + c], x[i], acc[c]);
    }
  }
}

#if SF_X86
// -- AVX-512 kernels -----------------------------------------------------------------------------

// Integer dot products of one block for RT rows, 4 inputs per product. Up to 5 rows keep two
// partial sums per row (even and odd groups) so that at least 2*RT independent chains keep the
// unit busy; from 6 rows the rows alone give enough chains, and one sum per row leaves the
// registers for the weights. The integer sums are exact, so neither choice changes the result.
template <int RT>
SF_AVX512 static inline void dot_block(const __m512i* w, const Activations& a, int64_t r0,
                                       int64_t at, __m512i* s) {
  const int32_t* x4[RT];
  for (int r = 0; r < RT; ++r) x4[r] = reinterpret_cast<const int32_t*>(&a.q[(r0 + r) * a.k + at]);
  if constexpr (RT >= 6) {
    for (int r = 0; r < RT; ++r) s[r] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g)
      for (int r = 0; r < RT; ++r) s[r] = _mm512_dpbusd_epi32(s[r], w[g], _mm512_set1_epi32(x4[r][g]));
  } else {
    __m512i even[RT], odd[RT];
    for (int r = 0; r < RT; ++r) even[r] = odd[r] = _mm512_setzero_si512();
    for (int g = 0; g < 8; g += 2)
      for (int r = 0; r < RT; ++r) {
        even[r] = _mm512_dpbusd_epi32(even[r], w[g], _mm512_set1_epi32(x4[r][g]));
        odd[r] = _mm512_dpbusd_epi32(odd[r], w[g + 1], _mm512_set1_epi32(x4[r][g + 1]));
      }
    for (int r = 0; r < RT; ++r) s[r] = _mm512_add_epi32(even[r], odd[r]);
  }
}

// The hardware prefetcher falls behind the passes and the weights' loads stall them: every block
// asks for the bytes kAhead further on (the next tiles' blocks follow in memory). Measured best
// on two Zen 4 cores: 8-16 row forwards 9-14% faster, fewer rows no faster there; on two
// Sapphire Rapids cores one-row steps of SmolLM2's Q4_1/Q8_0 forward took 0.7x the time
// (docs/benchmarks.md). A prefetch changes no result and never faults, past the end of the
// weights included.
constexpr int64_t kAhead = 6144;

SF_AVX512 static inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + at), _MM_HINT_T1);
}

// Column scales of a block, 16 of them at `at`: fp16 (Q4, Q8) or float32 (Q4F, Q8H).
template <bool F32>
SF_AVX512 static inline __m512 scales16(const uint8_t* at) {
  if constexpr (F32) return _mm512_loadu_ps(at);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// value d*q + m: Q4 (nibbles, fp16 d and m), Q4F (nibbles, float32) and Q8A (byte codes in
// Q8's layout, float32): w[g] holds inputs 4g..4g+3 of every column either way.
template <int RT, Kind KIND>
SF_AVX512 static void affine_avx512(const uint8_t* wt, int64_t nb, const Activations& a,
                                    int64_t r0, __m512* acc) {
  constexpr bool f32 = KIND != Kind::Q4, nibbles = q4_layout(KIND);
  constexpr int64_t bytes = KIND == Kind::Q4 ? 320 : KIND == Kind::Q4F ? 384 : 640;
  constexpr int64_t at_d = nibbles ? 256 : 512, at_m = at_d + (f32 ? 64 : 32);
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = wt + b * bytes;
    prefetch_block(p, bytes);
    __m512i w[8], s[RT];
    if constexpr (nibbles) {
      for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512(p + 64 * i);
        w[2 * i] = _mm512_and_si512(v, low);
        w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(p + 64 * g);
    }
    dot_block<RT>(w, a, r0, b * kBlock, s);
    const __m512 d = scales16<f32>(p + at_d), m = scales16<f32>(p + at_m);
    for (int r = 0; r < RT; ++r) {
      const int64_t at = (r0 + r) * nb + b;
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.d[at]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.ds[at]), acc[r]);
    }
  }
}

template <int RT>
SF_AVX512 static void q8_avx512(const uint8_t* wt, int64_t nb, const Activations& a, int64_t r0,
                                __m512* acc) {
  for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = wt + b * 544;
    prefetch_block(p, 544);
    __m512i w[8], s[RT];
    for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(p + 64 * g);
    dot_block<RT>(w, a, r0, b * kBlock, s);
    const __m512 d = scales16<false>(p + 512);
    for (int r = 0; r < RT; ++r) {
      const int64_t at = (r0 + r) * nb + b;
      const __m512i fixed = _mm512_sub_epi32(s[r], _mm512_set1_epi32(128 * a.s[at]));
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.d[at]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fixed), scale, acc[r]);
    }
  }
}

// Q8H: Q8's codes with a float32 scale per half block; each half's integer sums are scaled on
// their own, the first half's before the second's. The halves run one after the other, so a
// pass keeps RT sums and 4 weight vectors in registers (not 2 x RT sums and 8 vectors).
template <int RT>
SF_AVX512 static void q8h_avx512(const uint8_t* wt, int64_t nb, const Activations& a, int64_t r0,
                                 __m512* acc) {
  for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = wt + b * 640;
    prefetch_block(p, 640);
    const int32_t* x4[RT];  // each row's activations of the block, 4 at a time
    for (int r = 0; r < RT; ++r) x4[r] = reinterpret_cast<const int32_t*>(&a.q[(r0 + r) * a.k + b * kBlock]);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m512i w[4], s[RT];
      for (int g = 0; g < 4; ++g) w[g] = _mm512_loadu_si512(p + 64 * (4 * h + g));
      for (int r = 0; r < RT; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g)
        for (int r = 0; r < RT; ++r)
          s[r] = _mm512_dpbusd_epi32(s[r], w[g], _mm512_set1_epi32(x4[r][4 * h + g]));
      const __m512 d = scales16<true>(p + 512 + 64 * h);
      for (int r = 0; r < RT; ++r) {
        const int64_t at = (r0 + r) * nb + b;
        const __m512i fixed = _mm512_sub_epi32(s[r], _mm512_set1_epi32(128 * a.s16[2 * at + h]));
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.d[at]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fixed), scale, acc[r]);
      }
    }
  }
}

template <int RT>
SF_AVX512 static void f32_avx512(const uint8_t* wt, int64_t nb, const Activations& a, int64_t r0,
                                 __m512* acc) {
  for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const float* p = reinterpret_cast<const float*>(wt + b * 2048);
    for (int i = 0; i < kBlock; ++i) {
      const __m512 wv = _mm512_loadu_ps(p + 16 * i);
      for (int r = 0; r < RT; ++r)
        acc[r] = _mm512_fmadd_ps(wv, _mm512_set1_ps(a.x[(r0 + r) * a.ld + b * kBlock + i]), acc[r]);
    }
  }
}

template <int RT>
SF_AVX512 static void bf16_avx512(const uint8_t* wt, int64_t nb, const Activations& a, int64_t r0,
                                  __m512* acc) {  // without native bf16 dot products
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = wt + b * 1024;
    for (int pr = 0; pr < kBlock / 2; ++pr) {
      const __m512i wv = _mm512_loadu_si512(p + 64 * pr);
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(wv, high));
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
      for (int r = 0; r < RT; ++r) {
        const uint16_t* xb = &a.bf[(r0 + r) * a.k + b * kBlock + 2 * pr];
        acc[r] = _mm512_fmadd_ps(odd, _mm512_set1_ps(bf16_to_f32(xb[1])), acc[r]);
        acc[r] = _mm512_fmadd_ps(even, _mm512_set1_ps(bf16_to_f32(xb[0])), acc[r]);
      }
    }
  }
}

template <int RT>
SF_AVX512BF16 static void bf16_native(const uint8_t* wt, int64_t nb, const Activations& a,
                                      int64_t r0, __m512* acc) {
  for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = wt + b * 1024;
    for (int pr = 0; pr < kBlock / 2; ++pr) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(p + 64 * pr);
      for (int r = 0; r < RT; ++r) {
        int32_t two;
        std::memcpy(&two, &a.bf[(r0 + r) * a.k + b * kBlock + 2 * pr], 4);
        acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_set1_epi32(two));
      }
    }
  }
}

// y[r0 + r, tile's columns] = acc[r] + bias for rows r < rt (the columns past n left alone).
SF_AVX512 static inline void store_rows(const PackedLinear& w, int64_t tile, int64_t r0, int rt,
                                        const __m512* acc, float* y, int64_t ldy) {
  const int64_t c0 = tile * kTile;
  const int64_t cols = std::min<int64_t>(kTile, w.n - c0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 bias = w.bias ? _mm512_maskz_loadu_ps(mask, w.bias + c0) : _mm512_setzero_ps();
  for (int r = 0; r < rt; ++r)
    _mm512_mask_storeu_ps(y + (r0 + r) * ldy + c0, mask, _mm512_add_ps(acc[r], bias));
}

template <int RT>
SF_AVX512BF16 static void rows_avx512(const PackedLinear& w, const Activations& a, int64_t tile,
                                      int64_t r0, float* y, int64_t ldy) {
  const int64_t nb = w.k / kBlock;
  const uint8_t* wt = w.data + tile * nb * block_bytes(w.kind);
  __m512 acc[RT];
  switch (w.kind) {
    case Kind::Q4: affine_avx512<RT, Kind::Q4>(wt, nb, a, r0, acc); break;
    case Kind::Q4F: affine_avx512<RT, Kind::Q4F>(wt, nb, a, r0, acc); break;
    case Kind::Q8A: affine_avx512<RT, Kind::Q8A>(wt, nb, a, r0, acc); break;
    case Kind::Q8: q8_avx512<RT>(wt, nb, a, r0, acc); break;
    case Kind::Q8H: q8h_avx512<RT>(wt, nb, a, r0, acc); break;
    case Kind::F32: f32_avx512<RT>(wt, nb, a, r0, acc); break;
    case Kind::BF16:
      if (has_avx512bf16())
        bf16_native<RT>(wt, nb, a, r0, acc);
      else
        bf16_avx512<RT>(wt, nb, a, r0, acc);
      break;
  }
  store_rows(w, tile, r0, RT, acc, y, ldy);
}

// Rows r0..r0+n-1 (n <= 8) of one tile in one pass over its weights.
SF_AVX512BF16 static void rows_n_avx512(const PackedLinear& w, const Activations& a, int64_t t,
                                        int64_t r0, int64_t n, float* y, int64_t ldy) {
  switch (n) {
    case 8: return rows_avx512<8>(w, a, t, r0, y, ldy);
    case 7: return rows_avx512<7>(w, a, t, r0, y, ldy);
    case 6: return rows_avx512<6>(w, a, t, r0, y, ldy);
    case 5: return rows_avx512<5>(w, a, t, r0, y, ldy);
    case 4: return rows_avx512<4>(w, a, t, r0, y, ldy);
    case 3: return rows_avx512<3>(w, a, t, r0, y, ldy);
    case 2: return rows_avx512<2>(w, a, t, r0, y, ldy);
    case 1: return rows_avx512<1>(w, a, t, r0, y, ldy);
    default: return;
  }
}

// Rows r.. of one tile in passes of at most 8 rows, as even as can be (11 rows: 6 + 5, not
// 8 + 3): every pass reads the tile's weights once, and a short last pass would cost nearly
// as much as a full one.
SF_AVX512BF16 static void rows_from_avx512(const PackedLinear& w, const Activations& a, int64_t t,
                                           int64_t r, float* y, int64_t ldy) {
  const int64_t left = a.rows - r;
  if (left <= 0) return;
  const int64_t passes = (left + 7) / 8;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t n = left / passes + (p < left % passes ? 1 : 0);
    rows_n_avx512(w, a, t, r, n, y, ldy);
    r += n;
  }
}

SF_AVX512BF16 static void tiles_avx512(const PackedLinear& w, const Activations& a, int64_t t0,
                                       int64_t t1, float* y, int64_t ldy) {
  for (int64_t t = t0; t < t1; ++t) rows_from_avx512(w, a, t, 0, y, ldy);
}

#if SF_HAVE_AMX
// -- AMX int8 kernels: Q4, Q4F, Q8A and Q8, 16 rows at a time ------------------------------------
// One tile product per block of 32 inputs (tdpbsud: signed int8 activations times the unsigned
// codes) gives the block's exact integer sums for 16 rows and 16 columns, the very sums
// dot_block makes; the float steps after it are affine_avx512's and q8_avx512's in the same order.
// (Q8H's halves take the AVX-512 path at every row count.)
// So every row gets the AVX-512 path's bits, whichever path ran it.

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per tile row
  uint8_t rows[16] = {};
};

// Tiles 0-3: sums [16 rows, 16 int32]; 4-5: activations [16 rows, 32 int8]; 6-7: codes of a
// block [8 groups of 4 inputs, 16 columns x 4 bytes] (the layout of the packed vectors).
SF_AMX static void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t < 6 ? 16 : 8;
    cfg.colsb[t] = t == 4 || t == 5 ? 32 : 64;
  }
  _tile_loadconfig(&cfg);
}

// Q4 codes of one tile's blocks as tile rows: [nb][8 groups][64] bytes (low nibbles are even
// groups, high nibbles odd ones).
SF_AMX static void unpack_q4_tile(const uint8_t* wt, int64_t nb, int64_t bytes, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; ++b)
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(wt + b * bytes + 64 * i);
      uint8_t* row = out + 512 * b + 128 * i;
      _mm512_storeu_si512(row, _mm512_and_si512(v, low));
      _mm512_storeu_si512(row + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
}

// The float steps of block b for rows r0..r0+15 from their integer sums (affine_avx512 /
// q8_avx512).
SF_AMX static inline void scale_block(const PackedLinear& w, const uint8_t* wt, int64_t nb,
                                      const Activations& a, int64_t r0, int64_t b,
                                      const int32_t (*sums)[16], __m512* acc) {
  if (affine(w.kind)) {
    const bool f32 = w.kind != Kind::Q4;
    const uint8_t* p = wt + b * block_bytes(w.kind) + scales_at(w.kind);
    const __m512 d = f32 ? scales16<true>(p) : scales16<false>(p);
    const __m512 m = f32 ? scales16<true>(p + 64) : scales16<false>(p + 32);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const int64_t at = (r0 + r) * nb + b;
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.d[at]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[r])), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.ds[at]), acc[r]);
    }
  } else {
    const uint8_t* p = wt + b * 544;
    const __m512 d = scales16<false>(p + 512);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const int64_t at = (r0 + r) * nb + b;
      const __m512i fixed = _mm512_sub_epi32(_mm512_load_si512(sums[r]), _mm512_set1_epi32(128 * a.s[at]));
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.d[at]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fixed), scale, acc[r]);
    }
  }
}

// Tile products of blocks B and B+1 (if there is one) into sum tiles 0-1 or 2-3. (The tile
// intrinsics take literal tile numbers.)
#define SF_AMX_PRODUCTS(C0, C1, B)                            \
  do {                                                        \
    _tile_zero(C0);                                           \
    _tile_loadd(4, xq + (B) * kBlock, a.k);                   \
    _tile_loadd(6, codes + (B) * stride, 64);                 \
    _tile_dpbsud(C0, 4, 6);                                   \
    if ((B) + 1 < nb) {                                       \
      _tile_zero(C1);                                         \
      _tile_loadd(5, xq + ((B) + 1) * kBlock, a.k);           \
      _tile_loadd(7, codes + ((B) + 1) * stride, 64);         \
      _tile_dpbsud(C1, 5, 7);                                 \
    }                                                         \
  } while (0)

// The float steps of blocks b and b+1 from sum tiles 0-1 or 2-3.
#define SF_AMX_SCALE(C0, C1)                                  \
  do {                                                        \
    _tile_stored(C0, sums[0], 64);                            \
    scale_block(w, wt, nb, a, r0, b, sums[0], acc);           \
    if (b + 1 < nb) {                                         \
      _tile_stored(C1, sums[1], 64);                          \
      scale_block(w, wt, nb, a, r0, b + 1, sums[1], acc);     \
    }                                                         \
  } while (0)

// Rows r0..r0+15 of one tile. Blocks go two at a time, alternating between sum tiles 0-1 and
// 2-3 so that the next two products run while the last two are scaled (in block order).
// `codes` holds the tile's codes as tile rows (Q4 unpacked; Q8 packed as is), `stride` bytes
// a block.
SF_AMX static void group_amx(const PackedLinear& w, const uint8_t* wt, const uint8_t* codes,
                             int64_t stride, int64_t nb, const Activations& a, int64_t r0,
                             __m512* acc) {
  alignas(64) int32_t sums[2][16][16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* xq = &a.q[r0 * a.k];
  SF_AMX_PRODUCTS(0, 1, 0);
  for (int64_t b = 0; b < nb; b += 2) {
    const bool odd_round = (b / 2) % 2 == 1;  // this round's sums are in tiles 2-3
    if (b + 2 < nb) {  // the next round's products, into the other pair of tiles
      if (odd_round)
        SF_AMX_PRODUCTS(0, 1, b + 2);
      else
        SF_AMX_PRODUCTS(2, 3, b + 2);
    }
    if (odd_round)
      SF_AMX_SCALE(2, 3);
    else
      SF_AMX_SCALE(0, 1);
  }
}
#undef SF_AMX_PRODUCTS
#undef SF_AMX_SCALE

SF_AMX static void tiles_amx(const PackedLinear& w, const Activations& a, int64_t t0, int64_t t1,
                             float* y, int64_t ldy) {
  amx_configure();
  const int64_t nb = w.k / kBlock, bytes = block_bytes(w.kind);
  const bool q4 = q4_layout(w.kind);
  std::vector<uint8_t> unpacked(q4 ? 512 * nb : 0);  // [nb][8][64] tile rows
  __m512 acc[16];
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w.data + t * nb * bytes;
    if (q4) unpack_q4_tile(wt, nb, bytes, unpacked.data());
    const uint8_t* codes = q4 ? unpacked.data() : wt;
    const int64_t stride = q4 ? 512 : bytes;
    int64_t r = 0;
    for (; r + 16 <= a.rows; r += 16) {
      group_amx(w, wt, codes, stride, nb, a, r, acc);
      store_rows(w, t, r, 16, acc, y, ldy);
    }
    rows_from_avx512(w, a, t, r, y, ldy);
  }
  _tile_release();
}
#endif  // SF_HAVE_AMX

#endif  // SF_X86

static void tiles_generic(const PackedLinear& w, const Activations& a, int64_t t0, int64_t t1,
                          float* y, int64_t ldy) {
  float acc[kTile];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r = 0; r < a.rows; ++r) {
      tile_generic(w, a, t, r, acc);
      for (int64_t c = t * kTile; c < std::min(w.n, (t + 1) * kTile); ++c)
        y[r * ldy + c] = acc[c - t * kTile] + (w.bias ? w.bias[c] : 0.f);
    }
}

// AMX takes Q4 and Q8 products from this many rows (a group of 16 and the rest on AVX-512).
constexpr int64_t kAmxRows = 16;

// Tiles t0..t1-1 of one weight, on the best kernel for it and this CPU.
static void tiles_of(const PackedLinear& w, const Activations& a, int64_t t0, int64_t t1, float* y,
                     int64_t ldy) {
  const int isa = isa_level();
#if SF_HAVE_AMX
  if (isa == kAvx512 && a.rows >= kAmxRows && w.kind != Kind::Q8H && int8_kind(w.kind) &&
      has_amx_int8())
    return tiles_amx(w, a, t0, t1, y, ldy);
#endif
#if SF_X86
  if (isa == kAvx512) return tiles_avx512(w, a, t0, t1, y, ldy);
  if (isa == kAvx2) return tiles_avx2(w, a, t0, t1, y, ldy);
#endif
  (void)isa;
  tiles_generic(w, a, t0, t1, y, ldy);
}

void linear(const PackedLinear& w, Activations& a, float* y, int64_t ldy) {
  linear_fused({&w}, a, y, ldy);
}

void linear_fused(const std::vector<const PackedLinear*>& ws, Activations& a, float* y, int64_t ldy) {
  std::vector<int64_t> first(ws.size() + 1, 0), col(ws.size(), 0);  // each weight's first tile, column
  for (size_t i = 0; i < ws.size(); ++i) {
    if (ws[i]->k != a.k) throw std::invalid_argument("linear: input size does not match the weight");
    a.need(ws[i]->kind);
    first[i + 1] = first[i] + (ws[i]->n + kTile - 1) / kTile;
    if (i + 1 < ws.size()) col[i + 1] = col[i] + ws[i]->n;
  }
  parallel(first.back(), [&](int64_t t0, int64_t t1) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t lo = std::max(t0, first[i]), hi = std::min(t1, first[i + 1]);
      if (lo < hi) tiles_of(*ws[i], a, lo - first[i], hi - first[i], y + col[i], ldy);
    }
  });
}

void unpack_row(const PackedLinear& w, int64_t row, float* out) {
  const int64_t nb = w.k / kBlock, bytes = block_bytes(w.kind);
  const int64_t tile = row / kTile, c = row % kTile;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w.data + (tile * nb + b) * bytes;
    for (int j = 0; j < kBlock; ++j) {
      float v;
      if (affine(w.kind)) {
        v = std::fma(q4_scale(w.kind, p, c, 0), static_cast<float>(code_at(w.kind, p, c, j)),
                     q4_scale(w.kind, p, c, 1));
      } else if (w.kind == Kind::Q8) {
        const int code = code_at(w.kind, p, c, j) - 128;
        v = f16_to_f32(reinterpret_cast<const uint16_t*>(p + 512)[c]) * static_cast<float>(code);
      } else if (w.kind == Kind::Q8H) {
        const int code = code_at(w.kind, p, c, j) - 128;
        v = reinterpret_cast<const float*>(p + 512)[16 * (j / 16) + c] * static_cast<float>(code);
      } else if (w.kind == Kind::BF16) {
        v = bf16_to_f32(reinterpret_cast<const uint16_t*>(p)[32 * (j / 2) + 2 * c + j % 2]);
      } else {
        v = reinterpret_cast<const float*>(p)[16 * j + c];
      }
      out[b * kBlock + j] = v;
    }
  }
}

}  // namespace sf
