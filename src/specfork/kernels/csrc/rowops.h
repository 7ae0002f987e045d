// Row-wise steps shared by the decoder (model.cpp) and the draft head (head.cpp).
#pragma once
#include <cstdint>
#include <vector>

namespace sf {

// y = x / rms(x) * w over n values (y may be x).
void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* y);
// y = act(gate) * up over n values; act is SiLU, or GELU (tanh form) when `gelu`.
void activation(const float* gate, const float* up, int64_t n, bool gelu, float* y);
// cos/sin tables [T, half] of positions `pos` for inverse frequencies inv [half], times `scaling`.
void rope_tables(const float* inv, float scaling, const int64_t* pos, int64_t T, int64_t half,
                 std::vector<float>& cos_t, std::vector<float>& sin_t);
// Rotates rows r0..r1-1 of x (row stride ld; nheads heads of head_dim each, halves rotated).
void rope_rows(float* x, int64_t ld, int64_t r0, int64_t r1, int64_t nheads, int64_t head_dim,
               const std::vector<float>& cos_t, const std::vector<float>& sin_t);

}  // namespace sf
