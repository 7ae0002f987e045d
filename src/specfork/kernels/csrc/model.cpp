// FastModel: a whole decoder forward (Llama and Gemma 3 families) in one call, over weights
// packed for gemm.cpp and the caller's KV cache. Python keeps the cache, the positions and the
// tree mask; this file only computes. Every step is row-wise or uses the batch-invariant
// kernels, so a row's hidden state never depends on the other rows of the call.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention.h"
#include "common.h"
#include "gemm.h"
#include "head.h"
#include "packed.h"
#include "rowops.h"
#include "logit_rows.h"
#include "sample_rows.h"

namespace sf {

namespace {

// Element-wise steps (norms, rotary embedding, activation, residual) split their rows over the
// threads from this many rows (prompt chunks, wide verifications); fewer run on the caller.
constexpr int64_t kRowsParallel = 16;

struct Norm {
  torch::Tensor w;  // float32, the multiplier itself (Gemma's 1 + w already added)
  bool present() const { return w.defined(); }
};

struct Layer {
  Fused qkv, o, gate_up, down;
  Norm attn_norm, post_attn_norm, mlp_norm, post_mlp_norm, q_norm, k_norm;
  bool sliding = false;
};

CacheType cache_type(const torch::Tensor& t) {
  if (t.dtype() == torch::kFloat32) return CacheType::F32;
  if (t.dtype() == torch::kFloat16) return CacheType::F16;
  if (t.dtype() == torch::kBFloat16) return CacheType::BF16;
  throw std::invalid_argument("the KV cache must be float32, float16 or bfloat16");
}

}  // namespace

class FastModel {
 public:
  FastModel(int64_t hidden, int64_t heads, int64_t heads_kv, int64_t head_dim, int64_t ffn,
            double eps, bool gelu, double embed_scale, int64_t window, double attn_scale,
            double final_softcap)
      : hidden_(hidden), heads_(heads), heads_kv_(heads_kv), head_dim_(head_dim), ffn_(ffn),
        eps_(static_cast<float>(eps)), gelu_(gelu), embed_scale_(static_cast<float>(embed_scale)),
        window_(window), attn_scale_(static_cast<float>(attn_scale)),
        softcap_(static_cast<float>(final_softcap)) {
    check(hidden % kBlock == 0 && ffn % kBlock == 0 && (heads * head_dim) % kBlock == 0,
          "the fast path needs hidden, FFN and attention sizes that are multiples of 32");
    check(heads % heads_kv == 0, "query heads must be a multiple of key/value heads");
  }

  void set_rope(const std::string& kind, torch::Tensor inv_freq, double scaling) {
    auto t = inv_freq.to(torch::kFloat32).contiguous();
    check(t.numel() == head_dim_ / 2, "RoPE frequencies must have head_dim / 2 entries");
    (kind == "sliding" ? rope_local_ : rope_full_) = {t, static_cast<float>(scaling)};
  }

  void set_embedding(PackedPtr table) {
    check(table->w.k == hidden_, "the embedding width must equal the hidden size");
    embed_ = std::move(table);
  }

  void set_head(std::vector<PackedPtr> head, torch::Tensor final_norm) {
    head_ = fuse(head, hidden_);
    final_norm_ = {final_norm.to(torch::kFloat32).contiguous()};
  }

