// Temperature sampling from rows of logits (sample_rows.h).
//
// The draw sums the row in blocks of kBlock entries (float64, four independent sums), finds the
// block where the cumulative mass passes u · total, then walks that block one entry at a time: two
// reads of the row where a sequential float64 cumsum of 49,152 entries is a dependency chain of
// as many additions.
#include "sample_rows.h"

#include <cmath>
#include <limits>
#include <vector>

#include "common.h"
#include "vecmath.h"

namespace sf {

namespace {

constexpr int64_t kBlock = 512;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Whether a row's max makes a softmax: finite and no NaN anywhere in the row.
bool softmax_defined(float m, bool nan) { return !nan && std::isfinite(m); }

void fill_nan(float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::numeric_limits<float>::quiet_NaN();
}

// The scalar passes over x[i, n) (a vector body's tail, or the whole row): the max and whether
// a NaN was seen; exp((x − m) · inv_t) into out (−inf: exactly 0), returning `sum` plus theirs
// (added in order); out times scale.
void max_from(const float* x, int64_t i, int64_t n, float& m, bool& nan) {
  for (; i < n; ++i) {
    nan |= x[i] != x[i];
    m = x[i] > m ? x[i] : m;
  }
}

float exp_from(const float* x, int64_t i, int64_t n, float m, float inv_t, float* out,
               float sum) {
  for (; i < n; ++i) {
    out[i] = x[i] == -kInf ? 0.f : std::exp((x[i] - m) * inv_t);
    sum += out[i];
  }
  return sum;
}

void scale_from(float* out, int64_t i, int64_t n, float scale) {
  for (; i < n; ++i) out[i] *= scale;
}

void softmax_generic(const float* x, int64_t n, float inv_t, float* out) {
  float m = -kInf;
  bool nan = false;
  max_from(x, 0, n, m, nan);
  if (!softmax_defined(m, nan)) return fill_nan(out, n);
  const float sum = exp_from(x, 0, n, m, inv_t, out, 0.f);
  scale_from(out, 0, n, 1.f / sum);
}

#if SF_X86
SF_AVX512 void softmax_avx512(const float* x, int64_t n, float inv_t, float* out) {
  const int64_t body = n - n % 16;
  __m512 mv = _mm512_set1_ps(-kInf);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < body; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  float m = _mm512_reduce_max_ps(mv);
  bool any_nan = nan != 0;
  max_from(x, body, n, m, any_nan);
  if (!softmax_defined(m, any_nan)) return fill_nan(out, n);
  const __m512 mm = _mm512_set1_ps(m), it = _mm512_set1_ps(inv_t), ninf = _mm512_set1_ps(-kInf);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < body; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 live = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);  // −inf: exactly 0
    const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_mul_ps(_mm512_sub_ps(v, mm), it)));
    _mm512_storeu_ps(out + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  const float sum = exp_from(x, body, n, m, inv_t, out, _mm512_reduce_add_ps(acc));
  const __m512 scale = _mm512_set1_ps(1.f / sum);
  for (int64_t i = 0; i < body; i += 16)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(out + i), scale));
  scale_from(out, body, n, 1.f / sum);
}

SF_AVX2 void softmax_avx2(const float* x, int64_t n, float inv_t, float* out) {
  const int64_t body = n - n % 8;
  __m256 mv = _mm256_set1_ps(-kInf);
  int nan = 0;
  for (int64_t i = 0; i < body; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mv = _mm256_max_ps(mv, v);
  }
  float m = hmax256(mv);
  bool any_nan = nan != 0;
  max_from(x, body, n, m, any_nan);
  if (!softmax_defined(m, any_nan)) return fill_nan(out, n);
  const __m256 mm = _mm256_set1_ps(m), it = _mm256_set1_ps(inv_t), ninf = _mm256_set1_ps(-kInf);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < body; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 live = _mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ);  // −inf: exactly 0
    const __m256 e = _mm256_and_ps(live, exp256(_mm256_mul_ps(_mm256_sub_ps(v, mm), it)));
    _mm256_storeu_ps(out + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  const float sum = exp_from(x, body, n, m, inv_t, out, hsum256(acc));
  const __m256 scale = _mm256_set1_ps(1.f / sum);
  for (int64_t i = 0; i < body; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(out + i), scale));
  scale_from(out, body, n, 1.f / sum);
}
#endif

