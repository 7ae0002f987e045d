#include "attention.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "common.h"
#include "vecmath.h"

namespace sf {

namespace {

inline float load1(const void* base, CacheType type, int64_t i) {
  switch (type) {
    case CacheType::F32: return static_cast<const float*>(base)[i];
    case CacheType::F16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case CacheType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.f;
}

#if SF_X86
// f32_to_f16 on 16 values (the same bits: round to nearest even, overflow to infinity, NaN to
// the sign and 0x7e00).
SF_AVX512 void f16_run_avx512(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan) {
      const __m256i sign = _mm256_and_si256(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)),
                                            _mm256_set1_epi16(static_cast<short>(0x8000)));
      h = _mm256_mask_blend_epi16(nan, h, _mm256_or_si256(sign, _mm256_set1_epi16(0x7e00)));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = f32_to_f16(x[i]);
}
#endif

// n values x stored from element i of a cache in its type.
void store_run(void* base, CacheType type, int64_t i, const float* x, int64_t n) {
  if (type == CacheType::F32) {
    std::memcpy(static_cast<float*>(base) + i, x, sizeof(float) * n);
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(base) + i;
#if SF_X86
  if (type == CacheType::F16 && isa_level() == kAvx512) return f16_run_avx512(x, out, n);
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = type == CacheType::F16 ? f32_to_f16(x[j]) : f32_to_bf16(x[j]);
}

// A chunk's keys or values as float [n, D] (gathered from its slots, converted once).
void gather(const void* base, CacheType type, int64_t head_base, const int32_t* slots, int64_t n,
            int64_t D, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t at = head_base + static_cast<int64_t>(slots[j]) * D;
    if (type == CacheType::F32) {
      std::memcpy(out + j * D, static_cast<const float*>(base) + at, D * sizeof(float));
    } else {
      for (int64_t d = 0; d < D; ++d) out[j * D + d] = load1(base, type, at + d);
    }
  }
}

#if SF_X86
SF_AVX512 void gather_avx512(const void* base, CacheType type, int64_t head_base,
                             const int32_t* slots, int64_t n, int64_t D, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t at = head_base + static_cast<int64_t>(slots[j]) * D;
    for (int64_t d = 0; d < D; d += 16) {
      __m512 x;
      if (type == CacheType::F32) {
        x = _mm512_loadu_ps(static_cast<const float*>(base) + at + d);
      } else {
        const __m256i h = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at + d));
        x = type == CacheType::F16 ? _mm512_cvtph_ps(h)
                                   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
      _mm512_storeu_ps(out + j * D + d, x);
    }
  }
}

#endif  // SF_X86

// -- one chunk, one (row, head): scores, max, exponentials, their sum, weighted values -----------

struct Partial {
  float m, l;  // max score, sum of exp(score - m)
};

// One query of a chunk: its vector, the keys it sees (the chunk's first n), where its weighted
// values [D] and softmax partial go.
struct Query {
  const float* q;
  int64_t n;
  float* o;
  float* m;
  float* l;
};

using QueriesFn = void (*)(const Query*, int64_t, const void*, const void*, const float*, float, float*, float*,
                          float*);

Partial chunk_generic(const float* q, const float* K, const float* V, int64_t n, int64_t D,
                      float scale, float* e, float* o) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot = std::fma(q[d], K[j * D + d], dot);
    e[j] = dot * scale;
    top = std::max(top, e[j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    e[j] = std::exp(e[j] - top);
    sum += e[j];
  }
  for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) o[d] = std::fma(e[j], V[j * D + d], o[d]);
  return {top, sum};
}