  void add_layer(std::vector<PackedPtr> qkv, std::vector<PackedPtr> o, std::vector<PackedPtr> gate_up,
                 std::vector<PackedPtr> down, std::map<std::string, torch::Tensor> norms,
                 bool sliding) {
    Layer l;
    l.qkv = fuse(qkv, hidden_);
    l.o = fuse(o, heads_ * head_dim_);
    l.gate_up = fuse(gate_up, hidden_);
    l.down = fuse(down, ffn_);
    check(l.qkv.n == (heads_ + 2 * heads_kv_) * head_dim_, "q/k/v output size mismatch");
    check(l.o.n == hidden_ && l.gate_up.n == 2 * ffn_ && l.down.n == hidden_, "layer size mismatch");
    auto get = [&](const char* name) {
      auto it = norms.find(name);
      return it == norms.end() ? Norm{} : Norm{it->second.to(torch::kFloat32).contiguous()};
    };
    l.attn_norm = get("attn_norm");
    l.post_attn_norm = get("post_attn_norm");
    l.mlp_norm = get("mlp_norm");
    l.post_mlp_norm = get("post_mlp_norm");
    l.q_norm = get("q_norm");
    l.k_norm = get("k_norm");
    check(l.attn_norm.present() && l.mlp_norm.present(), "a layer needs attn_norm and mlp_norm");
    l.sliding = sliding;
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // tokens [T] int64, positions [T] int64, mask [T, T] bool or None (causal), caches
  // [L, 1, Hkv, S, D], cache_positions [S] int64 (slots before `start` already filled).
  // `capture` names blocks whose outputs [T, hidden] are copied to captured[j] (float32
  // [C, T, hidden]), for drafters that learn from the target's hidden states.
  torch::Tensor forward(torch::Tensor tokens, torch::Tensor positions,
                        std::optional<torch::Tensor> mask, torch::Tensor k_cache,
                        torch::Tensor v_cache, torch::Tensor cache_positions, int64_t start,
                        std::optional<std::vector<int64_t>> layers,
                        std::vector<int64_t> capture, std::optional<torch::Tensor> captured) {
    const int64_t T = tokens.numel();
    check(positions.numel() == T && T > 0, "tokens and positions must have the same length > 0");
    auto pos = positions.to(torch::kInt64).contiguous();
    std::vector<Seg> segs;
    segs.push_back(segment(pos.data_ptr<int64_t>(), 0, T, mask, k_cache, v_cache, cache_positions, start));
    return run(tokens, pos, segs, layers, capture, captured);
  }

  // Several sequences in one forward: segment i is rows [sum(rows[:i]), sum(rows[:i+1])) of
  // tokens/positions [T], with its own mask [rows_i, rows_i] (an empty tensor: causal), cache
  // and start, as in `forward`. The linear layers run once over all T rows; each segment's
  // rows attend to their own cache only. Rows are batch-invariant, so a sequence's outputs are
  // bitwise those it gets alone.
  torch::Tensor forward_batch(torch::Tensor tokens, torch::Tensor positions,
                              std::vector<int64_t> rows, std::vector<torch::Tensor> masks,
                              std::vector<torch::Tensor> k_caches,
                              std::vector<torch::Tensor> v_caches,
                              std::vector<torch::Tensor> cache_positions,
                              std::vector<int64_t> starts,
                              std::optional<std::vector<int64_t>> layers,
                              std::vector<int64_t> capture, std::optional<torch::Tensor> captured) {
    const size_t n = rows.size();
    check(n > 0 && masks.size() == n && k_caches.size() == n && v_caches.size() == n &&
              cache_positions.size() == n && starts.size() == n,
          "forward_batch needs one mask, cache pair, cache positions and start per segment");
    const int64_t T = tokens.numel();
    check(positions.numel() == T && T > 0, "tokens and positions must have the same length > 0");
    auto pos = positions.to(torch::kInt64).contiguous();
    std::vector<Seg> segs;
    int64_t row0 = 0;
    for (size_t i = 0; i < n; ++i) {
      check(rows[i] > 0 && row0 + rows[i] <= T, "segment rows must be > 0 and add up to T");
      std::optional<torch::Tensor> mask;
      if (masks[i].numel() > 0) mask = masks[i];
      for (size_t j = 0; j < i; ++j)
        check(k_caches[j].data_ptr() != k_caches[i].data_ptr(), "two segments share a cache");
      segs.push_back(segment(pos.data_ptr<int64_t>(), row0, rows[i], mask, k_caches[i],
                             v_caches[i], cache_positions[i], starts[i]));
      row0 += rows[i];
    }
    check(row0 == T, "segment rows must add up to T");
    return run(tokens, pos, segs, layers, capture, captured);
  }

  // tokens [T] int64 → their input embeddings [T, hidden] float32 (scaled as the forward does)
  torch::Tensor embed_tokens(torch::Tensor tokens) {
    check(embed_ != nullptr, "the model is not complete");
    auto tok = tokens.to(torch::kInt64).contiguous();
    torch::Tensor out = torch::empty({tok.numel(), hidden_}, torch::kFloat32);
    embed(tok.data_ptr<int64_t>(), tok.numel(), out.data_ptr<float>());
    return out;
  }

  // hidden [T, hidden] float → float32 logits [T, V]
  torch::Tensor logits(torch::Tensor hidden) {
    auto x = hidden.to(torch::kFloat32).contiguous().view({-1, hidden_});
    const int64_t T = x.size(0);
    torch::Tensor out = torch::empty({T, head_.n}, torch::kFloat32);
    Activations a(x.data_ptr<float>(), T, hidden_, hidden_);
    head_.run(a, out.data_ptr<float>(), head_.n);
    if (softcap_ > 0.f) out = torch::tanh(out / softcap_) * softcap_;
    return out;
  }

 private:
  struct Rope {
    torch::Tensor inv;
    float scaling = 1.f;
  };

  struct Seg {  // one sequence's rows of a forward, its cache and its attention plans
    int64_t row0, rows, start, slots;
    torch::Tensor k, v;  // [L, 1, Hkv, S, D]
    CacheType type;
    AttnPlan full, local;

    KVView view(int64_t layer, int64_t per_layer) const {
      KVView kv;
      kv.type = type;
      kv.slots = slots;
      const int64_t esize = k.element_size();
      kv.k = static_cast<char*>(k.data_ptr()) + layer * per_layer * esize;
      kv.v = static_cast<char*>(v.data_ptr()) + layer * per_layer * esize;
      return kv;
    }
  };

  // Rows [row0, row0 + T) of positions `pos`, their mask, cache and first new slot.
  Seg segment(const int64_t* pos, int64_t row0, int64_t T, const std::optional<torch::Tensor>& mask,
              const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const torch::Tensor& cache_positions, int64_t start) const {
    check(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
    check(k_cache.dim() == 5 && k_cache.size(1) == 1 && k_cache.size(2) == heads_kv_ &&
              k_cache.size(4) == head_dim_ && v_cache.sizes() == k_cache.sizes() &&
              k_cache.size(0) >= num_layers(),
          "the KV cache has the wrong shape");
    check(v_cache.dtype() == k_cache.dtype(), "keys and values must have one dtype");
    const int64_t slots = k_cache.size(3);
    check(start >= 0 && start + T <= slots, "the new tokens do not fit in the cache");
    auto kpos = cache_positions.to(torch::kInt64).contiguous();
    check(kpos.numel() >= start, "cache positions must cover the filled slots");
    const bool* m = nullptr;
    torch::Tensor mask_c;
    if (mask.has_value()) {
      mask_c = mask->to(torch::kBool).contiguous();
      check(mask_c.numel() == T * T, "the tree mask must be [T, T]");
      m = mask_c.data_ptr<bool>();
    }
    const int64_t* p = pos + row0;
    Seg s{row0, T, start, slots, k_cache, v_cache, cache_type(k_cache), {}, {}};
    s.full = plan_attention(visible(p, T, m, kpos.data_ptr<int64_t>(), start, -1), T);
    if (window_ > 0) s.local = plan_attention(visible(p, T, m, kpos.data_ptr<int64_t>(), start, window_), T);
    return s;
  }

  torch::Tensor run(const torch::Tensor& tokens, const torch::Tensor& pos, const std::vector<Seg>& segs,
                    const std::optional<std::vector<int64_t>>& layers,
                    const std::vector<int64_t>& capture, const std::optional<torch::Tensor>& captured) {
    check(embed_ != nullptr && head_.n > 0, "the model is not complete");
    const int64_t T = tokens.numel();
    auto tok = tokens.to(torch::kInt64).contiguous();
    torch::Tensor out = torch::empty({T, hidden_}, torch::kFloat32);
    float* h = out.data_ptr<float>();
    embed(tok.data_ptr<int64_t>(), T, h);

    std::vector<float> cos_full, sin_full, cos_local, sin_local;
    rope_tables(rope_full_, pos.data_ptr<int64_t>(), T, cos_full, sin_full);
    if (rope_local_.inv.defined()) rope_tables(rope_local_, pos.data_ptr<int64_t>(), T, cos_local, sin_local);

    std::vector<int64_t> run;
    if (layers.has_value()) {
      run = *layers;
    } else {
      for (int64_t i = 0; i < num_layers(); ++i) run.push_back(i);
    }
    float* cap = nullptr;
    if (!capture.empty()) {
      check(captured.has_value() && captured->is_contiguous() &&
                captured->dtype() == torch::kFloat32 && captured->dim() == 3 &&
                captured->size(0) == static_cast<int64_t>(capture.size()) &&
                captured->size(1) == T && captured->size(2) == hidden_,
            "captured must be a contiguous float32 [C, T, hidden] tensor");
      cap = captured->data_ptr<float>();
      for (int64_t c : capture)
        check(std::find(run.begin(), run.end(), c) != run.end(), "a captured layer is not run");
    }
    for (int64_t i : run) {
      check(i >= 0 && i < num_layers(), "layer index out of range");
      const Layer& l = layers_[i];
      const bool local = l.sliding && window_ > 0;
      const bool own_rope = l.sliding && rope_local_.inv.defined();
      block(l, i, h, T, segs, local, own_rope ? cos_local : cos_full, own_rope ? sin_local : sin_full);
      for (size_t j = 0; j < capture.size(); ++j)
        if (capture[j] == i) std::memcpy(cap + j * T * hidden_, h, sizeof(float) * T * hidden_);
    }
    norm_rows(h, T, final_norm_.w.data_ptr<float>(), h);
    return out;
  }

  void embed(const int64_t* tok, int64_t T, float* h) const {
    for (int64_t r = 0; r < T; ++r) {
      check(tok[r] >= 0 && tok[r] < embed_->w.n, "token id out of range");
      unpack_row(embed_->w, tok[r], h + r * hidden_);
      if (embed_scale_ != 1.f)
        for (int64_t i = 0; i < hidden_; ++i) h[r * hidden_ + i] *= embed_scale_;
    }
  }

  void rope_tables(const Rope& rope, const int64_t* pos, int64_t T, std::vector<float>& cos_t,
                   std::vector<float>& sin_t) const {
    sf::rope_tables(rope.inv.data_ptr<float>(), rope.scaling, pos, T, head_dim_ / 2, cos_t, sin_t);
  }

  // Row r sees every filled slot (within the window) and the new slots its mask row allows.
  static Visible visible(const int64_t* pos, int64_t T, const bool* mask, const int64_t* kpos,
                         int64_t start, int64_t window) {
    Visible v;
    v.off.resize(T + 1);
    v.off[0] = 0;
    for (int64_t r = 0; r < T; ++r) {
      for (int64_t j = 0; j < start; ++j)
        if (window < 0 || pos[r] - kpos[j] < window) v.idx.push_back(static_cast<int32_t>(j));
      for (int64_t i = 0; i < T; ++i) {
        const bool allowed = mask ? mask[r * T + i] : i <= r;
        if (allowed && (window < 0 || pos[r] - pos[i] < window))
          v.idx.push_back(static_cast<int32_t>(start + i));
      }
      v.off[r + 1] = static_cast<int64_t>(v.idx.size());
    }
    return v;
  }

  void block(const Layer& l, int64_t layer, float* h, int64_t T, const std::vector<Seg>& segs,
             bool local, const std::vector<float>& cos_t, const std::vector<float>& sin_t) {
    const int64_t D = hidden_, qd = heads_ * head_dim_, kvd = heads_kv_ * head_dim_;
    x_.resize(T * std::max(D, ffn_));
    qkv_.resize(T * l.qkv.n);
    att_.resize(T * qd);
    gu_.resize(T * 2 * ffn_);
    y_.resize(T * D);
    // attention
    norm_rows(h, T, l.attn_norm.w.data_ptr<float>(), x_.data());
    {
      Activations a(x_.data(), T, D, D);
      l.qkv.run(a, qkv_.data(), l.qkv.n);
    }
    const int64_t ld = l.qkv.n;
    float* q = qkv_.data();
    float* k = q + qd;
    float* v = k + kvd;
    parallel_rows(T, kRowsParallel, [&](int64_t r0, int64_t r1) {
      if (l.q_norm.present())
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t hh = 0; hh < heads_; ++hh)
            rmsnorm(q + r * ld + hh * head_dim_, l.q_norm.w.data_ptr<float>(), head_dim_, eps_, q + r * ld + hh * head_dim_);
          for (int64_t hh = 0; hh < heads_kv_; ++hh)
            rmsnorm(k + r * ld + hh * head_dim_, l.k_norm.w.data_ptr<float>(), head_dim_, eps_, k + r * ld + hh * head_dim_);
        }
      rope_rows(q, ld, r0, r1, heads_, head_dim_, cos_t, sin_t);
      rope_rows(k, ld, r0, r1, heads_kv_, head_dim_, cos_t, sin_t);
    });
    const int64_t per_layer = heads_kv_ * head_dim_;  // times slots, per segment
    std::vector<AttnPart> parts;  // each sequence's rows attend to its own cache
    for (const Seg& s : segs) {
      const KVView kv = s.view(layer, per_layer * s.slots);
      const int64_t off = s.row0 * ld;
      write_kv(kv, k + off, v + off, ld, s.rows, heads_kv_, head_dim_, s.start);
      parts.push_back(AttnPart{kv, local ? &s.local : &s.full, s.row0, s.rows});
    }
    attention_parts(q, ld, parts, AttnShape{T, heads_, heads_kv_, head_dim_, attn_scale_}, att_.data());
    {
      Activations a(att_.data(), T, qd, qd);
      l.o.run(a, x_.data(), D);
    }
    add_residual(l.post_attn_norm, x_.data(), T, h);
    // MLP
    norm_rows(h, T, l.mlp_norm.w.data_ptr<float>(), x_.data());
    {
      Activations a(x_.data(), T, D, D);
      l.gate_up.run(a, gu_.data(), 2 * ffn_);
    }
    parallel_rows(T, kRowsParallel, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        activation(&gu_[r * 2 * ffn_], &gu_[r * 2 * ffn_ + ffn_], ffn_, gelu_, &x_[r * ffn_]);
    });
    {
      Activations a(x_.data(), T, ffn_, ffn_);
      l.down.run(a, y_.data(), D);
    }
    add_residual(l.post_mlp_norm, y_.data(), T, h);
  }

