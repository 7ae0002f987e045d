// Packed weights as Python hands them over (a `Packed` owns its tensors) and several of them
// reading one input (`Fused`: q|k|v, gate|up), shared by the decoder (model.cpp) and the draft
// head (head.cpp).
#pragma once
#include <torch/extension.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "gemm.h"

namespace sf {

inline void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

// A packed weight and the tensors that own its memory.
struct Packed {
  PackedLinear w;
  torch::Tensor data, bias;
  Packed(int64_t kind, int64_t n, int64_t k, torch::Tensor data_, std::optional<torch::Tensor> bias_)
      : data(std::move(data_)) {
    check(kind >= 0 && kind <= 6, "unknown weight kind");
    check(k % kBlock == 0, "packed weights need an input size that is a multiple of 32");
    w.kind = static_cast<Kind>(kind);
    w.n = n;
    w.k = k;
    const int64_t tiles = (n + kTile - 1) / kTile;
    check(data.dtype() == torch::kUInt8 && data.is_contiguous() && data.device().is_cpu(),
          "packed data must be a contiguous uint8 CPU tensor");
    check(data.numel() == tiles * (k / kBlock) * block_bytes(w.kind), "packed data has the wrong size");
    w.data = data.data_ptr<uint8_t>();
    if (bias_.has_value()) {
      bias = bias_->to(torch::kFloat32).contiguous();
      check(bias.numel() == n, "bias size does not match the weight");
      w.bias = bias.data_ptr<float>();
    }
  }
};
using PackedPtr = std::shared_ptr<Packed>;

// Several packed weights reading the same input, outputs side by side (q|k|v, gate|up).
struct Fused {
  std::vector<PackedPtr> parts;
  int64_t n = 0;
  void run(Activations& a, float* y, int64_t ldy) const {
    std::vector<const PackedLinear*> ws;
    for (const auto& p : parts) ws.push_back(&p->w);
    linear_fused(ws, a, y, ldy);
  }
};

inline Fused fuse(const std::vector<PackedPtr>& parts, int64_t k) {
  Fused f{parts, 0};
  check(!parts.empty(), "a linear layer needs at least one weight");
  for (const auto& p : parts) {
    check(p->w.k == k, "weight input size does not match the layer");
    f.n += p->w.n;
  }
  return f;
}

}  // namespace sf