#if SF_X86
// Lane j of the result: the sum of p[j]'s 16 lanes (j < 16), by a fixed tree — pairs of lanes
// within 128-bit quarters, then the quarters — so a key's score depends on that key alone.
SF_AVX512 inline __m512 sum16(const __m512* p) {
  __m512 two[8], four[4], eight[2];
  for (int i = 0; i < 8; ++i)  // [a0+a2, b0+b2, a1+a3, b1+b3] per quarter
    two[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                           _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // lane 4q+k: key 4i+k's sum over quarter q
    const __m512d a = _mm512_castps_pd(two[2 * i]), b = _mm512_castps_pd(two[2 * i + 1]);
    four[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // quarters 0+1 and 2+3 of keys 8i..8i+3 and 8i+4..8i+7
    eight[i] = _mm512_add_ps(_mm512_shuffle_f32x4(four[2 * i], four[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(four[2 * i], four[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(eight[0], eight[1], 0x88),
                       _mm512_shuffle_f32x4(eight[0], eight[1], 0xdd));
}

// 16 floats of a cache (or of float scratch) from element i: exact conversions, so a key read
// in place gives the bits it gives gathered.
template <CacheType T>
SF_AVX512 inline __m512 load16(const void* base, int64_t i) {
  if constexpr (T == CacheType::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == CacheType::F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Scores of q against the 16 keys from key j0 of K (VECS vectors of 16 dimensions each): per
// key, lane-wise products summed over the vectors in order, then sum16. Lane j depends on key j
// alone, so keys past a chunk's end (the scratch rows after it) only fill lanes left unused.
template <int VECS, CacheType T>
SF_AVX512 inline __m512 dots16(const float* q, const void* K, int64_t j0) {
  constexpr int64_t D = 16 * VECS;
  __m512 p[16];
  const __m512 q0 = _mm512_loadu_ps(q);
  for (int j = 0; j < 16; ++j) p[j] = _mm512_mul_ps(q0, load16<T>(K, (j0 + j) * D));
  for (int c = 1; c < VECS; ++c) {
    const __m512 qc = _mm512_loadu_ps(q + 16 * c);
    for (int j = 0; j < 16; ++j) p[j] = _mm512_fmadd_ps(qc, load16<T>(K, (j0 + j) * D + 16 * c), p[j]);
  }
  return sum16(p);
}

// The most vectors of dimensions, at most `most`, that divide `vecs`: a pass's accumulators
// (a head of 10 vectors runs in two passes of 5, not in passes of 8 that would run past it).
constexpr int dims_group(int vecs, int most) {
  for (int g = most; g > 1; --g)
    if (vecs % g == 0) return g;
  return 1;
}

// acc [2, D] += weights e[j] times values V[j - j0] for keys j0 <= j < end (V: key j0's row):
// even ranks into acc[0], odd ranks into acc[1], at most 8 vectors of dimensions per pass.
// Called on consecutive even-aligned ranges, it forms the very sums of one pass over all keys.
template <int VECS, CacheType T>
SF_AVX512 inline void weigh_keys(const float* e, const void* V, int64_t j0, int64_t end, float* acc) {
  constexpr int64_t D = 16 * VECS;
  constexpr int G = dims_group(VECS, 8);
  for (int c0 = 0; c0 < VECS; c0 += G) {
    __m512 even[G], odd[G];
    for (int c = 0; c < G; ++c) {
      even[c] = _mm512_loadu_ps(acc + 16 * (c0 + c));
      odd[c] = _mm512_loadu_ps(acc + D + 16 * (c0 + c));
    }
    int64_t j = j0;
    for (; j + 2 <= end; j += 2) {
      const __m512 p0 = _mm512_set1_ps(e[j]), p1 = _mm512_set1_ps(e[j + 1]);
      const int64_t v0 = (j - j0) * D + 16 * c0;
      for (int c = 0; c < G; ++c) {
        even[c] = _mm512_fmadd_ps(p0, load16<T>(V, v0 + 16 * c), even[c]);
        odd[c] = _mm512_fmadd_ps(p1, load16<T>(V, v0 + D + 16 * c), odd[c]);
      }
    }
    if (j < end) {
      const __m512 p0 = _mm512_set1_ps(e[j]);
      for (int c = 0; c < G; ++c)
        even[c] = _mm512_fmadd_ps(p0, load16<T>(V, (j - j0) * D + 16 * (c0 + c)), even[c]);
    }
    for (int c = 0; c < G; ++c) {
      _mm512_storeu_ps(acc + 16 * (c0 + c), even[c]);
      _mm512_storeu_ps(acc + D + 16 * (c0 + c), odd[c]);
    }
  }
}

// weigh_keys for two queries over the same keys j0 .. end (end - j0 even), each value vector
// read once for both: the very sums of each query's own weigh_keys.
template <int VECS>
SF_AVX512 inline void weigh_keys2(const float* e0, const float* e1, const float* V, int64_t j0,
                                  int64_t end, float* acc0, float* acc1) {
  constexpr int64_t D = 16 * VECS;
  constexpr int G = dims_group(VECS, 5);
  for (int c0 = 0; c0 < VECS; c0 += G) {
    __m512 even0[G], odd0[G], even1[G], odd1[G];
    for (int c = 0; c < G; ++c) {
      even0[c] = _mm512_loadu_ps(acc0 + 16 * (c0 + c));
      odd0[c] = _mm512_loadu_ps(acc0 + D + 16 * (c0 + c));
      even1[c] = _mm512_loadu_ps(acc1 + 16 * (c0 + c));
      odd1[c] = _mm512_loadu_ps(acc1 + D + 16 * (c0 + c));
    }
    for (int64_t j = j0; j < end; j += 2) {
      const __m512 a0 = _mm512_set1_ps(e0[j]), a1 = _mm512_set1_ps(e0[j + 1]);
      const __m512 b0 = _mm512_set1_ps(e1[j]), b1 = _mm512_set1_ps(e1[j + 1]);
      const float* v = V + (j - j0) * D + 16 * c0;
      for (int c = 0; c < G; ++c) {
        __m512 x = _mm512_loadu_ps(v + 16 * c), y = _mm512_loadu_ps(v + D + 16 * c);
        __asm__("" : "+v"(x), "+v"(y));  // one load each for both queries
        even0[c] = _mm512_fmadd_ps(a0, x, even0[c]);
        odd0[c] = _mm512_fmadd_ps(a1, y, odd0[c]);
        even1[c] = _mm512_fmadd_ps(b0, x, even1[c]);
        odd1[c] = _mm512_fmadd_ps(b1, y, odd1[c]);
      }
    }
    for (int c = 0; c < G; ++c) {
      _mm512_storeu_ps(acc0 + 16 * (c0 + c), even0[c]);
      _mm512_storeu_ps(acc0 + D + 16 * (c0 + c), odd0[c]);
      _mm512_storeu_ps(acc1 + 16 * (c0 + c), even1[c]);
      _mm512_storeu_ps(acc1 + D + 16 * (c0 + c), odd1[c]);
    }
  }
}

// Keys (or values) j0 .. j0 + n - 1 of a chunk stored as T, as float [n, D] in `out`: exact
// conversions, so what is computed from them is what reading them as T gives.
template <int VECS, CacheType T>
SF_AVX512 inline const float* as_float(const void* X, int64_t j0, int64_t n, float* out) {
  constexpr int64_t D = 16 * VECS;
  if constexpr (T == CacheType::F32) {
    return static_cast<const float*>(X) + j0 * D;
  } else {
    for (int64_t j = 0; j < n; ++j)
      for (int c = 0; c < VECS; ++c)
        _mm512_storeu_ps(out + j * D + 16 * c, load16<T>(X, (j0 + j) * D + 16 * c));
    return out;
  }
}

// r[c] lane i = r[i] lane c (16 x 16 lanes of 32 bits), in place.
SF_AVX512 inline void transpose16x16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows, lane pairs interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quads of rows, 64-bit pairs interleaved
    for (int k = 0; k < 2; ++k) {
      const __m512d a = _mm512_castps_pd(t[i + k]), b = _mm512_castps_pd(t[i + k + 2]);
      r[i + 2 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[i + 2 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  }
  for (int i = 0; i < 16; i += 8)  // 128-bit quarters of quads 0-1 and 2-3 of each 8 rows
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88);
      t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd);
  }
}

// out[c * ldo + r] = in[r * ld + c] for a 16 x 16 tile of floats.
SF_AVX512 inline void transpose16(const float* in, int64_t ld, float* out, int64_t ldo) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * ld);
  transpose16x16(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + i * ldo, r[i]);
}

// 16 keys x 32 dimensions stored as bf16 (key i at in + i * ld) transposed into floats:
// out[d * ldo + i] = key i's dimension d. The 32-bit lanes (two dimensions each) are transposed,
// then split: a bf16 is the top half of its float (the conversion load16 makes).
SF_AVX512 inline void transpose_bf16(const uint16_t* in, int64_t ld, float* out, int64_t ldo) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(in + i * ld));
  transpose16x16(r);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int c = 0; c < 16; ++c) {
    const __m512i pair = _mm512_castps_si512(r[c]);  // lane i: key i's dimensions 2c, 2c + 1
    _mm512_storeu_ps(out + 2 * c * ldo, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
    _mm512_storeu_ps(out + (2 * c + 1) * ldo, _mm512_castsi512_ps(_mm512_and_si512(pair, high)));
  }
}

// kt [D, W] = keys j0 .. j0 + W of a chunk, transposed (key j0 + c in column c): keys below
// `whole` from K (type T), the 16 from `whole` on from `tail` (float [16, D], zero-padded),
// those from `most` on zeros. j0, whole and W are multiples of 16.
template <int VECS, CacheType T>
SF_AVX512 inline void transpose_keys(const void* K, const float* tail, int64_t whole, int64_t most,
                                     int64_t j0, int64_t W, float* block, float* kt) {
  constexpr int64_t D = 16 * VECS;
  for (int64_t c = 0; c < W; c += 16) {
    const int64_t j = j0 + c;
    if (j >= most) {
      for (int64_t d = 0; d < D; ++d) _mm512_storeu_ps(kt + d * W + c, _mm512_setzero_ps());
      continue;
    }
    if constexpr (T == CacheType::BF16 && VECS % 2 == 0) {
      if (j < whole) {  // straight from the cache's bf16, converted as transposed
        const uint16_t* keys = static_cast<const uint16_t*>(K) + j * D;
        for (int v = 0; v < VECS; v += 2) transpose_bf16(keys + 16 * v, D, kt + 16 * v * W + c, W);
        continue;
      }
    }
    const float* keys = j < whole ? as_float<VECS, T>(K, j, 16, block) : tail;  // [16, D]
    for (int v = 0; v < VECS; ++v) transpose16(keys + 16 * v, D, kt + 16 * v * W + c, W);
  }
}

// Scores of NQ queries against the keys in columns c .. c + 16 NB of kt [D, W], keys j0 + c
// on of the chunk: for each (query, key), one fused multiply-add per dimension in dimension
// order from zero — the very steps of `chunk_generic`, so a score does not depend on the
// kernel, on the other queries, nor on the keys beside it — times the scale, stored to e
// (lanes past a query's keys left alone).
template <int VECS, int NQ, int NB>
SF_AVX512 inline void scores_t(const Query* qs, const float* kt, int64_t W, int64_t c, int64_t j0,
                               float scale, float* e) {
  constexpr int64_t D = 16 * VECS;
  __m512 acc[NQ][NB];
  for (int i = 0; i < NQ; ++i)
    for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 k[NB];
    for (int b = 0; b < NB; ++b) {
      k[b] = _mm512_loadu_ps(kt + d * W + c + 16 * b);
      __asm__("" : "+v"(k[b]));  // kept in a register: folded into each FMA, loads bound the loop
    }
    for (int i = 0; i < NQ; ++i) {
      const __m512 x = _mm512_set1_ps(qs[i].q[d]);
      for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_fmadd_ps(x, k[b], acc[i][b]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < NQ; ++i)
    for (int b = 0; b < NB; ++b) {
      const int64_t at = j0 + c + 16 * b, left = qs[i].n - at;
      if (left <= 0) continue;
      const __mmask16 lanes = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1u);
      _mm512_mask_storeu_ps(e + i * kChunk + at, lanes, _mm512_mul_ps(acc[i][b], sc));
    }
}

// Every query's scores (e: [count, kChunk]) against columns c .. c + 16 NB of kt: three queries
// at a time (3 NB independent sums in flight), then two, then one.
template <int VECS, int NB>
SF_AVX512 void scores_span(const Query* qs, int64_t count, const float* kt, int64_t W, int64_t c,
                           int64_t j0, float scale, float* e) {
  int64_t i = 0;
  for (; i + 3 <= count; i += 3) scores_t<VECS, 3, NB>(qs + i, kt, W, c, j0, scale, e + i * kChunk);
  if (i + 2 <= count) {
    scores_t<VECS, 2, NB>(qs + i, kt, W, c, j0, scale, e + i * kChunk);
    i += 2;
  }
  if (i < count) scores_t<VECS, 1, NB>(qs + i, kt, W, c, j0, scale, e + i * kChunk);
}

// Every query's scores against the W keys of kt [D, W], keys j0 on of the chunk: 64 keys at a
// time, then 32, then 16.
template <int VECS>
SF_AVX512 void scores_all(const Query* qs, int64_t count, const float* kt, int64_t W, int64_t j0,
                          float scale, float* e) {
  int64_t c = 0;
  for (; c + 64 <= W; c += 64) scores_span<VECS, 4>(qs, count, kt, W, c, j0, scale, e);
  if (c + 32 <= W) {
    scores_span<VECS, 2>(qs, count, kt, W, c, j0, scale, e);
    c += 32;
  }
  if (c < W) scores_span<VECS, 1>(qs, count, kt, W, c, j0, scale, e);
}

// Keys of a chunk transposed at a time: kt [D, span] within 32 KB (so that it stays in L1 while
// every query reads it), a multiple of 16, at most the chunk.
constexpr int64_t key_span(int64_t D) {
  const int64_t fit = (8192 / D) / 16 * 16;
  return fit < 16 ? 16 : (fit > kChunk ? kChunk : fit);
}

// The queries of one chunk (rows and heads sharing its keys and values). K and V are the
// chunk's keys and values [n, D] of type T: float scratch (gathered) or, for a contiguous run
// of slots, the cache itself, read in place; `tail` ([16, D] float, or null) then holds the
// last partial block of 16 keys, zero-padded, so that no read runs past the run. Each query's
// steps are those of one pass over its keys — scores, max, exponentials and their sum,
// weighted values in even and odd ranks. The keys are converted to float and transposed once
// for all queries, a span at a time (kt [D, key_span(D)] at the end of `block`), so that a score is a run of
// multiply-adds with keys in lanes and no sum across lanes; values run keys-outer, 32 keys for
// every query and then the next 32, so a block of values is read from L1 by all queries
// instead of from L2 by each, converted once a block for all of them (`block`: [32, D] float
// scratch). The bits do not depend on where the keys were read, nor on how many queries read
// them. e: [count, kChunk] scratch; acc: [count, 2, D] scratch.
template <int VECS, CacheType T>
SF_AVX512 void queries_avx512(const Query* qs, int64_t count, const void* K, const void* V,
                              const float* tail, float scale, float* e, float* acc, float* block) {
  constexpr int64_t D = 16 * VECS;
  int64_t most = 0;
  for (int64_t i = 0; i < count; ++i) most = std::max(most, qs[i].n);
  const int64_t whole = tail ? most / 16 * 16 : most;  // keys read from K (the rest from tail)
  constexpr int64_t S = key_span(D);
  float* kt = block + 32 * D;  // [D, S]
  {  // ask for the chunk's keys and values at once, so that they arrive while earlier ones are used
    const size_t bytes = (T == CacheType::F32 ? sizeof(float) : sizeof(uint16_t)) * D * whole;
    const char *k = static_cast<const char*>(K), *v = static_cast<const char*>(V);
    for (size_t at = 0; at < bytes; at += 64)  // the keys into L1 as far as they fit
      at < 32768 ? _mm_prefetch(k + at, _MM_HINT_T0) : _mm_prefetch(k + at, _MM_HINT_T1);
    for (size_t at = 0; at < bytes; at += 64) _mm_prefetch(v + at, _MM_HINT_T1);
  }
  for (int64_t j0 = 0; j0 < most; j0 += S) {
    const int64_t W = std::min(S, (most - j0 + 15) / 16 * 16);
    transpose_keys<VECS, T>(K, tail, whole, most, j0, W, block, kt);
    scores_all<VECS>(qs, count, kt, W, j0, scale, e);
  }
  for (int64_t i = 0; i < count; ++i) {  // max (exact in any order), exponentials, their sum
    const int64_t n = qs[i].n;
    float* ei = e + i * kChunk;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1u);
      top = _mm512_mask_max_ps(top, lanes, top, _mm512_maskz_loadu_ps(lanes, ei + j));
    }
    const float mx = _mm512_reduce_max_ps(top);
    const __m512 m = _mm512_set1_ps(mx);
    __m512 sums = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1u);
      const __m512 x = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, ei + j), m));
      _mm512_mask_storeu_ps(ei + j, lanes, x);
      sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(lanes, x));
    }
    *qs[i].m = mx;
    *qs[i].l = _mm512_reduce_add_ps(sums);
  }
  std::fill(acc, acc + count * 2 * D, 0.f);
  for (int64_t j = 0; j < most; j += 32) {
    const float* values = as_float<VECS, T>(V, j, std::min<int64_t>(32, most - j), block);  // [32, D]
    int64_t i = 0;
    for (; i + 2 <= count; i += 2) {  // pairs of queries over the keys both see (an even count)
      const int64_t end0 = std::min(j + 32, qs[i].n), end1 = std::min(j + 32, qs[i + 1].n);
      const int64_t both = std::max(j, std::min(end0, end1) / 2 * 2);
      float* acc0 = acc + i * 2 * D;
      float* acc1 = acc0 + 2 * D;
      if (both > j) weigh_keys2<VECS>(e + i * kChunk, e + (i + 1) * kChunk, values, j, both, acc0, acc1);
      const float* rest = values + (both - j) * D;
      if (end0 > both) weigh_keys<VECS, CacheType::F32>(e + i * kChunk, rest, both, end0, acc0);
      if (end1 > both) weigh_keys<VECS, CacheType::F32>(e + (i + 1) * kChunk, rest, both, end1, acc1);
    }
    if (i < count && j < qs[i].n)
      weigh_keys<VECS, CacheType::F32>(e + i * kChunk, values, j, std::min(j + 32, qs[i].n), acc + i * 2 * D);
  }
  for (int64_t i = 0; i < count; ++i)
    for (int64_t c = 0; c < VECS; ++c)
      _mm512_storeu_ps(qs[i].o + 16 * c, _mm512_add_ps(_mm512_loadu_ps(acc + i * 2 * D + 16 * c),
                                                       _mm512_loadu_ps(acc + i * 2 * D + D + 16 * c)));
}

