// Attention of new rows over a KV cache, one (row, query head) at a time.
//
// Each row attends to an explicit, ascending list of cache slots (its prefix, its tree
// ancestors and itself). Scores, the softmax sum and the weighted sum of values all run over
// that list by rank, so a row's output is the same whatever other rows share the call and
// wherever its keys sit in the cache: a token verified in a tree gets the value plain decoding
// gives it.
#pragma once

#include <cstdint>
#include <vector>

namespace sf {

enum class CacheType : int { F32 = 0, F16 = 1, BF16 = 2 };

struct KVView {  // one layer's keys and values [heads_kv, slots, head_dim]
  void* k = nullptr;
  void* v = nullptr;
  CacheType type = CacheType::F32;
  int64_t slots = 0;  // slots per head (the cache's capacity)
};

// Row r sees slots idx[off[r] .. off[r+1]) (ascending).
struct Visible {
  std::vector<int32_t> idx;
  std::vector<int64_t> off;
};

struct AttnShape {
  int64_t rows, heads, heads_kv, head_dim;
  float scale;
};

// Store new keys/values [rows, heads_kv, head_dim] (float) into slots start .. start+rows.
void write_kv(const KVView& kv, const float* k, const float* v, int64_t ld, int64_t rows,
              int64_t heads_kv, int64_t head_dim, int64_t start);

// out [rows, heads, head_dim] = softmax(q k^T * scale) v over each row's visible slots.
void attention(const float* q, int64_t ldq, const KVView& kv, const Visible& vis,
               const AttnShape& shape, float* out);

}  // namespace sf
