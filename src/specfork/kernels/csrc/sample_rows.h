// Temperature sampling from rows of logits in a few vectorised passes: the softmax at a
// temperature and the inverse-CDF draw, which as PyTorch ops (max, subtract, divide, softmax,
// sum, a float64 cumsum, searchsorted) took ~0.2 ms a row right after a forward.
#pragma once
#include <torch/extension.h>

namespace sf {

// x [R, V] float32 → float32 [R, V]: softmax(x / t) per row with inv_t = 1 / t >= 0, computed as
// exp((x − max) · inv_t) / Σ in one fixed order per row (inv_t 0, a temperature past float32's
// range: uniform over the finite logits, as PyTorch's x / t gives it). A −inf logit gets probability exactly 0;
// a row holding NaN or +inf, or only −inf, comes out all NaN (as PyTorch's softmax gives it).
torch::Tensor softmax_rows(torch::Tensor x, double inv_t);

// p [R, V] float32 (rows of non-negative mass, totals need not be 1), u [R] float64 in [0, 1)
// → int64 [R]: per row the first index whose cumulative mass (float64) exceeds u · total, so a
// zero-probability index is never drawn; -1 for a row whose total is not finite and positive.
torch::Tensor sample_rows(torch::Tensor p, torch::Tensor u);

}  // namespace sf