template <CacheType T>
QueriesFn queries_avx512_typed(int64_t D) {
  switch (D / 16) {
    case 1: return queries_avx512<1, T>;
    case 2: return queries_avx512<2, T>;
    case 3: return queries_avx512<3, T>;
    case 4: return queries_avx512<4, T>;
    case 5: return queries_avx512<5, T>;
    case 6: return queries_avx512<6, T>;
    case 7: return queries_avx512<7, T>;
    case 8: return queries_avx512<8, T>;
    case 10: return queries_avx512<10, T>;
    case 12: return queries_avx512<12, T>;
    case 16: return queries_avx512<16, T>;
    default: return nullptr;
  }
}

// The AVX-512 kernel for head size D (a multiple of 16 up to 256) reading keys and values of
// type T, or null.
QueriesFn queries_avx512_for(int64_t D, CacheType type) {
  switch (type) {
    case CacheType::F32: return queries_avx512_typed<CacheType::F32>(D);
    case CacheType::F16: return queries_avx512_typed<CacheType::F16>(D);
    case CacheType::BF16: return queries_avx512_typed<CacheType::BF16>(D);
  }
  return nullptr;
}

// 8 floats of a cache (or of float scratch) from element i: exact conversions, so a key read
// in place gives the bits it gives gathered.
template <CacheType T>
SF_AVX2 inline __m256 load8(const void* base, int64_t i) {
  if constexpr (T == CacheType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == CacheType::F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <CacheType T>
SF_AVX2 void gather_avx2_typed(const void* base, int64_t head_base, const int32_t* slots, int64_t n,
                               int64_t D, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t at = head_base + static_cast<int64_t>(slots[j]) * D;
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + j * D + d, load8<T>(base, at + d));
  }
}

