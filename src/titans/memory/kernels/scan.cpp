// The fused scan's chunk loop (fused.py: `_chunk_forward`, `_chunk_backward`, `_run_chunks`, `_backward_chunks`)
// in C++, line for line, so that it runs outside the interpreter and on every core at once.
//
// In Python a chunk is ~400 small ATen calls between its state kernels: ~30 ms a training step of interpreter
// and ~45 ms of small operations that each run on one core while the other waits (README, "Where a step goes").
// Here the batch·heads rows are cut into one slice per thread, and each thread runs the whole chunk loop for its
// slice (the slices never meet: each memory is its own recurrence); the state kernels then run inside a slice on
// one thread each. With fewer rows than threads there is one slice, and the kernels share the threads as before.
//
// The Python functions stay the reference: `tests/memory/test_native_scan.py` holds this loop to them in float64
// (≤ 1e-12, values and gradients) and in float32 with the kernels. Products go through the kernels where
// `kernel_serves` says so (the one rule, which Python's `state_ops.kernels_for` asks too); anything else through the
// ATen products below.
#include "losses.h"
#include "state_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using torch::Tensor;
using State = std::vector<Tensor>;  // [W_1, S_1, W_2, S_2, …], each [BH, d_in, d_out]
using Blocks = std::vector<std::vector<Tensor>>;  // decays of the full chunks (chunk dim 1), then of a ragged tail

// fused.ScanConfig with its rule (memory/rule.py, MemoryRule), as `fused.native_config` builds it: the one place the
// rule crosses to C++.
struct Config {
  int64_t chunk_size = 16;
  bool gelu = true;  // σ: gelu, else silu
  bool residual = false;
  std::optional<double> max_grad_norm;
  std::optional<double> max_state_norm;
  bool normalize_chunk = false;  // the normalised chunk step
  double hidden_step = 1.0;  // ρ, the step of every layer but the last as a fraction of θ
  bool record = false;  // the backward pass follows: keep σ'(p_i) and what the loss's backward reads
  Loss loss;  // the inner loss (losses.h)

  double layer_step(size_t i, size_t depth) const { return i + 1 < depth ? hidden_step : 1.0; }
};

// fused.ScanInputs: a sequence's (or a chunk's) per-token inputs, or their gradients; loss_gate undefined without one.
struct Inputs {
  Tensor q, k, v, theta, loss_gate;

  Inputs span(int64_t t0, int64_t t1) const {
    auto cut = [&](const Tensor& t) { return t.defined() ? t.slice(1, t0, t1) : t; };
    return {cut(q), cut(k), cut(v), cut(theta), cut(loss_gate)};
  }
  Inputs rows(int64_t b0, int64_t n) const {
    auto cut = [&](const Tensor& t) { return t.defined() ? t.narrow(0, b0, n) : t; };
    return {cut(q), cut(k), cut(v), cut(theta), cut(loss_gate)};
  }
};

// fused.ChunkDecays of one chunk.
struct Decays {
  Tensor beta, c, D, E_last, e_last;
};

// --- the products: kernels where they serve, ATen otherwise ---------------------------------------------------

// Whether the state kernels serve a product of `rows` rows against the state W [batch, K, N]: the one rule, for
// this loop and for Python (`state_ops.kernels_for`, which also checks its other operands' dtype and device).
// float32 on the CPU, W contiguous with N a multiple of 16 (the kernels' vector width), at least kMinRows rows.
bool kernel_serves(const Tensor& W, int64_t rows) {
  return kStateKernels && W.device().is_cpu() && W.scalar_type() == at::kFloat && W.dim() == 3 &&
         W.is_contiguous() && W.size(2) % 16 == 0 && rows >= kMinRows;
}

Tensor inner_contiguous(const Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); }

// out (+)= x W
Tensor prod_xw(const Tensor& x, const Tensor& W, Tensor out = Tensor(), bool accumulate = false) {
  if (kernel_serves(W, x.size(1)) && (!out.defined() || out.is_contiguous())) {
    if (!out.defined()) out = at::empty({x.size(0), x.size(1), W.size(2)}, x.options());
    xw(x, W, out, accumulate);
    return out;
  }
  if (accumulate) return out.baddbmm_(x, W);
  return out.defined() ? at::bmm_out(out, x, W) : at::bmm(x, W);
}

// out (+)= g Wᵀ
Tensor prod_xwt(const Tensor& g, const Tensor& W, Tensor out = Tensor(), bool accumulate = false) {
  if (kernel_serves(W, g.size(1)) && (!out.defined() || out.is_contiguous())) {
    if (!out.defined()) out = at::empty({g.size(0), g.size(1), W.size(1)}, g.options());
    xwt(inner_contiguous(g), W, out, accumulate);
    return out;
  }
  if (accumulate) return out.baddbmm_(g, W.transpose(1, 2));
  return out.defined() ? at::bmm_out(out, g, W.transpose(1, 2)) : at::bmm(g, W.transpose(1, 2));
}

