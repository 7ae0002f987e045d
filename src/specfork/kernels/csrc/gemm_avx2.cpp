// The linear layers' AVX2 kernels (CPUs without AVX-512): a tile's 16 output columns as two
// vectors of 8, and up to kPassRows rows in one pass over the tile's weights, so that a weight
// vector loaded (and, for Q4, unpacked) once serves every row of the pass. The integer block
// sums are exact and each row's float steps run in the AVX-512 path's order, so every row gets
// the same bits however many rows share the pass (and the same bits as the AVX-512 path for
// Q4, Q8 and F32).
#include <algorithm>
#include <cstring>

#include "common.h"
#include "gemm.h"

namespace sf {

#if SF_X86

namespace {

// Rows per pass: 4 rows x 2 halves keep 8 sums plus the unpacked weights in the 16 registers.
constexpr int kPassRows = 4;

// Asks for the bytes of a block kAhead further on (the next blocks and tiles follow in memory).
// A one-row step streams ~100 MB of weights from memory: with the hardware prefetcher alone the
// kernels read ~18 GB/s of the ~24 a two-core Zen 3 VM gives; 6 KB ahead, forwards of 1-4 rows
// ran 0.74-0.79x the time (16 rows 0.89x; 4-10 KB measured alike). A prefetch changes no result
// and never faults, past the end of the weights included.
constexpr int64_t kAhead = 6144;

SF_AVX2 inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + at), _MM_HINT_T0);
}

SF_AVX2 inline __m256i broadcast4(const int8_t* q) {  // 4 int8 codes in every 32-bit lane
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}

// Q4: a block's 8 groups of 4 inputs add up in int16 lanes. Each maddubs lane is two products
// of a code (0..15) and an activation (-127..127), |.| <= 3810, so the 8 groups' sum stays
// within 30480 and no saturation occurs: one madd per block then gives the exact int32 sums
// that a madd per group gives.
// Column scales 8h..8h+7 of a block at `at`: fp16 (Q4, Q8) or float32 (Q4F, Q8H).
template <bool F32>
SF_AVX2 inline __m256 scales8(const uint8_t* at, int h) {
  if constexpr (F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(at) + 8 * h);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16 * h)));
}

template <int RT, bool F32>
SF_AVX2 void q4_rows(const uint8_t* wt, int64_t nb, const Activations& a, int64_t r0,
                     __m256 (*acc)[2]) {
  constexpr int64_t bytes = F32 ? 384 : 320, scale_bytes = F32 ? 64 : 32;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = wt + b * bytes;
    prefetch_ahead(p, bytes);
    __m256i s[RT][2];
    for (int r = 0; r < RT; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {  // vector i: inputs 8i..8i+3 (low nibbles), 8i+4.. (high)
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * i));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * i + 32));
      const __m256i lo0 = _mm256_and_si256(v0, low), lo1 = _mm256_and_si256(v1, low);
      const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
      const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
      for (int r = 0; r < RT; ++r) {
        const int8_t* xq = &a.q[(r0 + r) * a.k + b * kBlock + 8 * i];
        const __m256i xe = broadcast4(xq), xo = broadcast4(xq + 4);
        s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(lo0, xe));
        s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(lo1, xe));
        s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(hi0, xo));
        s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(hi1, xo));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = scales8<F32>(p + 256, h), m = scales8<F32>(p + 256 + scale_bytes, h);
      for (int r = 0; r < RT; ++r) {
        const int64_t at = (r0 + r) * nb + b;
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][h], ones));
        acc[r][h] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(a.d[at])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.ds[at]), acc[r][h]);
      }
    }
  }
}

