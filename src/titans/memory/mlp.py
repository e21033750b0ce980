"""The memory network M(x; W) as a pure function of its weights (paper §3.1, "deep memory").

depth 1:   M(x) = x W            (+ x with `residual`)   -- a matrix memory
depth L>1: M(x) = σ(…σ(x W_1)…) W_L   (+ x with `residual`)

Weights are tuples of `[batch, heads, d_in, d_out]` tensors: each (batch, head) owns its memory.
`forward_cached` keeps every layer's input `a_{i-1}` and pre-activation `z_i` so that
`backward_deltas` can back-propagate the associative loss by hand, giving `δ_i = ∂ℓ/∂z_i` per token.
The weight gradient of token s for layer i is then the outer product `a_{i-1,s}ᵀ δ_{i,s}`, which the
chunk-parallel algorithm never materialises (DESIGN.md §2).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .rule import MemoryRule

Weights = tuple[Tensor, ...]

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu_grad(z: Tensor) -> Tensor:
    # d/dz [z Φ(z)] = Φ(z) + z φ(z), exact (erf) GELU as in torch's default.
    cdf = 0.5 * (1.0 + torch.erf(z * _INV_SQRT2))
    pdf = torch.exp(-0.5 * z * z) * _INV_SQRT2PI
    return cdf + z * pdf


def _gelu_grad2(z: Tensor) -> Tensor:
    # d/dz [Φ(z) + z φ(z)] = 2 φ(z) + z φ'(z) = φ(z) (2 − z²)
    return torch.exp(-0.5 * z * z) * _INV_SQRT2PI * (2.0 - z * z)


def _silu_grad(z: Tensor) -> Tensor:
    s = torch.sigmoid(z)
    return s * (1.0 + z * (1.0 - s))


def _silu_grad2(z: Tensor) -> Tensor:
    # d/dz [s + z s (1 − s)] = s (1 − s) (2 + z (1 − 2 s)) with s = sigmoid(z)
    s = torch.sigmoid(z)
    return s * (1.0 - s) * (2.0 + z * (1.0 - 2.0 * s))


Activation = Callable[[Tensor], Tensor]

# name -> (σ, σ', σ''). σ and σ' are built from differentiable torch ops so the autograd path can
# back-propagate through the hand-written inner gradient (second order terms included); σ'' is what
# the fused path's hand-written backward needs for those same second order terms.
ACTIVATIONS: dict[str, tuple[Activation, Activation, Activation]] = {
    "gelu": (torch.nn.functional.gelu, _gelu_grad, _gelu_grad2),
    "silu": (torch.nn.functional.silu, _silu_grad, _silu_grad2),
}

# name -> (g, z) ↦ g ⊙ σ'(z) in one kernel (torch's own activation backward): the fused path's per-chunk
# products with σ', where the σ' above would take half a dozen elementwise passes.
ACTIVATION_VJPS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "gelu": torch.ops.aten.gelu_backward,
    "silu": torch.ops.aten.silu_backward,
}


def memory_apply(x: Tensor, weights: Weights, rule: Optional[MemoryRule] = None) -> Tensor:
    """M(x; W) for x `[batch, heads, n, d]`, with the rule's activation and residual (None: the default rule's)."""
    sigma, residual = _network(rule)
    h = x
    for i, w in enumerate(weights):
        h = h @ w
        if i < len(weights) - 1:
            h = sigma(h)
    return x + h if residual else h


def _network(rule: Optional[MemoryRule]) -> tuple[Activation, bool]:
    """(σ, residual): what of the rule the memory network itself reads."""
    if rule is None:
        from .rule import MemoryRule

        rule = MemoryRule()
    return ACTIVATIONS[rule.activation][0], rule.residual


def forward_cached(
    x: Tensor, weights: Weights, rule: MemoryRule, matmul: Callable[[Tensor, Tensor], Tensor] = torch.matmul,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """M(x; W) plus each layer's input `a_{i-1}` and pre-activation `z_i` (for `backward_deltas`); `matmul` is
    the fused path's state product (`state_ops.xw`)."""
    sigma, residual = _network(rule)
    inputs, preacts = [], []
    a = x
    for i, w in enumerate(weights):
        inputs.append(a)
        z = matmul(a, w)
        preacts.append(z)
        a = sigma(z) if i < len(weights) - 1 else z
    out = x + a if residual else a
    return out, inputs, preacts


def backward_deltas(out: Tensor, v: Tensor, weights: Weights, preacts: list[Tensor], rule: MemoryRule,
                    gate: Optional[Tensor] = None) -> list[Tensor]:
    """δ_i = ∂ℓ/∂z_i for ℓ = Σ_j h(M(k)_j − v_j), h the rule's loss (`losses.py`; gate: its per-token parameter), per
    token.

    The residual adds the identity to ∂M/∂z_L, so δ_L = g(M(k) − v) (2 (M(k) − v) for the squared loss) with or
    without it.
    """
    sigma_grad = ACTIVATIONS[rule.activation][1]
    delta = rule.loss.grad(out - v, gate)
    deltas = [delta]
    for i in range(len(weights) - 1, 0, -1):
        delta = (delta @ weights[i].transpose(-1, -2)) * sigma_grad(preacts[i - 1])
        deltas.append(delta)
    deltas.reverse()
    return deltas