struct Reads {
  Tensor dots, xW, xS, gWt, gPt;  // as state_ops.Reads; dots in the state's dtype
};

struct Combine {  // the optional arguments of state_ops.combine
  c10::optional<Tensor> S, c, P, out2, e, x, Q;
  c10::optional<RowBlocks> G2, gt;
};

Tensor cat_rows(const RowBlocks& blocks) { return blocks.size() == 1 ? blocks[0] : at::cat(blocks, 1); }

// state_ops.combine: out = β W (+ c S) + α Aᵀ G and the products of the same reads.
Reads combine_any(Tensor out, const Tensor& W, const Tensor& beta, const RowBlocks& A, const RowBlocks& G,
                  double alpha, const Combine& o) {
  int64_t rows = 0;
  for (const auto& a : A) rows += a.size(1);
  if (kernel_serves(W, rows)) {
    RowBlocks G_, G2_, gt_;
    for (const auto& g : G) G_.push_back(inner_contiguous(g));
    if (o.G2)
      for (const auto& g : *o.G2) G2_.push_back(inner_contiguous(g));
    if (o.gt)
      for (const auto& g : *o.gt) gt_.push_back(inner_contiguous(g));
    auto r = combine(out, W, beta, o.S, o.c, A, G_, alpha, o.P, o.out2, o.e,
                     o.G2 ? c10::optional<RowBlocks>(G2_) : c10::nullopt, o.x,
                     o.gt ? c10::optional<RowBlocks>(gt_) : c10::nullopt, o.Q);
    return {r[0].defined() ? r[0].to(W.scalar_type()) : r[0], r[1], r[2], r[3], r[4]};
  }
  // The ATen reference (state_ops.combine_reference): everything read before `out` is written.
  Reads r;
  if (o.P) {
    auto flat_dot = [&](const Tensor& y) { return (*o.P * y).sum({1, 2}); };
    r.dots = at::stack({flat_dot(W), o.S ? flat_dot(*o.S) : at::zeros({W.size(0)}, W.options())}, 1);
  }
  if (o.x) r.xW = at::bmm(*o.x, W), r.xS = at::bmm(*o.x, *o.S);
  if (o.gt) {
    const auto& gt = *o.gt;
    r.gWt = at::bmm(gt[0], W.transpose(1, 2)).baddbmm_(gt[1], o.S->transpose(1, 2));
    r.gPt = at::bmm(gt[2], o.P->transpose(1, 2)).baddbmm_(gt[3], o.Q->transpose(1, 2));
  }
  if (o.out2) combine_any(*o.out2, *o.S, *o.e, A, *o.G2, alpha, {});
  at::mul_out(out, W, beta.reshape({-1, 1, 1}));
  if (o.S) out.addcmul_(*o.S, o.c->reshape({-1, 1, 1}));
  out.baddbmm_(cat_rows(A).transpose(1, 2), cat_rows(G), 1.0, alpha);
  return r;
}

// The three passes of the scan that use combine, named as in state_ops.py (update_state, momentum_grad,
// weight_grad; their docstrings say what each computes).
struct Pair {
  Tensor W, S;
};

// W' = β_n W + c_n S − aᵀ G_W, S' = e_n S − aᵀ G_S into `next`; returns (h W, h S) read before the writes.
Pair update_state(const Pair& next, const Pair& state, const Tensor& beta_n, const Tensor& c_n, const Tensor& e_n,
                  const Tensor& a, const Pair& steps, const Tensor& h) {
  Combine o;
  o.S = state.S, o.c = c_n, o.out2 = next.S, o.e = e_n, o.G2 = RowBlocks{steps.S}, o.x = h;
  const auto r = combine_any(next.W, state.W, beta_n, {a}, {steps.W}, -1.0, o);
  return {r.xW, r.xS};
}

struct MomentumGrad {
  Tensor d_e, d_c, a_dS, a_dW, a_grad, h_grad;  // as state_ops.MomentumGrad
};