  // h += norm(y) (Gemma's post-norms) or h += y
  void add_residual(const Norm& post, float* y, int64_t T, float* h) const {
    parallel_rows(T, kRowsParallel, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* yr = y + r * hidden_;
        if (post.present()) rmsnorm(yr, post.w.data_ptr<float>(), hidden_, eps_, yr);
        for (int64_t i = 0; i < hidden_; ++i) h[r * hidden_ + i] += yr[i];
      }
    });
  }

  // y[r] = rmsnorm(x[r]) * w for T rows of hidden_ (y may be x).
  void norm_rows(const float* x, int64_t T, const float* w, float* y) const {
    parallel_rows(T, kRowsParallel, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) rmsnorm(x + r * hidden_, w, hidden_, eps_, y + r * hidden_);
    });
  }

  int64_t hidden_, heads_, heads_kv_, head_dim_, ffn_;
  float eps_;
  bool gelu_;
  float embed_scale_;
  int64_t window_;
  float attn_scale_, softcap_;
  Rope rope_full_, rope_local_;
  PackedPtr embed_;
  Fused head_;
  Norm final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> x_, qkv_, att_, gu_, y_;  // work buffers, reused
};

// y = x W^T (+ b) for tests and benchmarks: x [R, k] float32.
torch::Tensor packed_linear(const PackedPtr& w, torch::Tensor x) {
  auto xc = x.to(torch::kFloat32).contiguous().view({-1, w->w.k});
  torch::Tensor y = torch::empty({xc.size(0), w->w.n}, torch::kFloat32);
  Activations a(xc.data_ptr<float>(), xc.size(0), w->w.k, w->w.k);
  linear(w->w, a, y.data_ptr<float>(), w->w.n);
  return y;
}

