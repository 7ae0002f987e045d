// Reductions over rows of logits that a decoding round needs besides the argmax: the k best
// ids (Token Recycling's table) and the log of the softmax's normaliser (DSpark's confidence).
#pragma once
#include <torch/extension.h>

namespace sf {

// x [R, V] float32 → int64 [R, k]: each row's k largest entries' indices, largest first, an
// earlier index first among equal values (NaN never chosen; -1 where a row has fewer than k
// other values). 1 <= k <= V.
torch::Tensor top_k_ids(torch::Tensor x, int64_t k);

// table [N, k] int32 (contiguous), tokens [R] int64 in [0, N), x [R, V] float32: table[tokens[r]]
// = top_k_ids(x, k)[r] in place, rows in order (a token's later row wins). One call for what a
// recycle table learns from a round: the torch ops it replaces cost ~100 µs after a forward has
// flushed the caches.
void put_top_k_ids(torch::Tensor table, torch::Tensor tokens, torch::Tensor x);

// x [R, V] float32 → float32 [R]: log Σ_j exp(x[r, j]), computed as max + log Σ exp(x − max)
// in one fixed order per row (the same value whatever the rows or threads).
torch::Tensor logsumexp_rows(torch::Tensor x);

// x [R, V] float32 (V >= 2) → float32 [R, 2]: the softmax probabilities of each row's two largest
// entries (top_k_ids' order), exp(x − logsumexp): DSpark's top-1 and margin in one call.
torch::Tensor top2_probs_rows(torch::Tensor x);

// The same for one row x [n] (n >= 1).
float logsumexp_row(const float* x, int64_t n);

}  // namespace sf