// ∂S⁰ = e_n ∂S' + c_n ∂W' + hᵀ g_S into `out`, and the other products of ∂W', ∂S', W and S of the same pass;
// update: the update's coefficient rows (G_W, G_S), query: the queries' gradient rows (g_W, g_S).
MomentumGrad momentum_grad(const Tensor& out, const Pair& d_next, const Pair& state, const Tensor& c_n,
                           const Tensor& e_n, const Tensor& h, const Tensor& a, const Pair& update,
                           const Pair& query) {
  Combine o;
  o.S = d_next.W, o.c = c_n, o.P = state.S, o.x = a, o.gt = RowBlocks{update.S, update.W, query.S, query.W},
  o.Q = state.W;
  const auto r = combine_any(out, d_next.S, e_n, {h}, {query.S}, 1.0, o);
  return {r.dots.select(1, 0), r.dots.select(1, 1), r.xW, r.xS, r.gWt, r.gPt};
}

// ∂W⁰ = β_n ∂W' + Σ_j L_jᵀ R_j into `out`; returns ∂β_n = ⟨W, ∂W'⟩.
Tensor weight_grad(const Tensor& out, const Tensor& d_next_W, const Tensor& beta_n, const RowBlocks& left,
                   const RowBlocks& right, const Tensor& W) {
  Combine o;
  o.P = W;
  return combine_any(out, d_next_W, beta_n, left, right, 1.0, o).dots.select(1, 0);
}

// --- the memory network's activation (mlp.ACTIVATIONS, mlp.ACTIVATION_VJPS) --------------------------------

Tensor sigma(const Config& cfg, const Tensor& z) { return cfg.gelu ? at::gelu(z) : at::silu(z); }

Tensor sigma_vjp(const Config& cfg, const Tensor& g, const Tensor& z) {
  return cfg.gelu ? at::gelu_backward(g, z) : at::silu_backward(g, z);
}

Tensor sigma_grad2(const Config& cfg, const Tensor& z) {
  if (cfg.gelu) return at::exp(-0.5 * z * z) * (1.0 / std::sqrt(2.0 * M_PI)) * (2.0 - z * z);
  const auto s = at::sigmoid(z);
  return s * (1.0 - s) * (2.0 + z * (1.0 - 2.0 * s));
}

// --- one chunk ------------------------------------------------------------------------------------------

// fused.ChunkCache
struct Cache {
  std::vector<Tensor> a, p, m, delta, step, dsigma, h, hW, hS, r, h_a, C_h_a;  // step: ρ_i δ_i
  Tensor theta, scale, sq_norm, norm, C, u_m;  // norm: undefined without the normalised chunk step
  Tensor error, gate;  // e = M(k) − v where the loss's backward reads it; the loss's gate (both undefined otherwise)
};