// out [R, H, D] = softmax(q k^T * scale) v per row and head, row r seeing the cache slots
// idx[off[r] .. off[r + 1]) (ascending) of k, v [H_kv, S, D] (float32, float16 or bfloat16): the
// attention a forward runs, for tests and benchmarks. q [R, H, D] float32.
torch::Tensor attention_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor idx,
                             torch::Tensor off, double scale) {
  check(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.dtype() == v.dtype(),
        "q must be [R, H, D] and k, v alike [H_kv, S, D]");
  check(q.size(2) == k.size(2) && q.size(1) % k.size(0) == 0, "q and k, v shapes do not agree");
  const int64_t R = q.size(0);
  check(off.numel() == R + 1, "off must hold R + 1 offsets");
  auto qc = q.to(torch::kFloat32).contiguous();
  auto kc = k.contiguous(), vc = v.contiguous();
  auto ic = idx.to(torch::kInt32).contiguous();
  auto oc = off.to(torch::kInt64).contiguous();
  Visible vis;
  vis.idx.assign(ic.data_ptr<int32_t>(), ic.data_ptr<int32_t>() + ic.numel());
  vis.off.assign(oc.data_ptr<int64_t>(), oc.data_ptr<int64_t>() + oc.numel());
  check(vis.off.front() == 0 && vis.off.back() == static_cast<int64_t>(vis.idx.size()),
        "off must run from 0 to the number of slots in idx");
  for (int64_t r = 0; r < R; ++r) {
    check(vis.off[r + 1] > vis.off[r], "every row must see at least one slot");
    for (int64_t i = vis.off[r]; i < vis.off[r + 1]; ++i)
      check(vis.idx[i] >= 0 && vis.idx[i] < k.size(1) && (i == vis.off[r] || vis.idx[i] > vis.idx[i - 1]),
            "each row's slots must be ascending cache slots");
  }
  const AttnPlan plan = plan_attention(std::move(vis), R);
  const KVView kv{kc.data_ptr(), vc.data_ptr(), cache_type(kc), k.size(1)};
  torch::Tensor out = torch::empty(q.sizes(), torch::kFloat32);
  const AttnShape shape{R, q.size(1), k.size(0), q.size(2), static_cast<float>(scale)};
  attention(qc.data_ptr<float>(), q.size(1) * q.size(2), kv, plan, shape, out.data_ptr<float>());
  return out;
}

