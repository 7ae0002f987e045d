#include "attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
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
// Dot products of q with 4 keys at once (independent chains; each key's sum is formed the
// same way whatever its place among the four, so the result depends on the key alone).
SF_AVX512 inline void dots4(const __m512* qv, int64_t vecs, const float* K, int64_t D,
                            float* out) {
  __m512 a[4];
  for (int i = 0; i < 4; ++i) a[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(K + i * D));
  for (int64_t c = 1; c < vecs; ++c)
    for (int i = 0; i < 4; ++i) a[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(K + i * D + 16 * c), a[i]);
  for (int i = 0; i < 4; ++i) out[i] = _mm512_reduce_add_ps(a[i]);
}

SF_AVX512 inline float dot1(const __m512* qv, int64_t vecs, const float* k) {
  __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
  for (int64_t c = 1; c < vecs; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);
  return _mm512_reduce_add_ps(a);
}

SF_AVX512 Partial chunk_avx512(const float* q, const float* K, const float* V, int64_t n,
                               int64_t D, float scale, float* e, float* o) {
  const int64_t vecs = D / 16;
  __m512 qv[16];
  for (int64_t c = 0; c < vecs; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) dots4(qv, vecs, K + j * D, D, e + j);
  for (; j < n; ++j) e[j] = dot1(qv, vecs, K + j * D);
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (j = 0; j < n; j += 16) {  // scale, then the max (exact in any order)
    const __mmask16 lanes = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, e + j), sc);
    _mm512_mask_storeu_ps(e + j, lanes, x);
    top = _mm512_mask_max_ps(top, lanes, top, x);
  }
  const float mx = _mm512_reduce_max_ps(top);
  const __m512 m = _mm512_set1_ps(mx);
  __m512 sums = _mm512_setzero_ps();
  for (j = 0; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 x = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, e + j), m));
    _mm512_mask_storeu_ps(e + j, lanes, x);
    sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(lanes, x));
  }
  // weighted values: even and odd ranks in two sets of accumulators, added at the end
  __m512 even[16], odd[16];
  for (int64_t c = 0; c < vecs; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  for (j = 0; j + 2 <= n; j += 2) {
    const __m512 p0 = _mm512_set1_ps(e[j]), p1 = _mm512_set1_ps(e[j + 1]);
    const float* v0 = V + j * D;
    for (int64_t c = 0; c < vecs; ++c) {
      even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), even[c]);
      odd[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v0 + D + 16 * c), odd[c]);
    }
  }
  if (j < n) {
    const __m512 p0 = _mm512_set1_ps(e[j]);
    for (int64_t c = 0; c < vecs; ++c)
      even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(V + j * D + 16 * c), even[c]);
  }
  for (int64_t c = 0; c < vecs; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_add_ps(even[c], odd[c]));
  return {mx, _mm512_reduce_add_ps(sums)};
}

SF_AVX2 void gather_avx2(const void* base, CacheType type, int64_t head_base, const int32_t* slots,
                         int64_t n, int64_t D, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t at = head_base + static_cast<int64_t>(slots[j]) * D;
    for (int64_t d = 0; d < D; d += 8) {
      __m256 x;
      if (type == CacheType::F32) {
        x = _mm256_loadu_ps(static_cast<const float*>(base) + at + d);
      } else {
        const __m128i h = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + at + d));
        x = type == CacheType::F16 ? _mm256_cvtph_ps(h)
                                   : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
      _mm256_storeu_ps(out + j * D + d, x);
    }
  }
}

SF_AVX2 Partial chunk_avx2(const float* q, const float* K, const float* V, int64_t n, int64_t D,
                           float scale, float* e, float* o) {
  const int64_t vecs = D / 8;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const float* k = K + j * D;
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
    for (int64_t c = 1; c < vecs; ++c)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), acc);
    e[j] = hsum256(acc) * scale;
    top = std::max(top, e[j]);
  }
  const __m256 m = _mm256_set1_ps(top);
  __m256 sums = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = exp256(_mm256_sub_ps(_mm256_loadu_ps(e + j), m));
    _mm256_storeu_ps(e + j, x);
    sums = _mm256_add_ps(sums, x);
  }
  float tail = 0.f;
  for (; j < n; ++j) {
    e[j] = std::exp(e[j] - top);
    tail += e[j];
  }
  for (int64_t d = 0; d < D; d += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) acc = _mm256_fmadd_ps(_mm256_set1_ps(e[i]), _mm256_loadu_ps(V + i * D + d), acc);
    _mm256_storeu_ps(o + d, acc);
  }
  return {top, hsum256(sums) + tail};
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
#if SF_X86
  if (isa_level() == kAvx512 && D % 16 == 0 && D <= 256) {
    fetch = gather_avx512;
    chunk = chunk_avx512;
  } else if (isa_level() >= kAvx2 && D % 8 == 0) {
    fetch = gather_avx2;
    chunk = chunk_avx2;
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
  struct Scratch {
    std::vector<float> K, V, e;
  };
  parallel_dynamic(
      static_cast<int64_t>(items.size()),
      [&] { return Scratch{std::vector<float>(kChunk * D), std::vector<float>(kChunk * D),
                           std::vector<float>(kChunk + 16)}; },
      [&](int64_t i, Scratch& w) {
        const Item& it = items[i];
        const AttnPart& part = parts[it.part];
        const KVView& kv = part.kv;
        const ChunkTask& t = part.plan->tasks[it.task];
        const int32_t* slots = part.plan->vis.idx.data() + t.first;
        fetch(kv.k, kv.type, it.g * kv.slots * D, slots, it.n, D, w.K.data());
        fetch(kv.v, kv.type, it.g * kv.slots * D, slots, it.n, D, w.V.data());
        for (int32_t k = it.row0; k < it.row0 + it.rows; ++k) {
          const int64_t r = part.row0 + t.rows[k];
          for (int64_t h = it.g * group; h < (it.g + 1) * group; ++h) {
            const int64_t at = (r * s.heads + h) * C + t.chunk;
            const float* qh = q + r * ldq + h * D;
            const Partial p = chunk(qh, w.K.data(), w.V.data(), t.lens[k], D, s.scale, w.e.data(), &po[at * D]);
            pm[at] = p.m;
            pl[at] = p.l;
          }
        }
      });
  parallel(s.rows * s.heads, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / s.heads;
      const int64_t at = item * C;
      merge(&pm[at], &pl[at], &po[at * D], chunks[r], D, out + item * D);
    }
  });
}

}  // namespace sf