// fused._chunk_forward: y_t into y_out and, unless new_state is null, the state after the chunk.
Cache chunk_forward(const Config& cfg, const State& state, const Inputs& x, const Decays& dec, Tensor y_out,
                    const State* new_state) {
  const size_t depth = state.size() / 2;
  const auto &q = x.q, &k = x.k, &v = x.v;
  Tensor theta = x.theta;
  Cache cc;
  cc.a.resize(depth), cc.p.resize(depth), cc.m.resize(depth), cc.delta.resize(depth), cc.dsigma.resize(depth);
  // Keys at the chunk's starting weights: ℓ_t = Σ_j h(M(k_t) − v_t)_j (eq. 12, h the loss) and its δ, from g = h'.
  Tensor h = k;
  for (size_t i = 0; i < depth; ++i) {
    cc.a[i] = h;
    cc.p[i] = prod_xw(h, state[2 * i]);
    h = i + 1 < depth ? sigma(cfg, cc.p[i]) : cc.p[i];
  }
  const auto error = (cfg.residual ? k + h : h) - v;
  cc.delta[depth - 1] = cfg.loss.grad(error, x.loss_gate);
  if (cfg.record && cfg.loss.needs_error()) cc.error = error;
  cc.gate = x.loss_gate;
  for (size_t i = depth - 1; i-- > 0;) {
    cc.m[i] = prod_xwt(cc.delta[i + 1], state[2 * (i + 1)]);
    if (cfg.record) {
      cc.dsigma[i] = sigma_vjp(cfg, at::ones_like(cc.p[i]), cc.p[i]);
      cc.delta[i] = cc.m[i] * cc.dsigma[i];
    } else {
      cc.delta[i] = sigma_vjp(cfg, cc.m[i], cc.p[i]);
    }
  }
  if (cfg.max_grad_norm) {  // mlp.token_grad_sq_norm, mlp.grad_norm_scale
    const double bound = *cfg.max_grad_norm;
    cc.sq_norm = at::zeros_like(theta);
    for (size_t i = 0; i < depth; ++i)
      cc.sq_norm += (cc.a[i] * cc.a[i]).sum(-1) * (cc.delta[i] * cc.delta[i]).sum(-1);
    cc.scale = bound * at::rsqrt(cc.sq_norm.clamp_min(bound * bound));
    theta = theta * cc.scale;
  }
  cc.theta = theta;
  cc.C = dec.D * theta.unsqueeze(-2);
  cc.u_m = theta * dec.E_last;
  if (cfg.normalize_chunk) {  // mlp.chunk_step_norm: K[t,s] = G_ss / Σ_{r≤t} |G_sr| for s ≤ t
    Tensor gram = at::zeros_like(cc.C);
    for (size_t i = 0; i < depth; ++i)
      gram += at::bmm(cc.a[i], cc.a[i].transpose(1, 2)) * at::bmm(cc.delta[i], cc.delta[i].transpose(1, 2));
    const auto overlap = gram.abs().cumsum(-1);
    const auto own = gram.diagonal(0, -2, -1).unsqueeze(-1);
    const double tiny = gram.scalar_type() == at::kFloat ? std::numeric_limits<float>::min()
                                                         : std::numeric_limits<double>::min();
    cc.norm = (own / overlap.clamp_min(tiny)).transpose(-1, -2).tril();
    cc.C = cc.C * cc.norm;
    cc.u_m = cc.u_m * cc.norm.select(1, -1);
  }
  const auto beta = dec.beta.unsqueeze(-1), c = dec.c.unsqueeze(-1);
  const auto u_w = cc.C.select(1, -1).unsqueeze(-1), u_m = cc.u_m.unsqueeze(-1);
  // The hidden layers step ρ θ: their a_sᵀ δ_s terms scaled after the bounds above saw the whole gradient.
  for (size_t i = 0; i < depth; ++i) {
    const double rho = cfg.layer_step(i, depth);
    cc.step.push_back(rho == 1.0 ? cc.delta[i] : cc.delta[i] * rho);
  }
  // Queries at W_t, layer by layer, and the state after the chunk (DESIGN.md §2 steps 3–4), one pass over W⁰, S⁰.
  h = q;
  for (size_t i = 0; i < depth; ++i) {
    const auto &W = state[2 * i], &S = state[2 * i + 1];
    cc.h.push_back(h);
    if (new_state) {
      const Pair steps{u_w * cc.step[i], u_m * cc.step[i]};
      const auto reads = update_state({(*new_state)[2 * i], (*new_state)[2 * i + 1]}, {W, S}, dec.beta.select(1, -1),
                                      dec.c.select(1, -1), dec.e_last, cc.a[i], steps, h);
      cc.hW.push_back(reads.W), cc.hS.push_back(reads.S);
    } else {
      cc.hW.push_back(prod_xw(h, W)), cc.hS.push_back(prod_xw(h, S));
    }
    auto r = cc.hW[i] * beta;
    r.addcmul_(cc.hS[i], c);
    cc.h_a.push_back(at::bmm(h, cc.a[i].transpose(1, 2)));
    cc.C_h_a.push_back(cc.C * cc.h_a[i]);
    r.baddbmm_(cc.C_h_a[i], cc.step[i], 1.0, -1.0);
    cc.r.push_back(r);
    h = i + 1 < depth ? sigma(cfg, r) : r;
  }
  if (cfg.residual)
    at::add_out(y_out, q, h);
  else
    y_out.copy_(h);
  return cc;
}

struct Grads {
  Inputs inputs;  // gradients w.r.t. q, k, v, θ and the loss's gate (undefined without one)
  Decays decays;  // gradients w.r.t. the Decays fields
};

