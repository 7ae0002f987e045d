// FastHead: the EAGLE-3-style draft head's decoder layer (specfork/heads/model.py) over packed
// weights, so a draft step is one call instead of a score of small PyTorch operations:
//
//   x = embed_norm(e) ⊕ hidden_norm(f);  q, k, v = qkv(x), rotated;  new k, v → the head's cache
//   h = f + o(attention(q, cache));  g = h + down(silu(gate) · up),  gate|up = gate_up(post_norm(h))
//
// `fuse` is the fc over the target's concatenated features and `logits` the draft LM head over
// norm(g). Python keeps the cache and decides which slots each row sees; drafts need not be
// batch-invariant (verification decides what is kept), but every step here is row-wise anyway.
#include "head.h"

#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "attention.h"
#include "common.h"
#include "gemm.h"
#include "packed.h"
#include "rowops.h"

namespace sf {

namespace {

torch::Tensor float_rows(const torch::Tensor& x, int64_t width, const char* what) {
  auto t = x.to(torch::kFloat32).contiguous();
  check(t.dim() >= 1 && t.size(-1) == width, std::string(what) + " has the wrong width");
  return t.view({-1, width});
}

}  // namespace

class FastHead {
 public:
  FastHead(int64_t hidden, int64_t heads, int64_t heads_kv, int64_t head_dim, int64_t ffn,
           double eps, double attn_scale)
      : hidden_(hidden), heads_(heads), heads_kv_(heads_kv), head_dim_(head_dim), ffn_(ffn),
        eps_(static_cast<float>(eps)), attn_scale_(static_cast<float>(attn_scale)) {
    check(hidden % kBlock == 0 && ffn % kBlock == 0 && (heads * head_dim) % kBlock == 0,
          "the head needs hidden, FFN and attention sizes that are multiples of 32");
    check(heads_kv > 0 && heads % heads_kv == 0, "query heads must be a multiple of key/value heads");
  }

  void set_rope(torch::Tensor inv_freq, double scaling) {
    inv_ = inv_freq.to(torch::kFloat32).contiguous();
    check(inv_.numel() == head_dim_ / 2, "RoPE frequencies must have head_dim / 2 entries");
    rope_scaling_ = static_cast<float>(scaling);
  }

  // Linear layers fc [D, C·D], qkv [(H + 2 Hkv) hd, 2D], o [D, H hd], gate_up [2F, D],
  // down [D, F], lm_head [Vd, D]; norms (float, [D] each) embed, hidden, post and final.
  void set_weights(PackedPtr fc, PackedPtr qkv, PackedPtr o, PackedPtr gate_up, PackedPtr down,
                   PackedPtr lm_head, torch::Tensor embed_norm, torch::Tensor hidden_norm,
                   torch::Tensor post_norm, torch::Tensor norm) {
    const int64_t D = hidden_, qd = heads_ * head_dim_;
    check(fc->w.n == D && fc->w.k % D == 0, "fc must map C·hidden inputs to hidden outputs");
    check(qkv->w.k == 2 * D && qkv->w.n == qd + 2 * heads_kv_ * head_dim_, "qkv has the wrong shape");
    check(o->w.k == qd && o->w.n == D, "o has the wrong shape");
    check(gate_up->w.k == D && gate_up->w.n == 2 * ffn_, "gate_up has the wrong shape");
    check(down->w.k == ffn_ && down->w.n == D, "down has the wrong shape");
    check(lm_head->w.k == D, "lm_head has the wrong input size");
    fc_ = std::move(fc);
    qkv_w_ = std::move(qkv);
    o_ = std::move(o);
    gate_up_ = std::move(gate_up);
    down_ = std::move(down);
    lm_head_ = std::move(lm_head);
    norms_ = {vec(embed_norm), vec(hidden_norm), vec(post_norm), vec(norm)};
  }

  int64_t draft_vocab() const { return lm_head_ ? lm_head_->w.n : 0; }