// The exact int32 sums of groups g0..g0+3 of a Q8/Q8H block (codes stored as q+128): |q| times
// the activations with q's sign, a madd per group (two products of up to 128*127 fill an int16
// lane, so groups cannot add up in int16).
template <int RT>
SF_AVX2 inline void q8_groups(const uint8_t* p, const Activations& a, int64_t r0, int64_t b,
                              int g0, int groups, __m256i (*s)[2]) {
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int r = 0; r < RT; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
  for (int g = g0; g < g0 + groups; ++g) {
    const __m256i v0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * g)), flip);
    const __m256i v1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * g + 32)), flip);
    const __m256i abs0 = _mm256_abs_epi8(v0), abs1 = _mm256_abs_epi8(v1);
    for (int r = 0; r < RT; ++r) {
      const __m256i x = broadcast4(&a.q[(r0 + r) * a.k + b * kBlock + 4 * g]);
      s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(abs0, _mm256_sign_epi8(x, v0)), ones));
      s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(abs1, _mm256_sign_epi8(x, v1)), ones));
    }
  }
}

// Q8: the signed sums need no correction (the flip undoes the +128).
template <int RT>
SF_AVX2 void q8_rows(const uint8_t* wt, int64_t nb, const Activations& a, int64_t r0,
                     __m256 (*acc)[2]) {
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = wt + b * 544;
    prefetch_ahead(p, 544);
    __m256i s[RT][2];
    q8_groups<RT>(p, a, r0, b, 0, 8, s);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = scales8<false>(p + 512, h);
      for (int r = 0; r < RT; ++r) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d[(r0 + r) * nb + b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), scale, acc[r][h]);
      }
    }
  }
}

// Q8A (unsigned codes 0-127): a madd per group, as Q8 (two products of up to 127*127 fit an
// int16 lane; eight groups would not), then Q4F's float steps.
template <int RT>
SF_AVX2 void q8a_rows(const uint8_t* wt, int64_t nb, const Activations& a, int64_t r0,
                      __m256 (*acc)[2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = wt + b * 640;
    prefetch_ahead(p, 640);
    __m256i s[RT][2];
    for (int r = 0; r < RT; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * g));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * g + 32));
      for (int r = 0; r < RT; ++r) {
        const __m256i x = broadcast4(&a.q[(r0 + r) * a.k + b * kBlock + 4 * g]);
        s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(v0, x), ones));
        s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(v1, x), ones));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = scales8<true>(p + 512, h), m = scales8<true>(p + 576, h);
      for (int r = 0; r < RT; ++r) {
        const int64_t at = (r0 + r) * nb + b;
        const __m256 sum = _mm256_cvtepi32_ps(s[r][h]);
        acc[r][h] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(a.d[at])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.ds[at]), acc[r][h]);
      }
    }
  }
}

// Q8H: each half block's sums (groups 0-3, then 4-7) scaled on their own, as q8h_avx512 does.
template <int RT>
SF_AVX2 void q8h_rows(const uint8_t* wt, int64_t nb, const Activations& a, int64_t r0,
                      __m256 (*acc)[2]) {
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = wt + b * 640;
    prefetch_ahead(p, 640);
    for (int half = 0; half < 2; ++half) {
      __m256i s[RT][2];
      q8_groups<RT>(p, a, r0, b, 4 * half, 4, s);
      for (int h = 0; h < 2; ++h) {
        const __m256 d = scales8<true>(p + 512 + 64 * half, h);
        for (int r = 0; r < RT; ++r) {
          const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d[(r0 + r) * nb + b]));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), scale, acc[r][h]);
        }
      }
    }
  }
}

// F32: products in input order within each block, blocks in order.
template <int RT>
SF_AVX2 void f32_rows(const uint8_t* wt, int64_t nb, const Activations& a, int64_t r0,
                      __m256 (*acc)[2]) {
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const float* wv = reinterpret_cast<const float*>(wt + b * 2048);
    prefetch_ahead(wt + b * 2048, 2048);
    for (int i = 0; i < kBlock; ++i) {
      const __m256 w0 = _mm256_loadu_ps(wv + 16 * i), w1 = _mm256_loadu_ps(wv + 16 * i + 8);
      for (int r = 0; r < RT; ++r) {
        const __m256 x = _mm256_set1_ps(a.x[(r0 + r) * a.ld + b * kBlock + i]);
        acc[r][0] = _mm256_fmadd_ps(w0, x, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, x, acc[r][1]);
      }
    }
  }
}