SF_AVX2 void gather_avx2(const void* base, CacheType type, int64_t head_base, const int32_t* slots,
                         int64_t n, int64_t D, float* out) {
  switch (type) {
    case CacheType::F32: return gather_avx2_typed<CacheType::F32>(base, head_base, slots, n, D, out);
    case CacheType::F16: return gather_avx2_typed<CacheType::F16>(base, head_base, slots, n, D, out);
    case CacheType::BF16: return gather_avx2_typed<CacheType::BF16>(base, head_base, slots, n, D, out);
  }
}

// Lane j: hsum256(p[j]) for 8 vectors at once, by the same additions in the same order
// (halves, then lanes k and k+2, then lanes 0 and 1), so a key's score is what one key alone
// gets.
SF_AVX2 inline __m256 hsum8(const __m256* p) {
  __m256 u[4], w[2];
  for (int i = 0; i < 4; ++i)  // [low + high half of p[2i] | of p[2i+1]]
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(p[2 * i], p[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(p[2 * i], p[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i) {  // lanes k + (k+2): [p4i, p4i+2 | p4i+1, p4i+3], 2 lanes each
    const __m256d a = _mm256_castps_pd(u[2 * i]), b = _mm256_castps_pd(u[2 * i + 1]);
    w[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x88),  // keys 0 2 4 6 | 1 3 5 7
                                    _mm256_shuffle_ps(w[0], w[1], 0xdd));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// o[0:D] = sum over keys i < n of e[i] * V[i], each dimension summed in key order from zero.
// Keys run outermost over 64 dimensions at a time: 8 independent sums instead of one chain of
// n dependent multiply-adds per 8 dimensions (the same sums, the same bits).
template <CacheType T>
SF_AVX2 void weigh_values_avx2(const float* e, const void* V, int64_t n, int64_t D, float* o) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m256 p = _mm256_set1_ps(e[i]);
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(p, load8<T>(V, i * D + d0 + 8 * c), acc[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + d0 + 8 * c, acc[c]);
  }
  for (int64_t d = d0; d < D; d += 8) {  // the last dimensions (D not a multiple of 64)
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) acc = _mm256_fmadd_ps(_mm256_set1_ps(e[i]), load8<T>(V, i * D + d), acc);
    _mm256_storeu_ps(o + d, acc);
  }
}

// Scores of q against keys j0 .. j0+7 of K (only the first `keys` of them read; the other lanes
// are zeros), times the scale.
template <CacheType T>
SF_AVX2 inline __m256 scores8(const float* q, const void* K, int64_t j0, int keys, int64_t D,
                              __m256 scale) {
  __m256 p[8];
  const __m256 q0 = _mm256_loadu_ps(q);
  for (int k = 0; k < 8; ++k) p[k] = k < keys ? _mm256_mul_ps(q0, load8<T>(K, (j0 + k) * D)) : _mm256_setzero_ps();
  for (int64_t c = 1; c < D / 8; ++c) {
    const __m256 qc = _mm256_loadu_ps(q + 8 * c);
    for (int k = 0; k < keys; ++k) p[k] = _mm256_fmadd_ps(qc, load8<T>(K, (j0 + k) * D + 8 * c), p[k]);
  }
  return _mm256_mul_ps(hsum8(p), scale);
}

// One query over the n keys and values of a chunk, read as stored (T: float scratch, or the
// cache itself for a contiguous run of slots; nothing past key n is read).
template <CacheType T>
SF_AVX2 Partial chunk_avx2_typed(const float* q, const void* K, const void* V, int64_t n, int64_t D,
                                 float scale, float* e, float* o) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(e + j, scores8<T>(q, K, j, 8, D, sc));
  if (j < n) _mm256_storeu_ps(e + j, scores8<T>(q, K, j, static_cast<int>(n - j), D, sc));
  float top = -std::numeric_limits<float>::infinity();
  for (j = 0; j < n; ++j) top = std::max(top, e[j]);
  const __m256 m = _mm256_set1_ps(top);
  __m256 sums = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 x = exp256(_mm256_sub_ps(_mm256_loadu_ps(e + j), m));
    _mm256_storeu_ps(e + j, x);
    sums = _mm256_add_ps(sums, x);
  }
  float tail = 0.f;
  for (; j < n; ++j) {
    e[j] = std::exp(e[j] - top);
    tail += e[j];
  }
  weigh_values_avx2<T>(e, V, n, D, o);
  return {top, hsum256(sums) + tail};
}