// fused._chunk_backward (the derivation is there): writes ∂L/∂(W⁰, S⁰) into d_state given ∂L/∂(W, S after) d_new.
Grads chunk_backward(const Config& cfg, const State& state, const Cache& cc, const Tensor& theta, const Decays& dec,
                     const Tensor& dy, const State& d_new, const State& d_state) {
  const size_t depth = state.size() / 2;
  const auto &C = cc.C, &th = cc.theta, &u_m = cc.u_m;
  const auto u_w = C.select(1, -1);
  auto d_u_w = at::zeros_like(u_w), d_u_m = at::zeros_like(u_m);
  auto d_c_n = at::zeros_like(dec.e_last), d_e_n = at::zeros_like(dec.e_last);
  auto d_beta = at::zeros_like(dec.beta), d_c = at::zeros_like(dec.c), d_C = at::zeros_like(C);
  const auto beta = dec.beta.unsqueeze(-1), c = dec.c.unsqueeze(-1);
  std::vector<Tensor> d_delta(depth), d_a(depth), d_p(depth);
  std::vector<RowBlocks> w_left(depth), w_right(depth);
  Tensor d_r = dy;
  Tensor d_q = cfg.residual ? dy.clone() : at::zeros_like(cc.h[0]);
  // 1–2. State update and queries, last layer first.
  for (size_t i = depth; i-- > 0;) {
    const auto &W = state[2 * i], &S = state[2 * i + 1];
    const auto g_w = beta * d_r, g_s = c * d_r;
    const auto& step = cc.step[i];
    const auto g_u_w = u_w.unsqueeze(-1) * step, g_u_m = u_m.unsqueeze(-1) * step;
    const auto reads = momentum_grad(d_state[2 * i + 1], {d_new[2 * i], d_new[2 * i + 1]}, {W, S}, dec.c.select(1, -1),
                                     dec.e_last, cc.h[i], cc.a[i], {g_u_w, g_u_m}, {g_w, g_s});
    const auto &a_dS = reads.a_dS, &a_dW = reads.a_dW;
    auto d_h = reads.h_grad;
    d_e_n += reads.d_e;
    d_c_n += reads.d_c;
    d_delta[i] = -(u_w.unsqueeze(-1) * a_dW + u_m.unsqueeze(-1) * a_dS);
    d_u_w -= (a_dW * step).sum(-1);
    d_u_m -= (a_dS * step).sum(-1);
    d_a[i] = reads.a_grad.neg_();
    d_beta += (d_r * cc.hW[i]).sum(-1);
    d_c += (d_r * cc.hS[i]).sum(-1);
    w_left[i].push_back(cc.h[i]), w_right[i].push_back(g_w);
    const auto r_d = at::bmm(d_r, step.transpose(1, 2));  // r −= (C ⊙ h aᵀ) ρ δ
    d_C -= r_d * cc.h_a[i];
    const auto M = C * r_d;
    d_h.baddbmm_(M, cc.a[i], 1.0, -1.0);
    d_a[i].baddbmm_(M.transpose(1, 2), cc.h[i], 1.0, -1.0);
    d_delta[i].baddbmm_(cc.C_h_a[i].transpose(1, 2), d_r, 1.0, -1.0);
    if (cfg.layer_step(i, depth) != 1.0) d_delta[i].mul_(cfg.layer_step(i, depth));  // of ρ δ_i so far: of δ_i
    if (i > 0)
      d_r = sigma_vjp(cfg, d_h, cc.r[i - 1]);
    else
      d_q += d_h;
  }
  // 3. θ.
  d_C.select(1, -1).add_(d_u_w);
  if (cc.norm.defined()) {  // K is a constant to the outer gradient
    d_C *= cc.norm;
    d_u_m *= cc.norm.select(1, -1);
  }
  const auto d_th = (d_C * dec.D).sum(-2) + d_u_m * dec.E_last;
  const auto d_D = d_C * th.unsqueeze(-2);
  const auto d_E_last = d_u_m * th;
  auto d_theta = d_th;
  if (cfg.max_grad_norm) {
    const double bound = *cfg.max_grad_norm;
    d_theta = d_th * cc.scale;
    const auto above = cc.sq_norm > bound * bound;
    const auto d_sq = at::where(above, -0.5 * d_th * theta * cc.scale / cc.sq_norm.clamp_min(1e-30), 0.0);
    for (size_t i = 0; i < depth; ++i) {
      const auto sa = (cc.a[i] * cc.a[i]).sum(-1), sd = (cc.delta[i] * cc.delta[i]).sum(-1);
      d_a[i] += (2.0 * d_sq * sd).unsqueeze(-1) * cc.a[i];
      d_delta[i] += (2.0 * d_sq * sa).unsqueeze(-1) * cc.delta[i];
    }
  }
  // 4. δ recursion.
  for (size_t i = 0; i + 1 < depth; ++i) {
    const auto d_m = d_delta[i] * cc.dsigma[i];
    d_p[i] = d_delta[i] * cc.m[i] * sigma_grad2(cfg, cc.p[i]);
    w_left[i + 1].push_back(d_m), w_right[i + 1].push_back(cc.delta[i + 1]);
    prod_xw(d_m, state[2 * (i + 1)], d_delta[i + 1], true);
  }
  // δ_L = g(e): ∂L/∂e = ∂L/∂δ_L ⊙ g'(e) (2 ∂L/∂δ_L for the squared loss), and the loss's gate's gradient.
  const auto [d_out, d_gate] = cfg.loss.backward(d_delta[depth - 1], cc.error, cc.gate);
  // 5. Keys.
  Tensor d_k = cfg.residual ? d_out.clone() : at::zeros_like(cc.a[0]);
  d_p[depth - 1] = d_out;
  for (size_t i = depth; i-- > 0;) {
    const auto& W = state[2 * i];
    w_left[i].push_back(cc.a[i]), w_right[i].push_back(d_p[i]);
    const auto beta_n = dec.beta.select(1, -1);
    d_beta.select(1, -1).add_(weight_grad(d_state[2 * i], d_new[2 * i], beta_n, w_left[i], w_right[i], W));
    prod_xwt(d_p[i], W, d_a[i], true);
    if (i > 0)
      d_p[i - 1].addcmul_(d_a[i], cc.dsigma[i - 1]);
    else
      d_k += d_a[0];
  }
  d_c.select(1, -1).add_(d_c_n);
  return {{d_q, d_k, -d_out, d_theta, d_gate}, {d_beta, d_c, d_D, d_E_last, d_e_n}};
}

