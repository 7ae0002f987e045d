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

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <memory>
#include <optional>
#include <vector>

#include "attention.h"
#include "common.h"
#include "gemm.h"
#include "logit_rows.h"
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
    const int64_t D = hidden_;
    auto e = float_rows(embeds, D, "embeds");
    auto f = float_rows(feats, D, "feats");
    const int64_t T = e.size(0);
    auto pos = positions.to(torch::kInt64).contiguous();
    check(T > 0 && f.size(0) == T && pos.numel() == T, "embeds, feats and positions need the same rows");
    const KVView kv = cache_view(k_cache, v_cache, start, T);
    torch::Tensor out = torch::empty({T, D}, torch::kFloat32);  // g [T, D]
    run_rows(e.data_ptr<float>(), f.data_ptr<float>(), pos.data_ptr<int64_t>(), T,
             visible(mask, T, start), kv, start, out.data_ptr<float>());
    return out;
  }

  // A greedy chain below the head's output `root` [D] (the parent of its first token, at
  // sequence `position`), its rows written to cache slots [start, start + n - 1), each row
  // attending causally to every slot before it. The first tokens are `forced` (draft-vocabulary
  // ids) while the head gives each at least `keep` times the
  // probability of its own favourite; from the first one it does not, the head's own argmax.
  // `rule` (float [5]: w_top1, w_margin, w_ema · ema, margin_scale, low; empty: none) stops the
  // chain before an own token whose confidence is below low (DSpark's step rule). At most
  // `depth` tokens. Returns (ids [n] draft-vocabulary ids, p [n] the head's probability of each
  // token) — one call instead of two kernel calls, an argmax and an embedding per step.
  std::tuple<torch::Tensor, torch::Tensor> chain(
      torch::Tensor root, torch::Tensor forced, double keep, int64_t depth, torch::Tensor rule,
      torch::Tensor k_cache, torch::Tensor v_cache, int64_t start, int64_t position) {
    ready();
    check(embeds_.defined(), "the head's chain needs its draft-vocabulary embeddings (set_embeddings)");
    const int64_t D = hidden_, Vd = lm_head_->w.n;
    auto g = float_rows(root, D, "root");
    check(g.size(0) == 1, "the chain's root is one output [hidden]");
    auto fz = forced.to(torch::kInt64).contiguous();
    auto rz = rule.to(torch::kFloat32).contiguous();
    check(rz.numel() == 0 || rz.numel() == 5, "the chain's stop rule has 5 numbers or none");
    check(depth >= 0, "the chain's depth must be >= 0");
    const int64_t* fp = fz.data_ptr<int64_t>();
    const int64_t m = fz.numel();
    const KVView kv = cache_view(k_cache, v_cache, start, std::max<int64_t>(depth - 1, 0));
    std::vector<int64_t> ids;
    std::vector<float> probs, cur(g.data_ptr<float>(), g.data_ptr<float>() + D), next(D), logit(Vd);
    bool forcing = m > 0;
    for (int64_t i = 0; i < depth; ++i) {
      logits_row(cur.data(), logit.data());
      const Top2 t = top2(logit.data(), Vd);
      int64_t token = -1;
      float p = 0.f;
      if (forcing && i < m) {
        const int64_t f = fp[i];
        check(f >= 0 && f < Vd, "a forced token is not a draft-vocabulary id");
        const float ratio = std::exp(logit[f] - t.l1);
        if (ratio >= keep) {
          token = f;
          p = ratio / t.sum;
        } else {
          forcing = false;
        }
      } else {
        forcing = false;
      }
      if (token < 0) {
        const float top1 = 1.f / t.sum, margin = top1 - std::exp(t.l2 - t.l1) / t.sum;
        if (rz.numel() == 5) {
          const float* r = rz.data_ptr<float>();
          const float value = (r[0] * top1 + r[1] * std::min(r[3] * margin, 1.f) + r[2]);
          if (value < r[4]) break;
        }
        token = t.i1;
        p = top1;
      }
      ids.push_back(token);
      probs.push_back(p);
      if (i + 1 == depth) break;
      const int64_t pos = position + i;
      run_rows(embeds_.data_ptr<float>() + token * D, cur.data(), &pos, 1, visible({}, 1, start + i),
               kv, start + i, next.data());
      cur.swap(next);
    }
    auto out_ids = torch::tensor(ids, torch::kInt64);
    auto out_p = torch::tensor(probs, torch::kFloat32);
    return {out_ids, out_p};
  }

  // The embeddings of the draft vocabulary's tokens [Vd, D] (float32), for `chain`.
  void set_embeddings(torch::Tensor table) {
    ready();
    auto t = table.to(torch::kFloat32).contiguous();
    check(t.dim() == 2 && t.size(0) == lm_head_->w.n && t.size(1) == hidden_,
          "the draft-vocabulary embeddings must be [draft vocab, hidden]");
    embeds_ = t;
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
  struct Top2 {
    int64_t i1;
    float l1, l2, sum;  // the best two logits and Σ exp(l − l1)
  };

  // The best two of logits [n] (the first index wins a tie, as torch's argmax) and the
  // softmax's normaliser relative to the best.
  static Top2 top2(const float* l, int64_t n) {
    Top2 t{0, l[0], -INFINITY, 0.f};
    for (int64_t j = 1; j < n; ++j) {
      if (l[j] > t.l1) {
        t.l2 = t.l1;
        t.l1 = l[j];
        t.i1 = j;
      } else if (l[j] > t.l2) {
        t.l2 = l[j];
      }
    }
    t.sum = std::exp(logsumexp_row(l, n) - t.l1);
    return t;
  }

  // One output g [D] → its draft logits [Vd].
  void logits_row(const float* g, float* out) const {
    std::vector<float> n(hidden_);
    rmsnorm(g, norms_[3].data_ptr<float>(), hidden_, eps_, n.data());
    Activations a(n.data(), 1, hidden_, hidden_);
    linear(lm_head_->w, a, out, lm_head_->w.n);
  }

  // The decoder layer over T rows (embeddings e, features f [T, D] at positions pos [T]):
  // keys and values to cache slots [start, start + T), attention by `vis`, outputs g [T, D].
  void run_rows(const float* e, const float* f, const int64_t* pos, int64_t T, const Visible& vis,
                const KVView& kv, int64_t start, float* h) const {
    const int64_t D = hidden_, qd = heads_ * head_dim_, kvd = heads_kv_ * head_dim_;
    std::vector<float> x(T * 2 * D), qkv(T * qkv_w_->w.n), att(T * qd);
    for (int64_t r = 0; r < T; ++r) {  // x = embed_norm(e) ⊕ hidden_norm(f)
      rmsnorm(e + r * D, norms_[0].data_ptr<float>(), D, eps_, &x[r * 2 * D]);
      rmsnorm(f + r * D, norms_[1].data_ptr<float>(), D, eps_, &x[r * 2 * D + D]);
    }
    const int64_t ld = qkv_w_->w.n;
    {
      Activations a(x.data(), T, 2 * D, 2 * D);
      linear(qkv_w_->w, a, qkv.data(), ld);
    }
    std::vector<float> cos_t, sin_t;
    rope_tables(inv_.data_ptr<float>(), rope_scaling_, pos, T, head_dim_ / 2, cos_t, sin_t);
    float* q = qkv.data();
    rope_rows(q, ld, 0, T, heads_, head_dim_, cos_t, sin_t);
    rope_rows(q + qd, ld, 0, T, heads_kv_, head_dim_, cos_t, sin_t);
    write_kv(kv, q + qd, q + qd + kvd, ld, T, heads_kv_, head_dim_, start);
    attention(q, ld, kv, plan_attention(vis, T), AttnShape{T, heads_, heads_kv_, head_dim_, attn_scale_},
              att.data());
    {
      Activations a(att.data(), T, qd, qd);
      linear(o_->w, a, h, D);
    }
    for (int64_t i = 0; i < T * D; ++i) h[i] += f[i];  // the residual is the feature
    mlp(h, T);
  }

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
  torch::Tensor embeds_;  // [Vd, D] float32, for chain
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
      .def("chain", &FastHead::chain, py::call_guard<py::gil_scoped_release, sf::FlushDenormals>())
      .def("set_embeddings", &FastHead::set_embeddings)
      .def_property_readonly("draft_vocab", &FastHead::draft_vocab);
}

}  // namespace sf