SF_AVX2 Partial chunk_avx2(const float* q, const float* K, const float* V, int64_t n, int64_t D,
                           float scale, float* e, float* o) {
  return chunk_avx2_typed<CacheType::F32>(q, K, V, n, D, scale, e, o);
}

using ChunkInPlace = Partial (*)(const float*, const void*, const void*, int64_t, int64_t, float,
                                 float*, float*);

ChunkInPlace chunk_avx2_for(CacheType type) {
  switch (type) {
    case CacheType::F32: return chunk_avx2_typed<CacheType::F32>;
    case CacheType::F16: return chunk_avx2_typed<CacheType::F16>;
    case CacheType::BF16: return chunk_avx2_typed<CacheType::BF16>;
  }
  return nullptr;
}

// Lane k < 4 of the result: hsum8's sum of p[k]'s 8 lanes, by the same additions in the same
// order (halves, then lanes k and k+2, then lanes 0 and 1), for four vectors.
SF_AVX2 inline __m128 hsum4(const __m256* p) {
  const __m256 u0 = _mm256_add_ps(_mm256_permute2f128_ps(p[0], p[1], 0x20), _mm256_permute2f128_ps(p[0], p[1], 0x31));
  const __m256 u1 = _mm256_add_ps(_mm256_permute2f128_ps(p[2], p[3], 0x20), _mm256_permute2f128_ps(p[2], p[3], 0x31));
  const __m256d a = _mm256_castps_pd(u0), b = _mm256_castps_pd(u1);
  const __m256 w = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(w, w, 0x88), _mm256_shuffle_ps(w, w, 0xdd));
  return _mm256_castps256_ps128(_mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// Scores of NQ queries against the KEYS (<= 4 G) keys from key j0 of K (type T, [*, D]
// layout), the very steps of `scores8` for each (query, key) — lane-wise products over the
// dimensions' vectors in order, then hsum8's tree — with every key vector loaded once for the NQ
// queries (NQ G4 independent sums in flight), times the scale, stored to each query's row of e.
template <int VECS, int NQ, int G, int KEYS, CacheType T>
SF_AVX2 inline void scores_shared(const Query* qs, const void* K, int64_t j0, __m256 sc, float* e) {
  constexpr int64_t D = 8 * VECS;
  __m256 p[NQ][4 * G];
  for (int c = 0; c < VECS; ++c) {
    __m256 x[NQ];
    for (int i = 0; i < NQ; ++i) x[i] = _mm256_loadu_ps(qs[i].q + 8 * c);
    for (int k = 0; k < 4 * G; ++k) {
      const __m256 kv = k < KEYS ? load8<T>(K, (j0 + k) * D + 8 * c) : _mm256_setzero_ps();
      for (int i = 0; i < NQ; ++i) p[i][k] = c == 0 ? _mm256_mul_ps(x[i], kv) : _mm256_fmadd_ps(x[i], kv, p[i][k]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int g = 0; g < G; ++g) {
      const __m128 four = _mm_mul_ps(hsum4(p[i] + 4 * g), _mm256_castps256_ps128(sc));  // lane k: key j0 + 4g + k
      float* out = e + i * kChunk + j0 + 4 * g;
      if constexpr (KEYS == 4 * G) {
        _mm_storeu_ps(out, four);
      } else {
        alignas(16) float lanes[4];
        _mm_store_ps(lanes, four);
        for (int k = 0; k < 4 && 4 * g + k < KEYS; ++k) out[k] = lanes[k];
      }
    }
}

// acc [NQ][D] += weights e_i[j] times values V[j - j0] (type T, [*, D] from key j0) for keys
// j0 <= j < end, each dimension summed in key order from zero as `weigh_values_avx2` sums it: G
// vectors of dimensions at a time, each value vector loaded once for the NQ queries.
template <int VECS, int NQ, CacheType T>
SF_AVX2 inline void weigh_shared(const float* const* e, const void* V, int64_t j0, int64_t end,
                                 float* const* acc) {
  constexpr int64_t D = 8 * VECS;
  constexpr int G = dims_group(VECS, NQ == 1 ? 8 : 4);
  for (int c0 = 0; c0 < VECS; c0 += G) {
    __m256 a[NQ][G];
    for (int i = 0; i < NQ; ++i)
      for (int c = 0; c < G; ++c) a[i][c] = _mm256_loadu_ps(acc[i] + 8 * (c0 + c));
    for (int64_t j = j0; j < end; ++j) {
      __m256 w[NQ];
      for (int i = 0; i < NQ; ++i) w[i] = _mm256_set1_ps(e[i][j]);
      for (int c = 0; c < G; ++c) {
        const __m256 x = load8<T>(V, (j - j0) * D + 8 * (c0 + c));
        for (int i = 0; i < NQ; ++i) a[i][c] = _mm256_fmadd_ps(w[i], x, a[i][c]);
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int c = 0; c < G; ++c) _mm256_storeu_ps(acc[i] + 8 * (c0 + c), a[i][c]);
  }
}

// Every query's weighted values over the keys [j, j + keys) of V (type T, [*, D] from key j):
// pairs of queries over the keys both see, then each over the rest, then the last query.
template <int VECS, CacheType T>
SF_AVX2 void weigh_block(const Query* qs, int64_t count, const float* e, const void* V, int64_t j,
                         int64_t keys, float* acc) {
  constexpr int64_t D = 8 * VECS;
  constexpr size_t bytes = T == CacheType::F32 ? sizeof(float) : sizeof(uint16_t);
  const auto from = [&](int64_t key) { return static_cast<const char*>(V) + (key - j) * D * bytes; };
  int64_t i = 0;
  for (; i + 2 <= count; i += 2) {
    const int64_t end0 = std::min(j + keys, qs[i].n), end1 = std::min(j + keys, qs[i + 1].n);
    const int64_t both = std::max(j, std::min(end0, end1));
    const float* ep[2] = {e + i * kChunk, e + (i + 1) * kChunk};
    float* ap[2] = {acc + i * D, acc + (i + 1) * D};
    if (both > j) weigh_shared<VECS, 2, T>(ep, V, j, both, ap);
    if (end0 > both) weigh_shared<VECS, 1, T>(ep, from(both), both, end0, ap);
    if (end1 > both) weigh_shared<VECS, 1, T>(ep + 1, from(both), both, end1, ap + 1);
  }
  if (i < count && j < qs[i].n) {
    const float* ep[1] = {e + i * kChunk};
    float* ap[1] = {acc + i * D};
    weigh_shared<VECS, 1, T>(ep, V, j, std::min(j + keys, qs[i].n), ap);
  }
}

// Every query's scores against the chunk's first `most` keys: NQ queries, 4 G keys at a time.
template <int VECS, int NQ, int G, CacheType T>
SF_AVX2 void scores_keys(const Query* qs, const void* K, int64_t most, __m256 sc, float* e) {
  int64_t j = 0;
  for (; j + 4 * G <= most; j += 4 * G) scores_shared<VECS, NQ, G, 4 * G, T>(qs, K, j, sc, e);
  for (; j + 4 <= most; j += 4) scores_shared<VECS, NQ, 1, 4, T>(qs, K, j, sc, e);
  switch (most - j) {
    case 1: return scores_shared<VECS, NQ, 1, 1, T>(qs, K, j, sc, e);
    case 2: return scores_shared<VECS, NQ, 1, 2, T>(qs, K, j, sc, e);
    case 3: return scores_shared<VECS, NQ, 1, 3, T>(qs, K, j, sc, e);
    default: return;
  }
}

// Every query's scores against the chunk's first `most` keys, two queries at a time, then one.
template <int VECS, CacheType T>
SF_AVX2 void scores_all8(const Query* qs, int64_t count, const void* K, int64_t most, float scale,
                         float* e) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 2 <= count; i += 2) scores_keys<VECS, 2, 1, T>(qs + i, K, most, sc, e + i * kChunk);
  if (i < count) scores_keys<VECS, 1, 2, T>(qs + i, K, most, sc, e + i * kChunk);
}

// The AVX2 counterpart of `queries_avx512`: every query of a chunk (rows and heads sharing its
// keys and values) at once, each with the very steps of `chunk_avx2_typed` — so a query gets the
// bits it gets alone, however many queries share the call and wherever its keys were read — but
// with every key and value vector loaded once for two queries. K and V are the chunk's `most`
// keys and values [most, D] of type T (float scratch, or the cache itself for a contiguous run,
// read in place; nothing past key `most` is read). With more than kConvertQueries queries the
// keys are first converted to float once for all of them (`block` + 32 D: [kChunk, D] scratch);
// values are converted a block of 32 keys at a time (`block`: [32, D]) and run keys-outer.
// e: [count, kChunk] scratch; acc: [count, D] scratch.
template <int VECS, CacheType T>
SF_AVX2 void queries_avx2(const Query* qs, int64_t count, const void* K, const void* V,
                          const float*, float scale, float* e, float* acc, float* block) {
  constexpr int64_t D = 8 * VECS;
  constexpr int64_t kConvertQueries = 6;
  int64_t most = 0;
  for (int64_t i = 0; i < count; ++i) most = std::max(most, qs[i].n);
  if (T != CacheType::F32 && count > kConvertQueries) {
    float* keys = block + 32 * D;
    for (int64_t j = 0; j < most; ++j)
      for (int c = 0; c < VECS; ++c) _mm256_storeu_ps(keys + j * D + 8 * c, load8<T>(K, j * D + 8 * c));
    scores_all8<VECS, CacheType::F32>(qs, count, keys, most, scale, e);
  } else {
    scores_all8<VECS, T>(qs, count, K, most, scale, e);
  }
  for (int64_t i = 0; i < count; ++i) {  // as chunk_avx2_typed: max, exponentials, their sum
    const int64_t n = qs[i].n;
    float* ei = e + i * kChunk;
    __m256 tops = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(ei + t));
    float top = hmax256(tops);  // a max is exact in any order
    for (; t < n; ++t) top = std::max(top, ei[t]);
    const __m256 m = _mm256_set1_ps(top);
    __m256 sums = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 x = exp256(_mm256_sub_ps(_mm256_loadu_ps(ei + j), m));
      _mm256_storeu_ps(ei + j, x);
      sums = _mm256_add_ps(sums, x);
    }
    float tail = 0.f;
    for (; j < n; ++j) {
      ei[j] = std::exp(ei[j] - top);
      tail += ei[j];
    }
    *qs[i].m = top;
    *qs[i].l = hsum256(sums) + tail;
  }
  std::fill(acc, acc + count * D, 0.f);
  constexpr size_t bytes = T == CacheType::F32 ? sizeof(float) : sizeof(uint16_t);
  for (int64_t j = 0; j < most; j += 32) {
    const int64_t keys = std::min<int64_t>(32, most - j);
    const void* values = static_cast<const char*>(V) + j * D * bytes;
    if (T == CacheType::F32 || count <= kConvertQueries) {  // read as stored
      weigh_block<VECS, T>(qs, count, e, values, j, keys, acc);
      continue;
    }
    for (int64_t r = 0; r < keys; ++r)  // converted once for the many queries
      for (int c = 0; c < VECS; ++c) _mm256_storeu_ps(block + r * D + 8 * c, load8<T>(V, (j + r) * D + 8 * c));
    weigh_block<VECS, CacheType::F32>(qs, count, e, block, j, keys, acc);
  }
  for (int64_t i = 0; i < count; ++i) std::memcpy(qs[i].o, acc + i * D, D * sizeof(float));
}