torch::Tensor unpack(const PackedPtr& w) {
  torch::Tensor out = torch::empty({w->w.n, w->w.k}, torch::kFloat32);
  for (int64_t r = 0; r < w->w.n; ++r) unpack_row(w->w, r, out.data_ptr<float>() + r * w->w.k);
  return out;
}

}  // namespace sf

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<sf::Packed, sf::PackedPtr>(m, "Packed")
      .def(py::init<int64_t, int64_t, int64_t, torch::Tensor, std::optional<torch::Tensor>>(),
           py::arg("kind"), py::arg("n"), py::arg("k"), py::arg("data"), py::arg("bias") = py::none())
      .def_property_readonly("n", [](const sf::Packed& p) { return p.w.n; })
      .def_property_readonly("k", [](const sf::Packed& p) { return p.w.k; })
      .def_property_readonly("kind", [](const sf::Packed& p) { return static_cast<int64_t>(p.w.kind); })
      .def_property_readonly("nbytes", [](const sf::Packed& p) { return p.data.numel(); });
  py::class_<sf::FastModel>(m, "FastModel")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, bool, double, int64_t, double,
                    double>())
      .def("set_rope", &sf::FastModel::set_rope)
      .def("set_embedding", &sf::FastModel::set_embedding)
      .def("set_head", &sf::FastModel::set_head)
      .def("add_layer", &sf::FastModel::add_layer)
      .def("forward", &sf::FastModel::forward, py::call_guard<py::gil_scoped_release, sf::FlushDenormals>())
      .def("forward_batch", &sf::FastModel::forward_batch, py::call_guard<py::gil_scoped_release, sf::FlushDenormals>())
      .def("logits", &sf::FastModel::logits, py::call_guard<py::gil_scoped_release, sf::FlushDenormals>())
      .def("embed_tokens", &sf::FastModel::embed_tokens)
      .def_property_readonly("num_layers", &sf::FastModel::num_layers);
  sf::bind_head(m);
  m.def("packed_linear", &sf::packed_linear, py::call_guard<py::gil_scoped_release, sf::FlushDenormals>());
  m.def("unpack", &sf::unpack);
  m.def("attention_rows", &sf::attention_rows, py::call_guard<py::gil_scoped_release, sf::FlushDenormals>());
  m.def("top_k_ids", &sf::top_k_ids, py::arg("x"), py::arg("k"),
        py::call_guard<py::gil_scoped_release, sf::FlushDenormals>());
  m.def("put_top_k_ids", &sf::put_top_k_ids, py::arg("table"), py::arg("tokens"), py::arg("x"),
        py::call_guard<py::gil_scoped_release, sf::FlushDenormals>());
  m.def("logsumexp_rows", &sf::logsumexp_rows, py::call_guard<py::gil_scoped_release, sf::FlushDenormals>());
  m.def("top2_probs_rows", &sf::top2_probs_rows, py::call_guard<py::gil_scoped_release, sf::FlushDenormals>());
  m.def("softmax_rows", &sf::softmax_rows, py::arg("x"), py::arg("inv_t"),
        py::call_guard<py::gil_scoped_release, sf::FlushDenormals>());
  m.def("sample_rows", &sf::sample_rows, py::arg("p"), py::arg("u"),
        py::call_guard<py::gil_scoped_release, sf::FlushDenormals>());
  m.def("isa", []() { return std::string(sf::isa_name()); });
  m.def("threads", &sf::pool_threads);
  m.def("active_threads", &sf::pool_active);
  m.def("set_threads", &sf::set_pool_threads, py::arg("threads"), py::arg("adaptive"),
        py::call_guard<py::gil_scoped_release, sf::FlushDenormals>());
  m.def("backoff_trace", &sf::backoff_trace, py::arg("most"), py::arg("shares"),
        py::arg("window_seconds"));
  m.def("thread_counts", []() {  // (regions, reduced, windows, busy): pool.h PoolCounts
    const sf::PoolCounts c = sf::pool_counts();
    return std::make_tuple(c.regions, c.reduced, c.windows, c.busy);
  });
  m.def("block_bytes", [](int64_t kind) { return sf::block_bytes(static_cast<sf::Kind>(kind)); });
}
