// The memory's inner loss for the C++ chunk loop (scan.cpp): the functions of memory/losses.py that the fused scan
// reads, line for line (losses.py is the reference, and holds the derivation; tests/memory/test_losses.py holds this
// header to it for every loss it knows, values and gradients, and fails where a loss of the Python registry is
// missing here without a refusal).
//
// e = M(k) − v is [rows, n, d_out]; a loss with a gate (Huber's data-dependent δ_t) takes it per token, [rows, n]
// (undefined otherwise). Only what the fused scan needs is here: the loss's value serves the surprise-gated θ and the
// token-by-token reference, which run in Python.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

enum class LossKind { squared, huber, lp };

// The names of losses.py's registry this header serves (`LOSSES` in the module, which fused.native_config asks).
inline const std::vector<std::string>& loss_names() {
  static const std::vector<std::string> names = {"squared", "huber", "lp"};
  return names;
}

struct Loss {
  LossKind kind = LossKind::squared;
  double a = 0.0, b = 0.0;  // losses.py `native_params`: huber (δ, unused), lp (p, ε)
  bool gated = false;  // a per-token gate (huber: δ_t) instead of the constant `a`

  // Loss.name → kind; losses.py's `native_params` → (a, b).
  void set(const std::string& name, double a_, double b_, bool gated_) {
    const auto& names = loss_names();
    const auto it = std::find(names.begin(), names.end(), name);
    TORCH_CHECK(it != names.end(), "scan: no loss named ", name, " in kernels/losses.h");
    kind = static_cast<LossKind>(it - names.begin());
    a = a_, b = b_, gated = gated_;
    TORCH_CHECK(!gated || kind == LossKind::huber, "scan: the ", name, " loss takes no gate");
  }

  bool needs_error() const { return kind != LossKind::squared; }  // losses.py `needs_error`

  // g(e) = h'(e) = ∂ℓ/∂M(k): the last layer's δ (losses.py `grad`).
  torch::Tensor grad(const torch::Tensor& e, const torch::Tensor& gate) const {
    switch (kind) {
      case LossKind::squared:
        return 2.0 * e;
      case LossKind::huber: {
        if (!gated) return at::where(e.abs() <= a, 2.0 * e, 2.0 * a * e.sign());
        const auto d = gate.unsqueeze(-1);
        return at::where(e.abs() <= d, 2.0 * e, 2.0 * d * e.sign());
      }
      case LossKind::lp:
        return a * e * at::pow(e * e + b, a / 2 - 1);
    }
    TORCH_CHECK(false, "scan: unknown loss");
  }

  // (∂L/∂e, ∂L/∂gate) from d = ∂L/∂g: losses.py `backward` (d ⊙ g'(e), and Σ_j d ⊙ ∂g/∂gate with a gate).
  std::pair<torch::Tensor, torch::Tensor> backward(const torch::Tensor& d, const torch::Tensor& e,
                                                   const torch::Tensor& gate) const {
    switch (kind) {
      case LossKind::squared:
        return {2.0 * d, torch::Tensor()};
      case LossKind::huber: {
        const auto inside = gated ? e.abs() <= gate.unsqueeze(-1) : e.abs() <= a;
        const auto d_e = d * (2.0 * inside.to(e.scalar_type()));
        if (!gated) return {d_e, torch::Tensor()};
        return {d_e, (d * at::where(inside, 0.0, 2.0 * e.sign())).sum(-1)};
      }
      case LossKind::lp: {
        const auto e2 = e * e;
        const auto s = e2 + b;
        return {d * (a * at::pow(s, a / 2 - 1) * (1.0 + (a - 2) * e2 / s)), torch::Tensor()};
      }
    }
    TORCH_CHECK(false, "scan: unknown loss");
  }
};
