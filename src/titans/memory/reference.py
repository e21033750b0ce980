"""The plain token-by-token reference of the memory update (paper eqs. 10-14). Slow; for tests.

Written to be obviously right rather than fast: every token's gradient comes from autograd
(`torch.func.grad`) of the loss's value (`Loss.value`, not the hand-written gradients the chunk paths use), the
recurrence is applied one token at a time, and nothing is vectorised over the sequence. `parallel_memory` must agree
with it to float64 round-off.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .checks import Gates, check_memory_args, without_autocast
from .mlp import Weights, grad_norm_scale, memory_apply, state_norm_scale
from .rule import MemoryRule, bounded_theta

DEFAULT_RULE = MemoryRule()


@without_autocast
def sequential_memory(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: Gates,
    weights: Weights,
    momentum: Optional[Weights] = None,
    *,
    rule: MemoryRule = DEFAULT_RULE,
    chunk_size: int = 16,
) -> tuple[Tensor, Weights, Weights]:
    """Same contract as `parallel_memory` (without its implementation and recomputation choices), token by token."""
    momentum = check_memory_args(q, k, v, gates, weights, momentum, chunk_size, rule)
    theta, eta, alpha, loss_gate = gates
    # ρ on every layer's step but the last (1: the paper's rule)
    layer_steps = [rule.layer_step(i, len(weights)) for i in range(len(weights))]
    max_grad_norm, max_state_norm, normalize_chunk = rule.max_grad_norm, rule.max_state_norm, rule.normalize_chunk
    out_dtype, state_dtype = q.dtype, weights[0].dtype
    q, k, v = (t.to(state_dtype) for t in (q, k, v))
    if isinstance(theta, Tensor):
        theta = theta.to(state_dtype)
    eta = eta.to(state_dtype)
    gate = None if loss_gate is None else loss_gate.to(state_dtype)
    theta = bounded_theta(rule, theta, eta)  # κ, as every implementation applies it

    def token_loss(ws: Weights, k_t: Tensor, v_t: Tensor, gate_t: Optional[Tensor]) -> Tensor:
        # ℓ_t(W) = Σ_j h(M(k_t; W)_j − v_t,j), h the rule's loss; summing over batch and heads is harmless because
        # each (batch, head) owns its own weights, so the gradient w.r.t. W[b, h] sees only its own term.
        return rule.loss.value(memory_apply(k_t, ws, rule) - v_t, gate_t).sum()

    token_grad = torch.func.grad(token_loss)
    W, S = tuple(weights), tuple(momentum)
    seq = k.shape[2]
    outputs = []
    for start in range(0, seq, chunk_size):
        end = min(start + chunk_size, seq)
        W_start = W  # t' = first token of the chunk: all its gradients are taken here
        if isinstance(theta, Tensor):
            theta_chunk = theta[:, :, start:end]
        else:
            error = memory_apply(k[:, :, start:end], W_start, rule) - v[:, :, start:end]
            surprise = rule.loss.value(error, None if gate is None else gate[:, :, start:end]).sum(-1)
            theta_chunk = theta(surprise, start, end)
        grads, steps = [], []
        for t in range(start, end):
            gate_t = None if gate is None else gate[:, :, t : t + 1]
            g = token_grad(W_start, k[:, :, t : t + 1], v[:, :, t : t + 1], gate_t)
            sq_norm = sum((x**2).sum((-1, -2)) for x in g)  # ‖∇ℓ_t‖² over all layers, [b, h]
            grads.append(g)
            steps.append(theta_chunk[:, :, t - start] * grad_norm_scale(sq_norm, max_grad_norm))
        # The normalised chunk step: token s's step in W_t times G_ss / Σ_{r≤t} |G_sr| (a constant to the outer
        # gradient), G the Gram matrix of the chunk's gradients, here from the gradients themselves.
        if normalize_chunk:
            gram = torch.stack([torch.stack([sum((x * y).sum((-1, -2)) for x, y in zip(g_s, g_r)) for g_r in grads], -1)
                                for g_s in grads], -2).detach()  # [b, h, s, r]
        W_chunk, S_chunk = W, S
        for t in range(start, end):
            if normalize_chunk:  # W_t: the chunk's tokens up to t, replayed with the factors of row t
                W, S = W_chunk, S_chunk
                first = start
            else:  # one more token on the running state
                first = t
            for s_ in range(first, t + 1):
                step = steps[s_ - start]
                if normalize_chunk:
                    i = s_ - start
                    overlap = gram[:, :, i, : t - start + 1].abs().sum(-1)
                    step = step * torch.where(overlap > 0, gram[:, :, i, i] / overlap, torch.zeros_like(overlap))
                theta_t = step[:, :, None, None]
                eta_t = eta[:, :, s_, None, None]
                # 1 − α_t per layer: one number, or one per output column (channel-wise α)
                keep_t = ([1.0 - alpha[:, :, s_, None, None]] * len(W) if isinstance(alpha, Tensor)
                          else [1.0 - a[:, :, s_, None, :] for a in alpha])
                # eq. 12, each layer at its step (ρ θ_t for the hidden layers, θ_t for the last)
                S = tuple(eta_t * m - rho * theta_t * g for m, g, rho in zip(S, grads[s_ - start], layer_steps))
                W = tuple(keep * w + m for keep, w, m in zip(keep_t, W, S))  # eq. 13: W_t = (1 − α_t) W_{t-1} + S_t
            outputs.append(memory_apply(q[:, :, t : t + 1], W, rule))  # eq. 15: y_t = M(q_t; W_t)
        if max_state_norm is not None:  # the bounded state: W and S back on their balls at the chunk's end
            W = tuple(w * state_norm_scale(w, max_state_norm) for w in W)
            S = tuple(s * state_norm_scale(s, max_state_norm) for s in S)
    y = torch.cat(outputs, dim=2) if outputs else q.new_zeros(q.shape[:3] + (v.shape[3],))
    return y.to(out_dtype), W, S