template <CacheType T>
QueriesFn queries_avx2_typed(int64_t D) {
  switch (D / 8) {
    case 2: return queries_avx2<2, T>;
    case 4: return queries_avx2<4, T>;
    case 6: return queries_avx2<6, T>;
    case 8: return queries_avx2<8, T>;
    case 10: return queries_avx2<10, T>;
    case 12: return queries_avx2<12, T>;
    case 16: return queries_avx2<16, T>;
    case 20: return queries_avx2<20, T>;
    case 24: return queries_avx2<24, T>;
    case 32: return queries_avx2<32, T>;
    default: return nullptr;
  }
}

// The AVX2 all-queries kernel for head size D (a multiple of 8 listed above) reading keys and
// values of type T, or null (the one-query kernel then runs).
QueriesFn queries_avx2_for(int64_t D, CacheType type) {
  if (D % 8 != 0) return nullptr;
  switch (type) {
    case CacheType::F32: return queries_avx2_typed<CacheType::F32>(D);
    case CacheType::F16: return queries_avx2_typed<CacheType::F16>(D);
    case CacheType::BF16: return queries_avx2_typed<CacheType::BF16>(D);
  }
  return nullptr;
}

#endif  // SF_X86

// Merge the chunk partials of one (row, head) in chunk order: out = o / l.
void merge(const float* ms, const float* ls, const float* os, int64_t chunks, int64_t D,
           float* out) {
  float m = -std::numeric_limits<float>::infinity(), l = 0.f;
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float top = std::max(m, ms[c]);
    const float a = std::exp(m - top), b = std::exp(ms[c] - top);
    l = l * a + ls[c] * b;
    for (int64_t d = 0; d < D; ++d) out[d] = out[d] * a + os[c * D + d] * b;
    m = top;
  }
  const float inv = 1.f / l;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

}  // namespace

