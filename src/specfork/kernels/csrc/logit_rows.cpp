// Reductions over logits rows (logit_rows.h).
//
// Top-k of a vocabulary row in one pass: a sorted buffer of the k best so far, and a vectorised
// scan (16 values a comparison on AVX-512, 8 on AVX2) for the next value above the buffer's
// smallest. After the first few hundred values almost nothing is above it, so a 49,152-entry
// row costs a few µs where torch.topk's partial sort took ~60 µs a row.
#include "logit_rows.h"

#include <algorithm>
#include <vector>

#include <cmath>
#include <limits>

#include "common.h"
#include "vecmath.h"

namespace sf {

namespace {

// The k best (value, index) pairs seen so far, best first; equal values keep arrival order.
struct Best {
  std::vector<float> value;
  std::vector<int64_t> index;
  int64_t size = 0;

  explicit Best(int64_t k) : value(k), index(k) {}

  float worst() const { return value[size - 1]; }

  void insert(float v, int64_t i) {
    const int64_t k = static_cast<int64_t>(value.size());
    int64_t pos = size < k ? size++ : k - 1;  // a full buffer drops its worst
    while (pos > 0 && value[pos - 1] < v) {
      value[pos] = value[pos - 1];
      index[pos] = index[pos - 1];
      --pos;
    }
    value[pos] = v;
    index[pos] = i;
  }
};

// The first j in [i, n) with x[j] > t, else n (NaN is never above).
int64_t next_above_generic(const float* x, int64_t i, int64_t n, float t) {
  while (i < n && !(x[i] > t)) ++i;
  return i;
}

#if SF_X86
SF_AVX512 int64_t next_above_avx512(const float* x, int64_t i, int64_t n, float t) {
  const __m512 tv = _mm512_set1_ps(t);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), tv, _CMP_GT_OQ);
    if (m) return i + __builtin_ctz(m);
  }
  return next_above_generic(x, i, n, t);
}

SF_AVX2 int64_t next_above_avx2(const float* x, int64_t i, int64_t n, float t) {
  const __m256 tv = _mm256_set1_ps(t);
  for (; i + 8 <= n; i += 8) {
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), tv, _CMP_GT_OQ));
    if (m) return i + __builtin_ctz(m);
  }
  return next_above_generic(x, i, n, t);
}
#endif

using NextAbove = int64_t (*)(const float*, int64_t, int64_t, float);

NextAbove next_above() {
#if SF_X86
  if (isa_level() >= kAvx512) return next_above_avx512;
  if (isa_level() >= kAvx2) return next_above_avx2;
#endif
  return next_above_generic;
}

void top_k_row(const float* x, int64_t n, int64_t k, NextAbove find, int64_t* out) {
  Best best(k);
  int64_t i = 0;
  for (; best.size < k && i < n; ++i)
    if (x[i] == x[i]) best.insert(x[i], i);  // NaN is skipped
  while (best.size == k) {
    i = find(x, i, n, best.worst());
    if (i >= n) break;
    best.insert(x[i], i);
    ++i;
  }
  for (int64_t j = 0; j < k; ++j) out[j] = j < best.size ? best.index[j] : -1;
}

float lse_generic(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  if (!std::isfinite(m)) return m;
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(x[i] - m);
  return m + std::log(sum);
}

#if SF_X86
SF_AVX512 float lse_avx512(const float* x, int64_t n) {
  const int64_t body = n - n % 16;
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < body; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
  float m = _mm512_reduce_max_ps(mv);
  for (int64_t i = body; i < n; ++i) m = x[i] > m ? x[i] : m;
  if (!std::isfinite(m)) return m;
  const __m512 mm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < body; i += 16)
    acc = _mm512_add_ps(acc, exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mm)));
  float sum = _mm512_reduce_add_ps(acc);
  for (int64_t i = body; i < n; ++i) sum += std::exp(x[i] - m);
  return m + std::log(sum);
}

