"""Within-chunk decay factors of the memory recurrence (DESIGN.md §2 step 2), computed in log space.

Shared by both chunk-parallel implementations (`parallel.py`, `fused.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# exp(-1e4) is exactly 0 in float32/float64: a gate of exactly 0 (η = 0, i.e. no momentum, or
# α = 1, full forgetting) becomes a finite log value, so no sum ever holds −inf (nor a gradient NaN).
# The price: the gradient with respect to such a gate is 0 (see `_safe_log`).
LOG_FLOOR = -1.0e4


class Decays(NamedTuple):
    """Within-chunk decay factors; leading dims [batch, heads, (chunks)], chunk dim last."""

    beta: Tensor  # β_t = Π_{j≤t}(1 − α_j)                    [..., n]
    c: Tensor  # c_t = Σ_{r≤t} B[t,r] e_r  (weight of S⁰ in W_t)  [..., n]
    B: Tensor  # B[t,r] = Π_{r<j≤t}(1 − α_j), lower triangular   [..., n, n]
    E: Tensor  # E[t,s] = Π_{s<j≤t} η_j, lower triangular         [..., n, n]
    e: Tensor  # e_t = Π_{j≤t} η_j                                [..., n]


def _safe_log(x: Tensor) -> Tensor:
    """log x, floored at LOG_FLOOR, with a zero (not NaN) gradient where x is exactly 0.

    A gate of exactly 0 or 1 (a sigmoid saturates at |logit| ≳ 17 in float32) would otherwise give
    log 0 = −inf, and autograd's 0 · ∞ in the backward pass turns every gradient into NaN. The gradient
    with respect to that one gate is then 0 where the token-by-token recurrence has a finite one (e.g.
    ∂W_t/∂α_t = −W_{t−1}); gates from a sigmoid are unaffected, the sigmoid's own derivative being 0
    there, and every other gate's gradient stays exact (tested).
    """
    positive = x > 0
    return torch.where(positive, torch.log(torch.where(positive, x, 1.0)), LOG_FLOOR).clamp_min(LOG_FLOOR)


def _masked_exp_cumdiff(log_factors: Tensor) -> Tensor:
    """M[t,s] = exp(Σ_{s<j≤t} log f_j) for s ≤ t, else 0; masked BEFORE exp so nothing overflows.

    Each range sum is accumulated on its own (a cumulative sum down the columns of the n × n matrix whose
    entry [j, s] is log f_j for j > s), not as a difference of two prefix sums: after a gate at LOG_FLOOR
    the prefix sums sit near −1e4, where float32 resolves only ~1e-3 and their differences would lose the
    small log-decays of the tokens that follow.
    """
    n = log_factors.shape[-1]
    after = torch.ones(n, n, dtype=torch.bool, device=log_factors.device).tril(-1)  # [j, s]: j > s
    sums = torch.cumsum(log_factors.unsqueeze(-1).expand(*log_factors.shape, n).masked_fill(~after, 0.0), dim=-2)
    causal = torch.ones(n, n, dtype=torch.bool, device=log_factors.device).tril()
    return torch.exp(sums.masked_fill(~causal, float("-inf")))


def log_keep(alpha: Tensor) -> Tensor:
    """log(1 − α), floored (`_safe_log`): what every decay of the forgetting gate is a sum of."""
    return _safe_log(1.0 - alpha)


def forget_decays(alpha: Tensor) -> tuple[Tensor, Tensor]:
    """(β, B) of the forgetting gate alone: β_t = Π_{j≤t}(1 − α_j), B[t,r] = Π_{r<j≤t}(1 − α_j) (lower triangular)."""
    keeps = log_keep(alpha)
    return torch.exp(torch.cumsum(keeps, dim=-1)), _masked_exp_cumdiff(keeps)


def momentum_decays(eta: Tensor) -> tuple[Tensor, Tensor]:
    """(E, e) of the momentum gate alone: E[t,s] = Π_{s<j≤t} η_j (lower triangular), e_t = Π_{j≤t} η_j."""
    log_eta = _safe_log(eta)
    return _masked_exp_cumdiff(log_eta), torch.exp(torch.cumsum(log_eta, dim=-1))


def chunk_decays(eta: Tensor, alpha: Tensor) -> Decays:
    """Decay matrices of DESIGN.md §2 step 2, in log space; the chunk is the last dim of eta/alpha."""
    beta, B = forget_decays(alpha)
    E, e = momentum_decays(eta)
    c = (B @ e.unsqueeze(-1)).squeeze(-1)
    return Decays(beta, c, B, E, e)


def channel_decays(E: Tensor, e: Tensor, alpha: Tensor) -> Decays:
    """The decays with α per channel: `alpha` [..., n, d] (a layer's forgetting per output column, chunk dim second
    to last) gives β, c [..., d, n] and B [..., d, n, n], one decay per column; η's E and e (`momentum_decays`) are
    shared by every column."""
    beta, B = forget_decays(alpha.transpose(-1, -2))
    c = (B @ e[..., None, :, None]).squeeze(-1)
    return Decays(beta, c, B, E, e)


class LastRowDecays(NamedTuple):
    """Row t of a chunk's decays, t its last token so far: what one token's step needs (`step.py`)."""

    beta: Tensor  # β_t = Π_{j≤t}(1 − α_j)                     [...]
    c: Tensor  # c_t = Σ_r B[t,r] e_r                           [...]
    D: Tensor  # D[t,s] = Σ_r B[t,r] E[r,s] (C = D diag θ)       [..., n]
    E: Tensor  # E[t,s] = Π_{s<j≤t} η_j                          [..., n]
    e: Tensor  # e_t = Π_{j≤t} η_j                               [...]


def last_row_decays(eta: Tensor, alpha: Tensor) -> LastRowDecays:
    """The last rows of `chunk_decays` and of D = B E, from the same log-space factors, without B's other rows."""
    n = eta.shape[-1]
    log_keep, log_eta = _safe_log(1.0 - alpha), _safe_log(eta)
    E = _masked_exp_cumdiff(log_eta)  # every row: D[t,s] sums E[r,s] over r
    later = torch.ones(n, n, dtype=eta.dtype, device=eta.device).triu(1)  # [r, j]: j > r
    B_last = torch.exp((log_keep.unsqueeze(-2) * later).sum(-1))  # B[t,r] = exp(Σ_{r<j≤t} log(1 − α_j))
    e = torch.exp(torch.cumsum(log_eta, dim=-1))
    D_last = (B_last.unsqueeze(-2) @ E).squeeze(-2)
    return LastRowDecays(torch.exp(log_keep.sum(-1)), (B_last * e).sum(-1), D_last, E[..., -1, :], e[..., -1])