AttnPlan plan_attention(Visible vis_, int64_t rows) {
  AttnPlan plan;
  plan.vis = std::move(vis_);
  const Visible& vis = plan.vis;
  plan.chunks.resize(rows);
  std::map<std::pair<int64_t, int32_t>, size_t> shared;  // (chunk, first slot) -> task
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = vis.off[r + 1] - vis.off[r];
    const int32_t* list = vis.idx.data() + vis.off[r];
    plan.chunks[r] = (n + kChunk - 1) / kChunk;
    plan.max_chunks = std::max(plan.max_chunks, plan.chunks[r]);
    for (int64_t c = 0; c < plan.chunks[r]; ++c) {
      const int32_t* slots = list + c * kChunk;
      const int64_t len = std::min(kChunk, n - c * kChunk);
      const int64_t first = vis.off[r] + c * kChunk;
      const bool run = slots[len - 1] - slots[0] == len - 1;  // contiguous (ascending slots)
      if (run) {
        auto found = shared.find({c, slots[0]});
        if (found != shared.end()) {
          ChunkTask& t = plan.tasks[found->second];
          t.rows.push_back(static_cast<int32_t>(r));
          t.lens.push_back(static_cast<int32_t>(len));
          if (len > t.n) {  // the same run, longer: read it from this row's list
            t.n = len;
            t.first = first;
          }
          continue;
        }
        shared[{c, slots[0]}] = plan.tasks.size();
      }
      plan.tasks.push_back(ChunkTask{first, len, {static_cast<int32_t>(r)}, c, {static_cast<int32_t>(len)}});
    }
  }
  for (const auto& t : plan.tasks)
    plan.max_rows = std::max<int64_t>(plan.max_rows, static_cast<int64_t>(t.rows.size()));
  return plan;
}

void write_kv(const KVView& kv, const float* k, const float* v, int64_t ld, int64_t rows,
              int64_t heads_kv, int64_t head_dim, int64_t start) {
  parallel_rows(rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < heads_kv; ++g) {
        const int64_t at = (g * kv.slots + start + r) * head_dim;
        store_run(kv.k, kv.type, at, k + r * ld + g * head_dim, head_dim);
        store_run(kv.v, kv.type, at, v + r * ld + g * head_dim, head_dim);
      }
  });
}

void attention(const float* q, int64_t ldq, const KVView& kv, const AttnPlan& plan,
               const AttnShape& s, float* out) {
  attention_parts(q, ldq, {AttnPart{kv, &plan, 0, s.rows}}, s, out);
}