SF_AVX2 float lse_avx2(const float* x, int64_t n) {
  const int64_t body = n - n % 8;
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < body; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
  float m = hmax256(mv);
  for (int64_t i = body; i < n; ++i) m = x[i] > m ? x[i] : m;
  if (!std::isfinite(m)) return m;
  const __m256 mm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < body; i += 8)
    acc = _mm256_add_ps(acc, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), mm)));
  float sum = hsum256(acc);
  for (int64_t i = body; i < n; ++i) sum += std::exp(x[i] - m);
  return m + std::log(sum);
}
#endif

using RowLse = float (*)(const float*, int64_t);

RowLse row_lse() {
#if SF_X86
  if (isa_level() >= kAvx512) return lse_avx512;
  if (isa_level() >= kAvx2) return lse_avx2;
#endif
  return lse_generic;
}

}  // namespace

float logsumexp_row(const float* x, int64_t n) { return row_lse()(x, n); }

torch::Tensor top_k_ids(torch::Tensor x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "top_k_ids: x must be [R, V] float32");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(1 <= k && k <= n, "top_k_ids: k must be in 1..", n, ", got ", k);
  auto xc = x.contiguous();
  torch::Tensor out = torch::empty({rows, k}, torch::kInt64);
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel_rows(rows, 2, [&](int64_t r0, int64_t r1) {
    const NextAbove find = next_above();
    for (int64_t r = r0; r < r1; ++r) top_k_row(xp + r * n, n, k, find, op + r * k);
  });
  return out;
}

void put_top_k_ids(torch::Tensor table, torch::Tensor tokens, torch::Tensor x) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kInt32 && table.is_contiguous(),
              "put_top_k_ids: table must be a contiguous [N, k] int32 tensor");
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == torch::kInt64,
              "put_top_k_ids: tokens must be [R] int64");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(0) == tokens.size(0),
              "put_top_k_ids: x must be [R, V] float32, one row per token");
  const int64_t rows = x.size(0), n = x.size(1), k = table.size(1), slots = table.size(0);
  TORCH_CHECK(1 <= k && k <= n, "put_top_k_ids: k must be in 1..", n, ", got ", k);
  auto xc = x.contiguous();
  auto tc = tokens.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(0 <= tp[r] && tp[r] < slots, "put_top_k_ids: token ", tp[r], " is not in 0..", slots - 1);
  std::vector<int64_t> ids(rows * k);
  parallel_rows(rows, 2, [&](int64_t r0, int64_t r1) {
    const NextAbove find = next_above();
    for (int64_t r = r0; r < r1; ++r) top_k_row(xp + r * n, n, k, find, ids.data() + r * k);
  });
  int32_t* out = table.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k; ++j) out[tp[r] * k + j] = static_cast<int32_t>(ids[r * k + j]);
}

torch::Tensor logsumexp_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) >= 1,
              "logsumexp_rows: x must be [R, V] float32 with V >= 1");
  const int64_t rows = x.size(0), n = x.size(1);
  auto xc = x.contiguous();
  torch::Tensor out = torch::empty({rows}, torch::kFloat32);
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_rows(rows, 2, [&](int64_t r0, int64_t r1) {
    const RowLse lse = row_lse();
    for (int64_t r = r0; r < r1; ++r) op[r] = lse(xp + r * n, n);
  });
  return out;
}

torch::Tensor top2_probs_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) >= 2,
              "top2_probs_rows: x must be [R, V] float32 with V >= 2");
  const int64_t rows = x.size(0), n = x.size(1);
  auto xc = x.contiguous();
  torch::Tensor out = torch::empty({rows, 2}, torch::kFloat32);
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_rows(rows, 2, [&](int64_t r0, int64_t r1) {
    const RowLse lse = row_lse();
    const NextAbove find = next_above();
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * n;
      int64_t ids[2];
      top_k_row(row, n, 2, find, ids);
      const float total = lse(row, n);
      for (int j = 0; j < 2; ++j) op[r * 2 + j] = ids[j] < 0 ? 0.f : std::exp(row[ids[j]] - total);
    }
  });
  return out;
}

}  // namespace sf