// fused._state_norms: ‖·‖_F of every matrix of a state, per row [rows, state.size()].
Tensor state_norms(const State& state) {
  std::vector<Tensor> norms;
  for (const auto& t : state) norms.push_back(at::linalg_vector_norm(t, 2, at::IntArrayRef{1, 2}, false));
  return at::stack(norms, 1);
}

Tensor quad(const Tensor& gram, const Tensor& u) {  // uᵀ G u per row
  return (at::bmm(gram, u.unsqueeze(-1)).squeeze(-1) * u).sum(-1);
}

// fused._next_norm_bound: an upper bound on the norms of a chunk's end state from one on its start state's.
Tensor next_norm_bound(const Cache& cc, const Decays& dec, const Tensor& bound) {
  const auto u_w = cc.C.select(1, -1), &u_m = cc.u_m;
  const auto beta_n = dec.beta.narrow(1, dec.beta.size(1) - 1, 1), c_n = dec.c.narrow(1, dec.c.size(1) - 1, 1);
  const auto e_n = dec.e_last.unsqueeze(-1);
  const auto w = bound.slice(1, 0, bound.size(1), 2), s = bound.slice(1, 1, bound.size(1), 2);
  std::vector<Tensor> rank_w, rank_s;
  for (size_t i = 0; i < cc.a.size(); ++i) {  // the step each layer takes: ρ δ for a hidden layer
    const auto gram = at::bmm(cc.a[i], cc.a[i].transpose(1, 2)) * at::bmm(cc.step[i], cc.step[i].transpose(1, 2));
    rank_w.push_back(quad(gram, u_w)), rank_s.push_back(quad(gram, u_m));
  }
  const auto new_w = beta_n * w + c_n * s + at::stack(rank_w, 1).clamp_min(0).sqrt();
  const auto new_s = e_n * s + at::stack(rank_s, 1).clamp_min(0).sqrt();
  return at::stack({new_w, new_s}, 2).flatten(1);
}

// fused._bound_state: the end state's matrices back on their balls ‖·‖_F ≤ max_state_norm · √d_out, in place, their
// factors min(1, R / ‖·‖) (mlp.state_norm_scale) into scales [rows, state.size()]; a matrix is read for its norm only
// where `bound` reaches its ball. Returns the bound after the chunk.
Tensor bound_state(const Config& cfg, const State& state, const Tensor& scales, Tensor bound) {
  for (size_t i = 0; i < state.size(); ++i) {
    const double limit = *cfg.max_state_norm * std::sqrt(static_cast<double>(state[i].size(2)));
    if (!bound.select(1, i).gt(limit * (1 - 1e-3)).any().item<bool>()) continue;
    const auto norm = at::linalg_vector_norm(state[i], 2, at::IntArrayRef{1, 2}, false);
    const auto factor = (norm.reciprocal() * limit).clamp_max(1.0);
    scales.select(1, i).copy_(factor);
    bound.select(1, i).copy_(norm.clamp_max(limit));
    if (factor.lt(1).any().item<bool>()) state[i].mul_(factor.view({-1, 1, 1}));
  }
  return bound;
}

// fused._scale_rows: each matrix times its recorded factor, in place (bound_state's backward pass and replay).
void scale_rows(const State& state, const Tensor& scales) {
  if (scales.lt(1).any().item<bool>())
    for (size_t i = 0; i < state.size(); ++i) state[i].mul_(scales.select(1, i).view({-1, 1, 1}));
}

// --- the loop over chunks, one slice of rows per thread ------------------------------------------------------

std::pair<int64_t, int64_t> chunk_bounds(int64_t j, int64_t seq, int64_t chunk_size) {
  return {j * chunk_size, std::min((j + 1) * chunk_size, seq)};
}

// Chunk j's decays (or their gradients) among the blocks of fused._block_decays, rows [b0, b1).
Decays chunk_decays(const Blocks& blocks, int64_t j, int64_t b0, int64_t b1) {
  const int64_t full = blocks[0][0].size(1);
  const auto& block = j < full || blocks.size() == 1 ? blocks[0] : blocks[1];
  const int64_t at = j < full ? j : j - full;
  auto get = [&](int f) { return block[f].narrow(0, b0, b1 - b0).select(1, at); };
  return {get(0), get(1), get(2), get(3), get(4)};
}