def token_grad_sq_norm(inputs: list[Tensor], deltas: list[Tensor]) -> Tensor:
    """‖∇ℓ_t‖² over all layers from each layer's input a_t and δ_t, per token: token t's gradient for a layer
    is the outer product a_tᵀ δ_t, whose Frobenius norm is ‖a_t‖ ‖δ_t‖, so no per-token gradient is formed."""
    return sum((a * a).sum(-1) * (d * d).sum(-1) for a, d in zip(inputs, deltas))


def chunk_step_norm(inputs: list[Tensor], deltas: list[Tensor]) -> Tensor:
    """K[t, s] = G_ss / Σ_{r≤t} |G_sr| for s ≤ t (0 above the diagonal), G[s, r] = ⟨∇ℓ_s, ∇ℓ_r⟩: the factor on token s's
    step in the weights W_t of a chunk's token t under the normalised chunk step (DESIGN.md §1, "Stable by default").

    All of a chunk's gradients are taken at its starting weights, so n tokens whose gradients point the same way move
    the memory n times as far as one would; the factor shares each token's step among the earlier gradients of its
    chunk that overlap it (n equal gradients: 1/n each; orthogonal ones: 1). The step matrix G diag(K[t,:]) then has
    no eigenvalue above max_s ‖∇ℓ_s‖² (Gershgorin on diag(K) G, whose row s sums to G_ss in absolute value): a chunk
    moves the memory no further along any direction than its largest single-token step. Prefix sums keep it causal.
    G comes from n × n products (token s's gradient for layer i is a_sᵀ δ_s, so G = Σ_i (a_i a_iᵀ) ⊙ (δ_i δ_iᵀ)); the
    factor is a constant to the outer gradient, like the bounds."""
    with torch.no_grad():
        gram = _gradient_gram(inputs, deltas)
        overlap = gram.abs().cumsum(-1)  # [s, t] = Σ_{r≤t} |G_sr| ≥ G_ss for t ≥ s
        own = gram.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
        return (own / overlap.clamp_min(torch.finfo(gram.dtype).tiny)).transpose(-1, -2).tril()


def last_step_norm(inputs: list[Tensor], deltas: list[Tensor]) -> Tensor:
    """Row t of `chunk_step_norm` for the last token t of `inputs`/`deltas` (a chunk so far): K[t, s] = G_ss /
    Σ_r |G_sr|, r over the whole chunk so far, `[..., n]`. What one token's step needs (`step.py`), without the other
    rows."""
    with torch.no_grad():
        gram = _gradient_gram(inputs, deltas)
        return gram.diagonal(dim1=-2, dim2=-1) / gram.abs().sum(-1).clamp_min(torch.finfo(gram.dtype).tiny)


def _gradient_gram(inputs: list[Tensor], deltas: list[Tensor]) -> Tensor:
    """G[s, r] = ⟨∇ℓ_s, ∇ℓ_r⟩ = Σ_i (a_i a_iᵀ) ⊙ (δ_i δ_iᵀ) over a chunk's tokens, no per-token gradient formed."""
    return sum((a @ a.transpose(-1, -2)) * (d @ d.transpose(-1, -2)) for a, d in zip(inputs, deltas))


def grad_norm_scale(sq_norm: Tensor, max_grad_norm: float | None) -> Tensor | float:
    """min(1, c / ‖∇ℓ_t‖) from the squared norm: the factor that bounds token t's step to θ_t · c.

    Written as c · rsqrt(max(‖g‖², c²)) so that it is smooth where it matters: below the bound the clamp
    passes no gradient, and ‖g‖ = 0 never reaches a square root (whose derivative there is infinite).
    """
    if max_grad_norm is None:
        return 1.0
    return max_grad_norm * torch.rsqrt(sq_norm.clamp_min(max_grad_norm**2))


def state_norm_scale(matrix: Tensor, max_state_norm: float) -> Tensor:
    """min(1, R / ‖X‖_F) per `[..., d_in, d_out]` matrix (keepdim), R = max_state_norm · √d_out: the factor that puts a
    state matrix (a memory layer's weights or momentum) back on the ball ‖X‖_F ≤ R at a chunk's end.

    R is relative to the default initialisation (entries of variance 1/d_in, so ‖W‖_F ≈ √d_out). The factor is
    computed from a detached norm: the outer gradient treats it as a constant (a zero-norm matrix gets 1)."""
    bound = max_state_norm * math.sqrt(matrix.shape[-1])
    norm = torch.linalg.vector_norm(matrix.detach(), dim=(-2, -1), keepdim=True)
    return (bound / norm).clamp(max=1.0)