// BF16: each pair of inputs adds its odd product, then its even one (the generic order).
template <int RT>
SF_AVX2 void bf16_rows(const uint8_t* wt, int64_t nb, const Activations& a, int64_t r0,
                       __m256 (*acc)[2]) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint16_t* wv = reinterpret_cast<const uint16_t*>(wt + b * 1024);
    prefetch_ahead(wt + b * 1024, 1024);
    for (int pr = 0; pr < kBlock / 2; ++pr) {
      __m256 odd[2], even[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wv + 32 * pr + 16 * h));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
      }
      for (int r = 0; r < RT; ++r) {
        const uint16_t* xb = &a.bf[(r0 + r) * a.k + b * kBlock + 2 * pr];
        const __m256 xo = _mm256_set1_ps(bf16_to_f32(xb[1])), xe = _mm256_set1_ps(bf16_to_f32(xb[0]));
        for (int h = 0; h < 2; ++h) {
          acc[r][h] = _mm256_fmadd_ps(odd[h], xo, acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(even[h], xe, acc[r][h]);
        }
      }
    }
  }
}

// Rows r0..r0+RT-1 of one tile: y = acc + bias (zero without one, as the AVX-512 path adds),
// the columns past n left alone.
template <int RT>
SF_AVX2 void rows_avx2(const PackedLinear& w, const Activations& a, int64_t tile, int64_t r0,
                       float* y, int64_t ldy) {
  const int64_t nb = w.k / kBlock;
  const uint8_t* wt = w.data + tile * nb * block_bytes(w.kind);
  __m256 acc[RT][2];
  switch (w.kind) {
    case Kind::Q4: q4_rows<RT, false>(wt, nb, a, r0, acc); break;
    case Kind::Q4F: q4_rows<RT, true>(wt, nb, a, r0, acc); break;
    case Kind::Q8: q8_rows<RT>(wt, nb, a, r0, acc); break;
    case Kind::Q8H: q8h_rows<RT>(wt, nb, a, r0, acc); break;
    case Kind::Q8A: q8a_rows<RT>(wt, nb, a, r0, acc); break;
    case Kind::F32: f32_rows<RT>(wt, nb, a, r0, acc); break;
    case Kind::BF16: bf16_rows<RT>(wt, nb, a, r0, acc); break;
  }
  const int64_t c0 = tile * kTile, cols = std::min<int64_t>(kTile, w.n - c0);
  alignas(32) float bias[kTile] = {}, out[kTile];
  if (w.bias) std::copy(w.bias + c0, w.bias + c0 + cols, bias);
  for (int r = 0; r < RT; ++r) {
    for (int h = 0; h < 2; ++h)
      _mm256_store_ps(out + 8 * h, _mm256_add_ps(acc[r][h], _mm256_load_ps(bias + 8 * h)));
    std::copy(out, out + cols, y + (r0 + r) * ldy + c0);
  }
}

SF_AVX2 void rows_n_avx2(const PackedLinear& w, const Activations& a, int64_t t, int64_t r0,
                         int64_t n, float* y, int64_t ldy) {
  static_assert(kPassRows == 4, "one case per pass size");
  switch (n) {
    case 4: return rows_avx2<4>(w, a, t, r0, y, ldy);
    case 3: return rows_avx2<3>(w, a, t, r0, y, ldy);
    case 2: return rows_avx2<2>(w, a, t, r0, y, ldy);
    case 1: return rows_avx2<1>(w, a, t, r0, y, ldy);
    default: return;
  }
}

}  // namespace

void tiles_avx2(const PackedLinear& w, const Activations& a, int64_t t0, int64_t t1, float* y,
                int64_t ldy) {
  const int64_t passes = (a.rows + kPassRows - 1) / kPassRows;
  for (int64_t t = t0; t < t1; ++t) {
    int64_t r = 0;
    for (int64_t p = 0; p < passes; ++p) {  // passes as even as can be (7 rows: 4 + 3)
      const int64_t n = a.rows / passes + (p < a.rows % passes ? 1 : 0);
      rows_n_avx2(w, a, t, r, n, y, ldy);
      r += n;
    }
  }
}

#endif  // SF_X86

}  // namespace sf