State rows_of(const State& s, int64_t b0, int64_t b1) {
  State out;
  for (const auto& t : s) out.push_back(t.narrow(0, b0, b1 - b0));
  return out;
}

struct ChunkRecord {
  State start;
  Cache cache;
};

// What the backward pass needs of a run of chunks: per slice of rows, each chunk's starting state and cache.
struct Record {
  int64_t first_chunk = 0;
  std::vector<int64_t> slice_starts;  // slice s holds rows [slice_starts[s], slice_starts[s + 1])
  std::vector<std::vector<ChunkRecord>> slices;
};

// One slice per thread when every thread gets rows; else one slice, and the kernels share the threads.
std::vector<int64_t> slice_starts(int64_t rows) {
  const int64_t threads = at::get_num_threads();
  const int64_t parts = threads > 1 && rows >= threads && !at::in_parallel_region() ? threads : 1;
  std::vector<int64_t> starts;
  for (int64_t s = 0; s <= parts; ++s) starts.push_back(rows * s / parts);
  return starts;
}

// Runs body(slice, b0, b1) for every slice, on its own thread when there are several, with the caller's
// thread-local state (grad mode, inference mode) on every thread.
template <typename Body>
void for_slices(const std::vector<int64_t>& starts, const Body& body) {
  const int64_t count = static_cast<int64_t>(starts.size()) - 1;
  if (count == 1) return body(0, starts[0], starts[1]);
  const at::ThreadLocalState caller;
  at::parallel_for(0, count, 1, [&](int64_t s0, int64_t s1) {
    at::ThreadLocalStateGuard guard(caller);
    for (int64_t s = s0; s < s1; ++s) body(s, starts[s], starts[s + 1]);
  });
}

// fused.Outputs: where run_chunks writes (y; the state after chunk idx of the run in slots[idx % slots.size()], the
// last one in `last`, empty: not computed; the bounded state's factors per chunk, absent where it is not bounded).
struct Outputs {
  Tensor y;
  std::vector<State> slots;
  State last;
  c10::optional<Tensor> scales;
};

// fused._run_chunks: chunks [j0, j1) from `start` into `out`, bounded where `out.scales` is given (the recorded
// factors applied with `replay`). With `keep`, returns every chunk's starting state and cache.
std::shared_ptr<Record> run_chunks(const Config& cfg, const Inputs& x, const Blocks& blocks,
                                   std::pair<int64_t, int64_t> chunks, const State& start, const Outputs& out,
                                   bool keep, bool replay) {
  const int64_t j0 = chunks.first, j1 = chunks.second;  // (a structured binding cannot be captured below)
  const int64_t chunk_size = cfg.chunk_size;
  const auto& scales = out.scales;
  auto rec = std::make_shared<Record>();
  rec->first_chunk = j0;
  rec->slice_starts = slice_starts(x.q.size(0));
  rec->slices.resize(rec->slice_starts.size() - 1);
  const int64_t seq = x.q.size(1);
  for_slices(rec->slice_starts, [&](int64_t s, int64_t b0, int64_t b1) {
    const int64_t n = b1 - b0;
    const auto x_ = x.rows(b0, n);
    const auto y_ = out.y.narrow(0, b0, n);
    State cur = rows_of(start, b0, b1);
    Tensor bound = scales && !replay ? state_norms(cur) : Tensor();
    for (int64_t j = j0; j < j1; ++j) {
      const auto [t0, t1] = chunk_bounds(j, seq, chunk_size);
      const int64_t idx = j - j0;
      State nxt;
      if (j + 1 < j1)
        nxt = rows_of(out.slots[idx % out.slots.size()], b0, b1);
      else if (!out.last.empty())
        nxt = rows_of(out.last, b0, b1);
      const auto dec = chunk_decays(blocks, j, b0, b1);
      auto cache = chunk_forward(cfg, cur, x_.span(t0, t1), dec, y_.slice(1, t0, t1), nxt.empty() ? nullptr : &nxt);
      if (!nxt.empty() && scales) {
        const auto factors = scales->select(0, j).narrow(0, b0, n);
        if (replay)
          scale_rows(nxt, factors);
        else
          bound = bound_state(cfg, nxt, factors, next_norm_bound(cache, dec, bound));
      }
      if (keep) rec->slices[s].push_back({cur, std::move(cache)});
      cur = std::move(nxt);
    }
  });
  return rec;
}

