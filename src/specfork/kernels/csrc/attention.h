// Attention of new rows over a KV cache.
//
// Each row attends to an explicit, ascending list of cache slots (its prefix, its tree
// ancestors and itself). The list is cut by rank into chunks of kChunk slots; a chunk yields a
// partial softmax (its max, its sum of exponentials and the weighted sum of its values), and
// the partials are merged in chunk order. Every step runs over ranks, never over slot
// positions, so a row's output is the same whatever other rows share the call and wherever
// its keys sit in the cache: a token verified in a tree gets the value plain decoding gives it.
// Rows whose chunk is the same run of slots (a shared prefix) are computed together, reading
// those keys and values once for all of them.
#pragma once

#include <cstdint>
#include <vector>

namespace sf {

enum class CacheType : int { F32 = 0, F16 = 1, BF16 = 2 };

constexpr int64_t kChunk = 128;  // slots per chunk of a row's visible list

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

// One chunk computed for several rows: the chunk's slots, and for each row its chunk index.
// Rows share a task when their chunk is a contiguous run of slots from the same first slot
// (a prefix, a prompt's causal rows): the keys/values are read once, and each row attends to
// the first lens[i] of them — its own chunk, in its own order, so nothing changes in its result.
struct ChunkTask {
  int64_t first;  // the chunk's n ascending slots are vis.idx[first .. first + n)
  int64_t n;  // the longest of its rows' chunks
  std::vector<int32_t> rows;
  int64_t chunk;  // the chunk's index in each of those rows' lists
  std::vector<int32_t> lens;  // each row's chunk length (<= n)
};

// The chunk tasks of one set of visible lists (built once per forward and layer type).
struct AttnPlan {
  Visible vis;
  std::vector<ChunkTask> tasks;
  std::vector<int64_t> chunks;  // chunks per row
  int64_t max_chunks = 0;
  int64_t max_rows = 0;  // most rows in one task
};

AttnPlan plan_attention(Visible vis, int64_t rows);

struct AttnShape {
  int64_t rows, heads, heads_kv, head_dim;
  float scale;
};

// Store new keys/values [rows, heads_kv, head_dim] (float) into slots start .. start+rows.
void write_kv(const KVView& kv, const float* k, const float* v, int64_t ld, int64_t rows,
              int64_t heads_kv, int64_t head_dim, int64_t start);

// out [rows, heads, head_dim] = softmax(q k^T * scale) v over each row's visible slots.
void attention(const float* q, int64_t ldq, const KVView& kv, const AttnPlan& plan,
               const AttnShape& shape, float* out);

// Rows [row0, row0 + rows) of a batched forward: one sequence's cache and plan.
struct AttnPart {
  KVView kv;
  const AttnPlan* plan;
  int64_t row0, rows;
};

// `attention` for several sequences at once (shape.rows: all parts' rows), in one parallel
// pass: each row's output is bitwise what it gets alone.
void attention_parts(const float* q, int64_t ldq, const std::vector<AttnPart>& parts,
                     const AttnShape& shape, float* out);

}  // namespace sf