using RowSoftmax = void (*)(const float*, int64_t, float, float*);

RowSoftmax row_softmax() {
#if SF_X86
  if (isa_level() >= kAvx512) return softmax_avx512;
  if (isa_level() >= kAvx2) return softmax_avx2;
#endif
  return softmax_generic;
}

// The mass of p[begin, end) in float64, four independent sums (a fixed order).
double block_mass(const float* p, int64_t begin, int64_t end) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = begin;
  for (; i + 4 <= end; i += 4)
    for (int j = 0; j < 4; ++j) s[j] += static_cast<double>(p[i + j]);
  for (; i < end; ++i) s[0] += static_cast<double>(p[i]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// The first index whose cumulative mass exceeds u · total (see sample_rows.h), -1 without mass.
int64_t draw_row(const float* p, int64_t n, double u, std::vector<double>& blocks) {
  const int64_t count = (n + kBlock - 1) / kBlock;
  blocks.resize(count);
  double total = 0.0;
  for (int64_t b = 0; b < count; ++b) {
    blocks[b] = block_mass(p, b * kBlock, std::min(n, (b + 1) * kBlock));
    total += blocks[b];
  }
  if (!(total > 0.0) || !std::isfinite(total)) return -1;
  const double point = u * total;
  double acc = 0.0;
  int64_t b = 0;
  while (b + 1 < count && acc + blocks[b] <= point) acc += blocks[b++];
  int64_t last = -1;  // the last index with mass seen: where rounding leaves the walk
  for (int64_t i = b * kBlock; i < n; ++i) {
    if (p[i] > 0.f) last = i;
    acc += static_cast<double>(p[i]);
    if (acc > point && p[i] > 0.f) return i;
  }
  if (last >= 0) return last;
  for (int64_t i = b * kBlock - 1; i >= 0; --i)  // the mass was all before the block
    if (p[i] > 0.f) return i;
  return -1;
}

}  // namespace

torch::Tensor softmax_rows(torch::Tensor x, double inv_t) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) >= 1,
              "softmax_rows: x must be [R, V] float32 with V >= 1");
  TORCH_CHECK(inv_t >= 0 && std::isfinite(inv_t), "softmax_rows: inv_t must be finite and >= 0");
  const int64_t rows = x.size(0), n = x.size(1);
  auto xc = x.contiguous();
  torch::Tensor out = torch::empty({rows, n}, torch::kFloat32);
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float it = static_cast<float>(inv_t);
  parallel_rows(rows, 2, [&](int64_t r0, int64_t r1) {
    const RowSoftmax softmax = row_softmax();
    for (int64_t r = r0; r < r1; ++r) softmax(xp + r * n, n, it, op + r * n);
  });
  return out;
}

torch::Tensor sample_rows(torch::Tensor p, torch::Tensor u) {
  TORCH_CHECK(p.dim() == 2 && p.scalar_type() == torch::kFloat32 && p.size(1) >= 1,
              "sample_rows: p must be [R, V] float32 with V >= 1");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == torch::kFloat64 && u.size(0) == p.size(0),
              "sample_rows: u must be [R] float64, one per row");
  const int64_t rows = p.size(0), n = p.size(1);
  auto pc = p.contiguous();
  auto uc = u.contiguous();
  torch::Tensor out = torch::empty({rows}, torch::kInt64);
  const float* pp = pc.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  std::vector<double> blocks;
  for (int64_t r = 0; r < rows; ++r) op[r] = draw_row(pp + r * n, n, up[r], blocks);
  return out;
}

}  // namespace sf