  // The target's concatenated block outputs [T, C·D] → fused features [T, D].
  torch::Tensor fuse(torch::Tensor features) {
    ready();
    auto x = float_rows(features, fc_->w.k, "features");
    torch::Tensor out = torch::empty({x.size(0), hidden_}, torch::kFloat32);
    Activations a(x.data_ptr<float>(), x.size(0), fc_->w.k, fc_->w.k);
    linear(fc_->w, a, out.data_ptr<float>(), hidden_);
    return out;
  }

  // Rows of embeddings and features [T, D] at `positions` [T]: their keys and values go to
  // cache slots [start, start + T) of k_cache/v_cache (float32 [1, Hkv, S, hd]); each row
  // attends to the slots `mask` [T, start + T] allows (None: every slot before `start`, and the
  // new rows causally). Returns the outputs g [T, D].
  torch::Tensor rows(torch::Tensor embeds, torch::Tensor feats, torch::Tensor positions,
                     std::optional<torch::Tensor> mask, torch::Tensor k_cache,
                     torch::Tensor v_cache, int64_t start) {
    ready();
    const int64_t D = hidden_, qd = heads_ * head_dim_, kvd = heads_kv_ * head_dim_;
    auto e = float_rows(embeds, D, "embeds");
    auto f = float_rows(feats, D, "feats");
    const int64_t T = e.size(0);
    auto pos = positions.to(torch::kInt64).contiguous();
    check(T > 0 && f.size(0) == T && pos.numel() == T, "embeds, feats and positions need the same rows");
    const KVView kv = cache_view(k_cache, v_cache, start, T);
    const Visible vis = visible(mask, T, start);

    std::vector<float> x(T * 2 * D), qkv(T * qkv_w_->w.n), att(T * qd);
    for (int64_t r = 0; r < T; ++r) {  // x = embed_norm(e) ⊕ hidden_norm(f)
      rmsnorm(e.data_ptr<float>() + r * D, norms_[0].data_ptr<float>(), D, eps_, &x[r * 2 * D]);
      rmsnorm(f.data_ptr<float>() + r * D, norms_[1].data_ptr<float>(), D, eps_, &x[r * 2 * D + D]);
    }
    const int64_t ld = qkv_w_->w.n;
    {
      Activations a(x.data(), T, 2 * D, 2 * D);
      linear(qkv_w_->w, a, qkv.data(), ld);
    }
    std::vector<float> cos_t, sin_t;
    rope_tables(inv_.data_ptr<float>(), rope_scaling_, pos.data_ptr<int64_t>(), T, head_dim_ / 2, cos_t, sin_t);
    float* q = qkv.data();
    rope_rows(q, ld, 0, T, heads_, head_dim_, cos_t, sin_t);
    rope_rows(q + qd, ld, 0, T, heads_kv_, head_dim_, cos_t, sin_t);
    write_kv(kv, q + qd, q + qd + kvd, ld, T, heads_kv_, head_dim_, start);
    attention(q, ld, kv, plan_attention(vis, T), AttnShape{T, heads_, heads_kv_, head_dim_, attn_scale_},
              att.data());

    torch::Tensor out = torch::empty({T, D}, torch::kFloat32);  // g [T, D]
    float* h = out.data_ptr<float>();
    {
      Activations a(att.data(), T, qd, qd);
      linear(o_->w, a, h, D);
    }
    const float* fr = f.data_ptr<float>();
    for (int64_t i = 0; i < T * D; ++i) h[i] += fr[i];  // the residual is the feature
    mlp(h, T);
    return out;
  }

  // Outputs g [T, D] → draft-vocabulary logits [T, Vd] (float32).
  torch::Tensor logits(torch::Tensor g) {
    ready();
    auto x = float_rows(g, hidden_, "g");
    const int64_t T = x.size(0);
    std::vector<float> n(T * hidden_);
    for (int64_t r = 0; r < T; ++r)
      rmsnorm(x.data_ptr<float>() + r * hidden_, norms_[3].data_ptr<float>(), hidden_, eps_, &n[r * hidden_]);
    torch::Tensor out = torch::empty({T, lm_head_->w.n}, torch::kFloat32);
    Activations a(n.data(), T, hidden_, hidden_);
    linear(lm_head_->w, a, out.data_ptr<float>(), lm_head_->w.n);
    return out;
  }

