"""The memory's one-token step: what generation runs per token, without the chunk machinery.

Inside a chunk of tokens 1..t that started from weights W⁰ and momentum S⁰ (every gradient taken at W⁰, DESIGN.md
§2), unrolling the paper's eqs. 12-14 (S_t = η_t S_{t−1} − θ_t ∇ℓ_t, W_t = (1 − α_t) W_{t−1} + S_t) gives the
memory after token t in closed form:

    W_t = β_t W⁰ + c_t S⁰ − Σ_{s≤t} C[t,s] a_sᵀ δ_s        S_t = e_t S⁰ − Σ_{s≤t} θ_s E[t,s] a_sᵀ δ_s
    y_t = M(q_t; W_t)                                       (eq. 15)

with the decays of `decays.py` (C = B E diag θ, c = B e), θ_s bounded by κ and the gradient bound and C[t,s], θ_s E[t,s]
scaled by the normalised chunk step's K[t,s] (DESIGN.md §1). Only row t of those n × n matrices is needed, and W_t
is formed once per layer (a rank-t update of a [d_in, d_out] state): one query does not need the dual form's
scores, and the chunk path's autograd Function, workspace and C++ loop cost more than the whole step at n ≤ 16.

Every quantity comes from the same functions the chunk path uses (`forward_cached`, `backward_deltas`,
`token_grad_sq_norm`, `grad_norm_scale`, `state_norm_scale`, and `last_step_norm`, `last_row_decays`: the last rows
of `chunk_step_norm` and `chunk_decays`, from the same factors), so the step equals
`parallel_memory` on the same chunk to round-off (tests/memory/test_step.py, float64). It is an inference path: it
checks nothing (its caller, `NeuralMemory`, built every argument) and is not meant to be differentiated.
"""

from __future__ import annotations

from torch import Tensor

from .checks import Gates
from .decays import last_row_decays
from .mlp import (
    Weights,
    backward_deltas,
    forward_cached,
    grad_norm_scale,
    last_step_norm,
    memory_apply,
    state_norm_scale,
    token_grad_sq_norm,
)
from .rule import MemoryRule, bounded_theta


def memory_token_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: Gates,
    weights: Weights,
    momentum: Weights,
    chunk_end: bool,
    rule: MemoryRule,
) -> tuple[Tensor, Weights, Weights]:
    """The output of a chunk's newest token, and the state after the chunk if it ends with that token.

    Args:
        q: the newest token's query `[batch, heads, 1, d]`.
        k, v, gates: the chunk's tokens so far, the newest last (`[batch, heads, n, d]`, and θ, η, α and the loss's
            gate `[batch, heads, n]`, n ≤ chunk_size); θ may be `parallel_memory`'s surprise callable, the loss's
            gate is None where the rule's loss takes none.
        weights, momentum: W⁰, S⁰, the state the chunk started from (`[batch, heads, d_in, d_out]` per layer).
        chunk_end: whether the newest token completes the chunk.
        rule: the update, as in `parallel_memory` (κ applied to θ here too).

    Returns (y `[batch, heads, 1, d_out]`, weights, momentum): with `chunk_end` the state after the chunk (put back on
    its ball by the bounded state), otherwise W⁰ and S⁰ unchanged (the state advances at chunk ends only).
    """
    theta, eta, alpha, loss_gate = gates
    theta = bounded_theta(rule, theta, eta)
    out, inputs, preacts = forward_cached(k, weights, rule)  # the keys at W⁰
    if not isinstance(theta, Tensor):  # surprise-gated θ: the loss ℓ_t at W⁰
        theta = theta(rule.loss.value(out - v, loss_gate).sum(-1), 0, k.shape[2])
    deltas = backward_deltas(out, v, weights, preacts, rule, loss_gate)
    if rule.max_grad_norm is not None:
        theta = theta * grad_norm_scale(token_grad_sq_norm(inputs, deltas), rule.max_grad_norm)
    decays = last_row_decays(eta, alpha)
    weight_coef = decays.D * theta  # C[t,s] = Σ_r B[t,r] E[r,s] θ_s, row t
    momentum_coef = decays.E * theta  # θ_s E[t,s]
    if rule.normalize_chunk:  # row t of K
        norm = last_step_norm(inputs, deltas)
        weight_coef, momentum_coef = weight_coef * norm, momentum_coef * norm
    beta, c, e = (x[..., None, None] for x in (decays.beta, decays.c, decays.e))
    depth = len(weights)
    current, new_momentum = [], []
    for i, (w, s, a, delta) in enumerate(zip(weights, momentum, inputs, deltas)):
        if rule.layer_step(i, depth) != 1.0:  # the hidden layers step ρ θ, after the bounds saw the whole gradient
            delta = delta * rule.layer_step(i, depth)
        # Σ_s u_s a_sᵀ δ_s as one [d_in, n] × [n, d_out] product
        current.append(beta * w + c * s - (a * weight_coef.unsqueeze(-1)).transpose(-1, -2) @ delta)
        if chunk_end:
            new_momentum.append(e * s - (a * momentum_coef.unsqueeze(-1)).transpose(-1, -2) @ delta)
    y = memory_apply(q, tuple(current), rule)
    if not chunk_end:
        return y, weights, momentum
    if rule.max_state_norm is not None:  # the bounded state, at the chunk's end
        current = [w * state_norm_scale(w, rule.max_state_norm) for w in current]
        new_momentum = [s * state_norm_scale(s, rule.max_state_norm) for s in new_momentum]
    return y, tuple(current), tuple(new_momentum)
