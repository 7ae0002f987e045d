// Linear layers y = x W^T + b over packed weights, batch-invariant by construction.
//
// A weight [n, k] is stored in tiles of 16 output columns; each tile is a run of blocks of 32
// inputs, each block laid out for one kernel (`block_bytes`):
//   Q4   (GGUF Q4_0/Q4_1): 4-bit codes q, value = d*q + m with fp16 d, m per column and block.
//        256 bytes of nibbles (4 vectors of 64; byte 4c+j of vector i holds, for column c,
//        input 8i+j in its low nibble and input 8i+4+j in its high nibble), 32 bytes of d, 32 of m.
//   Q8   (GGUF Q8_0): int8 codes q stored as q+128, value = d*q. 8 vectors of 64 (byte 4c+j of
//        vector g: column c, input 4g+j), then 32 bytes of d.
//   BF16: 16 vectors of 64 (bf16 element 2c+e of vector p: column c, input 2p+e).
//   F32:  32 vectors of 64 (float c of vector i: column c, input i).
//   Q4F  (GGUF Q4_K): Q4's nibbles, then float32 d and m (64 bytes each): a K-quant sub-block's
//        scale d*sc and min -dmin*m are exact in float32, not in fp16.
//   Q8H  (GGUF Q6_K): Q8's codes (q+128), then float32 d of inputs 0-15 and of inputs 16-31
//        (64 bytes each): Q6_K scales every 16 inputs.
//   Q8A  (GGUF Q5_K, Q5_1): unsigned codes q (0-127, stored as they are) in Q8's layout, value
//        d*q + m with float32 d and m (64 bytes each), as Q4F.
// Every kind but BF16 and F32 multiplies int8 activations (one scale per row and block of 32, as
// llama.cpp does) with integer dot products; the float accumulation over blocks runs in block
// order (Q8H: the block's first half, then its second), one output at a time, whatever the
// number of rows or threads.
#pragma once

#include <cstdint>
#include <vector>

namespace sf {

enum class Kind : int64_t { Q4 = 0, Q8 = 1, BF16 = 2, F32 = 3, Q4F = 4, Q8H = 5, Q8A = 6 };

// Kinds whose products take int8 activations (`Activations::q`).
constexpr bool int8_kind(Kind k) { return k != Kind::BF16 && k != Kind::F32; }
// Q4 and Q4F: 4-bit codes (nibbles); Q8, Q8H and Q8A: a byte per code.
constexpr bool q4_layout(Kind k) { return k == Kind::Q4 || k == Kind::Q4F; }
// Q4, Q4F and Q8A: value d*q + m (a scale and a min per column and block); Q8, Q8H: d*q.
constexpr bool affine(Kind k) { return q4_layout(k) || k == Kind::Q8A; }
// Where a block's scales start (the mins follow: 32 bytes on for fp16, 64 for float32).
constexpr int64_t scales_at(Kind k) { return q4_layout(k) ? 256 : 512; }

constexpr int64_t kTile = 16;   // output columns per tile
constexpr int64_t kBlock = 32;  // inputs per block

int64_t block_bytes(Kind kind);

struct PackedLinear {
  Kind kind = Kind::F32;
  int64_t n = 0;  // output columns
  int64_t k = 0;  // inputs (a multiple of 32)
  const uint8_t* data = nullptr;  // [ceil(n/16)][k/32][block_bytes]
  const float* bias = nullptr;    // [n] or null
};

// Rows of activations [rows, k] (float32, row stride ld) with the forms the kernels consume,
// made on first use and kept for every weight that reads the same input.
class Activations {
 public:
  Activations(const float* x, int64_t rows, int64_t k, int64_t ld);
  const float* x;
  int64_t rows, k, ld;
  void need(Kind kind);
  // int8 codes [rows, k] and per block scale d, d*sum(q) and sum(q) [rows, k/32]
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> s;
  std::vector<int32_t> s16;  // sum(q) of each half block [rows, k/16] (for Q8H)
  std::vector<uint16_t> bf;  // bf16 copy [rows, k]

 private:
  bool have_q_ = false, have_bf_ = false, have_s16_ = false;
};

// y[r, 0:n] = x[r] . W^T (+ bias) for every row; y has row stride ldy.
void linear(const PackedLinear& w, Activations& a, float* y, int64_t ldy);
// Several weights reading the same input (q|k|v, gate|up), outputs side by side in y: one
// parallel pass over all their tiles (each tile computed as `linear` computes it).
void linear_fused(const std::vector<const PackedLinear*>& ws, Activations& a, float* y, int64_t ldy);

// Tiles t0..t1-1 of w for every row of `a` on AVX2 (gemm_avx2.cpp; x86 builds only).
void tiles_avx2(const PackedLinear& w, const Activations& a, int64_t t0, int64_t t1, float* y,
                int64_t ldy);

// The float value of weight (row, col) of a packed matrix (for embedding lookups and tests).
void unpack_row(const PackedLinear& w, int64_t row, float* out);

}  // namespace sf