// fused._backward_chunks: the recorded chunks in reverse; chunk number i from the end writes the gradient of its
// starting state into targets[i], given that of its end state (d_end, then the previous target; scaled in place by
// the chunk's `scales` where the state is bounded). Writes the chunks' rows of the inputs' gradients `grads` and their
// decays' gradients into d_blocks. (The normalised step's factors come from the caches.)
void backward_chunks(const Config& cfg, const Record& rec, const Inputs& x, const Blocks& blocks,
                     const Blocks& d_blocks, const Tensor& dy, const State& d_end, const std::vector<State>& targets,
                     const Inputs& grads, const c10::optional<Tensor>& scales) {
  const int64_t chunk_size = cfg.chunk_size;
  const int64_t count = rec.slices.empty() ? 0 : static_cast<int64_t>(rec.slices[0].size());
  TORCH_CHECK(static_cast<int64_t>(targets.size()) == count, "scan: one target state per recorded chunk");
  const int64_t seq = dy.size(1);
  for_slices(rec.slice_starts, [&](int64_t s, int64_t b0, int64_t b1) {
    const int64_t n = b1 - b0;
    const auto& chunks = rec.slices[s];
    State d_cur = rows_of(d_end, b0, b1);
    for (int64_t idx = count - 1; idx >= 0; --idx) {
      const int64_t j = rec.first_chunk + idx;
      const auto [t0, t1] = chunk_bounds(j, seq, chunk_size);
      State d_prev = rows_of(targets[count - 1 - idx], b0, b1);
      if (scales) scale_rows(d_cur, scales->select(0, j).narrow(0, b0, n));
      auto rows = [&](const Tensor& t) { return t.narrow(0, b0, n).slice(1, t0, t1); };
      const auto g = chunk_backward(cfg, chunks[idx].start, chunks[idx].cache, rows(x.theta),
                                    chunk_decays(blocks, j, b0, b1), rows(dy), d_cur, d_prev);
      rows(grads.q).copy_(g.inputs.q), rows(grads.k).copy_(g.inputs.k), rows(grads.v).copy_(g.inputs.v);
      rows(grads.theta).copy_(g.inputs.theta);
      if (grads.loss_gate.defined()) rows(grads.loss_gate).copy_(g.inputs.loss_gate);
      const auto d = chunk_decays(d_blocks, j, b0, b1);
      d.beta.copy_(g.decays.beta), d.c.copy_(g.decays.c), d.D.copy_(g.decays.D), d.E_last.copy_(g.decays.E_last);
      d.e_last.copy_(g.decays.e_last);
      d_cur = std::move(d_prev);
    }
  });
}

}  // namespace

void register_scan(pybind11::module_& m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<Record, std::shared_ptr<Record>>(m, "ScanRecord",
                                              "Starting states and caches of a run of chunks, per slice of rows");
  py::class_<Config>(m, "ScanConfig", "fused.ScanConfig and its rule, as fused.native_config builds it")
      .def(py::init<>())
      .def_readwrite("chunk_size", &Config::chunk_size)
      .def_readwrite("gelu", &Config::gelu)
      .def_readwrite("residual", &Config::residual)
      .def_readwrite("max_grad_norm", &Config::max_grad_norm)
      .def_readwrite("max_state_norm", &Config::max_state_norm)
      .def_readwrite("normalize_chunk", &Config::normalize_chunk)
      .def_readwrite("hidden_step", &Config::hidden_step)
      .def_readwrite("record", &Config::record)
      .def("set_loss", [](Config& c, const std::string& name, double a, double b, bool gated) {
        c.loss.set(name, a, b, gated);
      }, "The loss by its name in losses.py's registry, with its native_params and whether it takes a gate");
  py::class_<Inputs>(m, "ScanInputs", "fused.ScanInputs: q, k, v, θ and the loss's gate (None without one)")
      .def(py::init([](Tensor q, Tensor k, Tensor v, Tensor theta, c10::optional<Tensor> gate) {
        return Inputs{q, k, v, theta, gate ? *gate : Tensor()};
      }));
  py::class_<Outputs>(m, "ScanOutputs", "fused.Outputs: y, the state slots, the last state, the bound's factors")
      .def(py::init([](Tensor y, std::vector<State> slots, State last, c10::optional<Tensor> scales) {
        return Outputs{y, std::move(slots), std::move(last), scales};
      }));
  m.attr("LOSSES") = loss_names();
  m.def("run_chunks", &run_chunks, "fused._run_chunks in C++", release());
  m.def("backward_chunks", &backward_chunks, "fused._backward_chunks in C++", release());
  m.def("kernel_serves", &kernel_serves, "Whether the state kernels serve a product of `rows` rows against W",
        py::arg("W"), py::arg("rows"));
  m.attr("MIN_ROWS") = kMinRows;
}