 private:
  static torch::Tensor vec(const torch::Tensor& t) { return t.to(torch::kFloat32).contiguous(); }

  void ready() const { check(lm_head_ != nullptr && inv_.defined(), "the head is not complete"); }

  KVView cache_view(const torch::Tensor& k, const torch::Tensor& v, int64_t start, int64_t T) const {
    check(k.is_contiguous() && v.is_contiguous() && k.dtype() == torch::kFloat32 &&
              v.sizes() == k.sizes() && v.dtype() == k.dtype(),
          "the head's cache must be two contiguous float32 tensors of one shape");
    check(k.dim() == 4 && k.size(0) == 1 && k.size(1) == heads_kv_ && k.size(3) == head_dim_,
          "the head's cache must be [1, heads_kv, slots, head_dim]");
    check(start >= 0 && start + T <= k.size(2), "the new rows do not fit in the head's cache");
    KVView kv;
    kv.k = k.data_ptr();
    kv.v = v.data_ptr();
    kv.type = CacheType::F32;
    kv.slots = k.size(2);
    return kv;
  }

  // Row r sees the slots its mask row allows (ascending), or the causal default.
  static Visible visible(const std::optional<torch::Tensor>& mask, int64_t T, int64_t start) {
    const int64_t S = start + T;
    torch::Tensor m;
    if (mask.has_value()) {
      m = mask->to(torch::kBool).contiguous();
      check(m.numel() == T * S, "the head's mask must be [rows, start + rows]");
    }
    Visible v;
    v.off.assign(T + 1, 0);
    const bool* mp = m.defined() ? m.data_ptr<bool>() : nullptr;
    for (int64_t r = 0; r < T; ++r) {
      for (int64_t j = 0; j < S; ++j)
        if (mp ? mp[r * S + j] : j < start + r + 1) v.idx.push_back(static_cast<int32_t>(j));
      check(static_cast<int64_t>(v.idx.size()) > v.off[r], "every head row must see at least one slot");
      v.off[r + 1] = static_cast<int64_t>(v.idx.size());
    }
    return v;
  }

  // h += down(act(gate) · up) with gate|up = gate_up(post_norm(h)), rows [T, D].
  void mlp(float* h, int64_t T) const {
    const int64_t D = hidden_, F = ffn_;
    std::vector<float> x(T * D), gu(T * 2 * F), a(T * F), y(T * D);
    for (int64_t r = 0; r < T; ++r) rmsnorm(h + r * D, norms_[2].data_ptr<float>(), D, eps_, &x[r * D]);
    {
      Activations in(x.data(), T, D, D);
      linear(gate_up_->w, in, gu.data(), 2 * F);
    }
    for (int64_t r = 0; r < T; ++r) activation(&gu[r * 2 * F], &gu[r * 2 * F + F], F, false, &a[r * F]);
    {
      Activations in(a.data(), T, F, F);
      linear(down_->w, in, y.data(), D);
    }
    for (int64_t i = 0; i < T * D; ++i) h[i] += y[i];
  }

  int64_t hidden_, heads_, heads_kv_, head_dim_, ffn_;
  float eps_, attn_scale_;
  torch::Tensor inv_;
  float rope_scaling_ = 1.f;
  PackedPtr fc_, qkv_w_, o_, gate_up_, down_, lm_head_;
  std::vector<torch::Tensor> norms_;  // embed, hidden, post, final
};

void bind_head(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<FastHead>(m, "FastHead")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("set_rope", &FastHead::set_rope)
      .def("set_weights", &FastHead::set_weights)
      .def("fuse", &FastHead::fuse, py::call_guard<py::gil_scoped_release, sf::FlushDenormals>())
      .def("rows", &FastHead::rows, py::call_guard<py::gil_scoped_release, sf::FlushDenormals>())
      .def("logits", &FastHead::logits, py::call_guard<py::gil_scoped_release, sf::FlushDenormals>())
      .def_property_readonly("draft_vocab", &FastHead::draft_vocab);
}

}  // namespace sf