void attention_parts(const float* q, int64_t ldq, const std::vector<AttnPart>& parts,
                     const AttnShape& s, float* out) {
  const int64_t group = s.heads / s.heads_kv, D = s.head_dim;
  auto fetch = gather;
  auto chunk = chunk_generic;
  QueriesFn many = nullptr;  // all queries of a chunk at once (AVX-512), else one by one
  bool many_avx2 = false;  // AVX2's all-queries kernel: contiguous runs read in place
  bool avx2 = false;  // one query at a time on AVX2 (in place for few queries)
#if SF_X86
  if (isa_level() == kAvx512 && D % 16 == 0 && queries_avx512_for(D, CacheType::F32) != nullptr) {
    fetch = gather_avx512;
    many = queries_avx512_for(D, CacheType::F32);
  } else if (isa_level() >= kAvx2 && queries_avx2_for(D, CacheType::F32) != nullptr) {
    fetch = gather_avx2;
    many = queries_avx2_for(D, CacheType::F32);
    many_avx2 = true;
  } else if (isa_level() >= kAvx2 && D % 8 == 0) {
    fetch = gather_avx2;
    chunk = chunk_avx2;
    avx2 = true;
  }
#endif
  // chunks of every row (rows numbered across parts), and the most of any row
  std::vector<int64_t> chunks(s.rows, 0);
  int64_t C = 0;
  for (const AttnPart& part : parts)
    for (int64_t r = 0; r < part.rows; ++r) {
      chunks[part.row0 + r] = part.plan->chunks[r];
      C = std::max(C, part.plan->chunks[r]);
    }
  // partials [rows, heads, chunks]: max, sum, weighted values [D]
  std::vector<float> pm(s.rows * s.heads * C), pl(s.rows * s.heads * C);
  std::vector<float> po(s.rows * s.heads * C * D);
  // items: (part, task, kv head, block of up to kRowBlock of the task's rows), taken dynamically
  struct Item {
    int32_t part, task, g, row0, rows, n;  // n: the slots its rows read (their longest chunk)
  };
  constexpr int32_t kRowBlock = 8;
  // On AVX2, items of at most this many queries read a contiguous chunk in place; with more,
  // writing a float copy once and reading it per query wins (each query converts the keys it
  // reads). The AVX-512 kernel converts a block of keys and values once for all queries, and
  // reads a contiguous chunk in place whatever the count (8 rows of a group of three: 10% faster
  // than through a float copy at 2k slots).
  constexpr int64_t kInPlaceQueries = 8;
  std::vector<Item> items;
  for (size_t p = 0; p < parts.size(); ++p) {
    const AttnPlan& plan = *parts[p].plan;
    for (size_t t = 0; t < plan.tasks.size(); ++t) {
      const ChunkTask& task = plan.tasks[t];
      for (int32_t r = 0; r < static_cast<int32_t>(task.rows.size()); r += kRowBlock) {
        const int32_t n = std::min<int32_t>(kRowBlock, task.rows.size() - r);
        const int32_t len = *std::max_element(task.lens.begin() + r, task.lens.begin() + r + n);
        for (int32_t g = 0; g < s.heads_kv; ++g)
          items.push_back(Item{static_cast<int32_t>(p), static_cast<int32_t>(t), g, r, n, len});
      }
    }
  }
  // each thread's scratch, left uninitialised (it is written before it is read): keys and values
  // [kChunk, D] as float, scores [queries, kChunk], weighted-value sums [queries, 2, D]
  struct Scratch {
    std::unique_ptr<float[]> K, V, e, acc, block;
    std::vector<Query> queries;
  };
  const int64_t most = kRowBlock * group;  // queries of one item
  parallel_dynamic(
      static_cast<int64_t>(items.size()),
      [&] {
        const auto floats = [](int64_t n) { return std::unique_ptr<float[]>(new float[n]); };
        return Scratch{floats(kChunk * D), floats(kChunk * D), floats(most * kChunk + 16),
                       floats(most * 2 * D), floats(32 * D + std::max<int64_t>(8192, kChunk * D)), {}};
      },
      [&](int64_t i, Scratch& w) {
        const Item& it = items[i];
        const AttnPart& part = parts[it.part];
        const KVView& kv = part.kv;
        const ChunkTask& t = part.plan->tasks[it.task];
        const int32_t* slots = part.plan->vis.idx.data() + t.first;
        w.queries.clear();
        for (int32_t k = it.row0; k < it.row0 + it.rows; ++k) {
          const int64_t r = part.row0 + t.rows[k];
          for (int64_t h = it.g * group; h < (it.g + 1) * group; ++h) {
            const int64_t at = (r * s.heads + h) * C + t.chunk;
            w.queries.push_back(Query{q + r * ldq + h * D, t.lens[k], &po[at * D], &pm[at], &pl[at]});
          }
        }
        const int64_t count = static_cast<int64_t>(w.queries.size());
        const int64_t head_base = it.g * kv.slots * D;
        const bool run = slots[it.n - 1] - slots[0] == it.n - 1;  // contiguous slots
        const bool in_place = run && (many != nullptr || count <= kInPlaceQueries);
        if (many_avx2 && run) {  // AVX2, a contiguous run: every query reads the cache in place
          const size_t bytes = kv.type == CacheType::F32 ? sizeof(float) : sizeof(uint16_t);
          const int64_t at = (head_base + static_cast<int64_t>(slots[0]) * D) * bytes;
          queries_avx2_for(D, kv.type)(w.queries.data(), count, static_cast<const char*>(kv.k) + at,
                                       static_cast<const char*>(kv.v) + at, nullptr, s.scale,
                                       w.e.get(), w.acc.get(), w.block.get());
          return;
        }
        if (many && in_place) {
          // a contiguous run: read the cache in place (converting a block of keys once for all
          // queries costs less than writing and re-reading a float copy of the chunk)
          const int64_t whole = it.n / 16 * 16, at = head_base + static_cast<int64_t>(slots[0]) * D;
          const float* tail = nullptr;
          if (whole < it.n) {  // the last partial block of keys, zero-padded, as float
            fetch(kv.k, kv.type, head_base, slots + whole, it.n - whole, D, w.K.get());
            std::fill(w.K.get() + (it.n - whole) * D, w.K.get() + 16 * D, 0.f);
            tail = w.K.get();
          }
          const size_t bytes = kv.type == CacheType::F32 ? sizeof(float) : sizeof(uint16_t);
          queries_avx512_for(D, kv.type)(w.queries.data(), count,
                                         static_cast<const char*>(kv.k) + at * bytes,
                                         static_cast<const char*>(kv.v) + at * bytes, tail,
                                         s.scale, w.e.get(), w.acc.get(), w.block.get());
          return;
        }
#if SF_X86
        if (avx2 && in_place) {
          // AVX2, few queries over a contiguous run: each query reads the cache in place
          const size_t bytes = kv.type == CacheType::F32 ? sizeof(float) : sizeof(uint16_t);
          const int64_t at = (head_base + static_cast<int64_t>(slots[0]) * D) * bytes;
          const ChunkInPlace one_query = chunk_avx2_for(kv.type);
          for (const Query& one : w.queries) {
            const Partial p = one_query(one.q, static_cast<const char*>(kv.k) + at,
                                        static_cast<const char*>(kv.v) + at, one.n, D, s.scale,
                                        w.e.get(), one.o);
            *one.m = p.m;
            *one.l = p.l;
          }
          return;
        }
#endif
        fetch(kv.k, kv.type, head_base, slots, it.n, D, w.K.get());
        fetch(kv.v, kv.type, head_base, slots, it.n, D, w.V.get());
        // the AVX-512 scores read keys 16 at a time: the rows after the chunk's last are zeros
        std::fill(w.K.get() + it.n * D, w.K.get() + std::min<int64_t>(kChunk, (it.n + 15) / 16 * 16) * D, 0.f);
        if (many) {
          many(w.queries.data(), count, w.K.get(), w.V.get(), nullptr, s.scale, w.e.get(), w.acc.get(),
               w.block.get());
          return;
        }
        for (const Query& one : w.queries) {
          const Partial p = chunk(one.q, w.K.get(), w.V.get(), one.n, D, s.scale, w.e.get(), one.o);
          *one.m = p.m;
          *one.l = p.l;
        }
      });
  // merging is a few vector steps per chunk: the threads only pay for many (row, head, chunk)s
  const auto merge_items = [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / s.heads;
      const int64_t at = item * C;
      merge(&pm[at], &pl[at], &po[at * D], chunks[r], D, out + item * D);
    }
  };
  if (s.rows * s.heads * C >= 256)
    parallel(s.rows * s.heads, merge_items);
  else
    merge_items(0, s.rows * s.heads);
}

}  // namespace sf
