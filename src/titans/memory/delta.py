"""The exact gated delta rule, chunk-parallel: a matrix memory whose every token takes its gradient at the
weights the previous token left (online gradient descent), not at its chunk's start.

With depth 1 and no momentum, eq. 13 with η = 0 reads, per token (W_{t−1}: the weights before token t)

    W_t = (1 − α_t) W_{t−1} + k_tᵀ u_t,    u_t = −θ_t ∂ℓ_t/∂(k_t W) = 2 θ_t (v_t − k_t W_{t−1}),

the gated delta rule (Gated DeltaNet, Yang et al. 2024, in this library's parameterisation of the gates). Its
recurrence is linear in W, so a chunk of n tokens starting at W⁰ unrolls with the forgetting decays β_t and
B[t,r] (`decays.forget_decays`) to

    W_t = β_t W⁰ + Σ_{r≤t} B[t,r] k_rᵀ u_r,
    u_t = 2 θ_t (v_t − β_{t−1} k_t W⁰ − Σ_{r<t} B[t−1,r] (k_t·k_r) u_r),

a unit lower-triangular n × n system for the u's (the "WY" form of DeltaNet's chunked algorithm), then
y_t = q_t W_t = β_t q_t W⁰ + Σ_{r≤t} B[t,r] (q_t·k_r) u_r. Nothing here depends on the chunk size but cost:
the result equals the token-by-token recurrence (`sequential_memory` with chunk_size=1), tested in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import Gates, check_memory_args, without_autocast
from .decays import forget_decays
from .mlp import Weights
from .rule import MemoryRule, bounded_theta

# The rule this function computes: the exact delta rule (gradients="token"), which the MemoryRule validator holds to
# no momentum, no bounds, the summed step and the squared loss; κ and the residual are the caller's choice.
DELTA_RULE = MemoryRule.paper(gradients="token", momentum=False)


@without_autocast
def delta_rule_memory(
    q: Tensor, k: Tensor, v: Tensor, theta: Tensor, alpha: Tensor, weights: Weights, chunk_size: int = 16,
    rule: MemoryRule = DELTA_RULE,
) -> tuple[Tensor, Weights]:
    """Run the exact gated delta rule over `[batch, heads, seq, dim]` inputs; return (y, weights after the
    last token). `weights` is a 1-tuple holding one `[batch, heads, d_k, d_v]` matrix; θ, α are
    `[batch, heads, seq]`. `rule` must take its gradients per token (`gradients="token"`, which `MemoryRule` allows
    only with what this function computes: the squared loss, no momentum, no bounds); its κ bounds θ as everywhere
    (with η = 0: θ_t ≤ κ). With `rule.residual`, M(x) = x + x W (so ℓ_t = ‖k_t W − (v_t − k_t)‖² and
    y_t = q_t + q_t W_t)."""
    if not isinstance(theta, Tensor):
        raise ValueError(f"theta must be a tensor [batch, heads, seq] for the delta rule, got {type(theta).__name__}")
    if isinstance(rule, MemoryRule) and rule.gradients != "token":
        raise ValueError("rule: the exact delta rule takes its gradients per token (gradients='token'); a rule with "
                         "gradients='chunk' is parallel_memory's")
    no_momentum = torch.zeros_like(alpha) if isinstance(alpha, Tensor) else alpha
    check_memory_args(q, k, v, Gates(theta, no_momentum, alpha, None), weights, None, chunk_size, rule)
    if len(weights) != 1:
        raise ValueError(f"weights: the delta rule is a matrix memory (depth 1), got {len(weights)} layers")
    (W,) = weights
    residual = rule.residual
    out_dtype = q.dtype
    q, k, v, theta, alpha = (t.to(W.dtype) for t in (q, k, v, theta, alpha))
    theta = bounded_theta(rule, theta, torch.zeros_like(theta))  # κ with η = 0
    target = v - k if residual else v
    outputs = []
    for start in range(0, k.shape[2], chunk_size):
        chunk = slice(start, start + chunk_size)
        qc, kc, vc, step = q[:, :, chunk], k[:, :, chunk], target[:, :, chunk], 2.0 * theta[:, :, chunk]
        beta, B = forget_decays(alpha[:, :, chunk])
        n = kc.shape[2]
        beta_prev = torch.cat([torch.ones_like(beta[..., :1]), beta[..., :-1]], dim=-1)  # β_{t−1}, β_{−1} = 1
        B_prev = torch.cat([torch.zeros_like(B[..., :1, :]), B[..., :-1, :]], dim=-2)  # B[t−1, r]: zero for r ≥ t
        gram = kc @ kc.transpose(-1, -2)
        system = torch.eye(n, dtype=W.dtype, device=W.device) + step.unsqueeze(-1) * B_prev * gram
        rhs = step.unsqueeze(-1) * (vc - beta_prev.unsqueeze(-1) * (kc @ W))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        y = beta.unsqueeze(-1) * (qc @ W) + (B * (qc @ kc.transpose(-1, -2))) @ u
        outputs.append(qc + y if residual else y)
        W = beta[..., -1, None, None] * W + kc.transpose(-1, -2) @ (B[..., -1, :, None] * u)
    y = torch.cat(outputs, dim=2) if outputs else q.new_zeros(q.shape[:3] + (W.shape[-1],))
    return y.to(out_dtype), (W,)
