"""The chunk-parallel memory with a hand-written backward pass: the fast path beside `parallel.py`.

Same mathematics as `parallel.py` (DESIGN.md §2, the dual form, gradients of a chunk at the weights the
chunk started with), organised around the only large tensors, the states: every memory layer carries W and
S (`[batch·heads, d_in, d_out]`, megabytes each). Computed chunk by chunk, every chunk of n = 16 tokens
streams each state through a dozen matmuls of 16 rows and writes a new one; those matmuls run at half speed
because the states do not stay in cache. So this path works in **blocks** of G chunks (`block_chunks`):

* The dual form holds over any span of tokens, whatever weights the gradients were taken at:
      W_t = β_t W⁰ + c_t S⁰ − Σ_{s≤t} C[t,s] a_sᵀ δ_s      (β, c, C over the block; DESIGN.md §2 step 2)
  so the state is materialised only at block boundaries. Inside a block, the weights at any token are the
  block's starting state plus rank-one corrections, applied as small matmuls with the (tokens × tokens) Gram.
* Chunk j's keys still see the weights at the chunk's own start (token t_j − 1 above), so the chunks of a
  block run in order, but only the layers after the first touch a state there (layer 1's input, the key,
  is known in advance); those states, W_2 and S_2, stay in cache across the block.
* Everything else (queries, layer-1 keys, the state update at the block's end, and in the backward pass
  every ∂L/∂state term, collected and applied as one rank-K update per layer) is one matmul of G·n rows.
* W and S of a layer live side by side, `[W | S]` (`[batch·heads, d_in, 2 d_out]`), so x W and x S are
  one matmul, and so are g_w Wᵀ + g_s Sᵀ.

The price: chunk j's keys need x W and x S of the block's starting state where the chunk form needed x W of a
materialised one, so a token costs 42 state-sized matmul rows in forward+backward instead of 33. They run at
about 130 GFLOP/s instead of 55 (2-core CPU, batch 4, dim 256); at `block_chunks=4` the scan measured about
10% faster than the chunk form at 512 tokens, with one kept state per block instead of per chunk. What is left
is no longer the matmuls: small elementwise ops and Python dispatch take about 40% of the step.

The backward pass is written by hand (`_block_backward`); only the tiny gate algebra (η, α → decays, a few
(G·n)² matrices) goes through autograd. Training keeps every block's starting state and its rows, or, for
long sequences, only group boundaries and recomputes each group (activation checkpointing). Large buffers
come from a per-thread pool kept between calls, so a training loop does not page-fault hundreds of MiB per
step.

Exactness is tested against `parallel.py`'s autograd path and the token-by-token reference in float64
(values and gradients, ≤ 1e-10) and by `gradcheck`, across block sizes. The backward is not itself
differentiable (no double backward); the autograd path is: `parallel_memory(..., implementation="autograd")`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .decays import chunk_decays
from .mlp import ACTIVATION_VJPS, ACTIVATIONS, grad_norm_scale

State = list[Tensor]  # per layer [W_i | S_i], each [BH, d_in, 2 d_out]


@dataclass(frozen=True)
class ScanConfig:
    chunk_size: int
    activation: str
    residual: bool
    max_grad_norm: Optional[float]
    group_chunks: Optional[int]  # chunks per recomputation group; None: one group, nothing recomputed
    record: bool  # save what the backward pass needs
    block_chunks: int = 4  # chunks per block, the span between materialised states


class SpanDecays(NamedTuple):
    """Gate algebra of a span of tokens (a block), span dim last: see `decay_terms`."""

    beta: Tensor  # β_t = Π_{j≤t}(1 − α_j)                 [.., T]
    c: Tensor  # c_t, weight of S⁰ in W_t                 [.., T]
    D: Tensor  # D[t,s] = Σ_r B[t,r] E[r,s], so C = D diag(θ) [.., T, T]
    E_last: Tensor  # E[T,s] = Π_{s<j≤T} η_j (momentum carried to the span's end) [.., T]
    e_last: Tensor  # e_T = Π_{j≤T} η_j                      [..]


def decay_terms(eta: Tensor, alpha: Tensor) -> SpanDecays:
    d = chunk_decays(eta, alpha)
    return SpanDecays(d.beta, d.c, d.B @ d.E, d.E[..., -1, :], d.e[..., -1])


# --- workspace -------------------------------------------------------------------------------------

_local = threading.local()


def _acquire(numel: int, like: Tensor) -> Tensor:
    """A flat buffer of at least `numel` elements from this thread's pool of released buffers.

    State buffers are tens to hundreds of MiB; fresh ones page-fault on first touch (about as slow as the
    matmuls that fill them) and glibc hands them straight back to the OS on free, so a training loop would
    fault on every step. The pool keeps released buffers warm for the next call, like a caching allocator.
    """
    free = _local.__dict__.setdefault("pool", {}).setdefault((like.device, like.dtype), [])
    fitting = [i for i, buf in enumerate(free) if buf.numel() >= numel]
    if fitting:
        return free.pop(min(fitting, key=lambda i: free[i].numel()))[:numel]
    free.clear()  # every free buffer is too small: stale sizes, let them go before allocating
    return torch.empty(numel, device=like.device, dtype=like.dtype)


def _release(buf: Tensor) -> None:
    """Give a buffer from `_acquire` back to the pool (its views must no longer be used)."""
    base = buf if buf._base is None else buf._base
    _local.__dict__.setdefault("pool", {}).setdefault((base.device, base.dtype), []).append(base)


def release_workspace() -> None:
    """Free the buffers the fused memory keeps between calls on this thread."""
    _local.__dict__.pop("pool", None)


def _carve(flat: Tensor, template: State, count: int) -> list[State]:
    """`count` states shaped like `template`, as views into `flat`."""
    states, offset = [], 0
    for _ in range(count):
        state = []
        for t in template:
            state.append(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        states.append(state)
    return states


def _join(pairs: list[Tensor], out: State) -> State:
    """(W_1, S_1, W_2, S_2, …) -> [W_i | S_i] per layer, written into `out`."""
    for i, ws in enumerate(out):
        torch.cat(pairs[2 * i : 2 * i + 2], dim=-1, out=ws)
    return out


def _split(state: State) -> list[Tensor]:
    """[W_i | S_i] per layer -> (W_1, S_1, W_2, S_2, …) as fresh contiguous tensors."""
    return [half.contiguous() for ws in state for half in ws.chunk(2, dim=-1)]


def _pair(x: Tensor, coef: Tensor) -> Tensor:
    """[c_0 x | c_1 x] from x `[.., r, d]` and coef `[.., r or 1, 2, 1]`, in one op."""
    return torch.mul(x.unsqueeze(-2), coef).flatten(-2)


# --- one block, forward ------------------------------------------------------------------------------


class BlockCache(NamedTuple):
    """What the backward pass of one block needs (all rows: `[BH, T, ·]`, or T × T)."""

    a: list[Tensor]  # layer inputs on the keys, a_1 = k
    p: list[Tensor]  # pre-activations on the keys
    a_ws: list[Tensor]  # a_i [W_i | S_i] at the block's starting state
    m: list[Optional[Tensor]]  # m_i = δ_{i+1} W_{i+1}(chunk start)ᵀ, so δ_i = m_i ⊙ σ'(p_i); None for the last layer
    delta: list[Tensor]  # δ_i = ∂ℓ/∂p_i per token
    h: list[Tensor]  # layer inputs on the queries, h_1 = q
    h_ws: list[Tensor]  # h_i [W_i | S_i] at the block's starting state
    r: list[Tensor]  # pre-activations on the queries
    theta: Tensor  # effective θ (after the gradient-norm bound)
    scale: Optional[Tensor]  # the bound's factor min(1, c/‖∇ℓ‖), None without a bound
    sq_norm: Optional[Tensor]  # ‖∇ℓ_t‖²
    C: Tensor  # C = D diag(θ)
    start_beta: Tensor  # β̄_j, c̄_j: weights of W⁰, S⁰ in chunk j's starting weights  [BH, G]
    start_c: Tensor


def _chunk_starts(dec: SpanDecays, starts: list[int]) -> tuple[Tensor, Tensor]:
    """β̄_j, c̄_j: chunk j starts from the weights after token starts[j] − 1 (the first from W⁰ itself)."""
    prev = [s - 1 for s in starts[1:]]
    one = dec.beta.new_ones(dec.beta.shape[0], 1)
    return torch.cat([one, dec.beta[:, prev]], 1), torch.cat([torch.zeros_like(one), dec.c[:, prev]], 1)


def _block_forward(
    cfg: ScanConfig, ws: State, q: Tensor, k: Tensor, v: Tensor, theta: Tensor, dec: SpanDecays, starts: list[int],
    y_out: Tensor, new_ws: Optional[State],
) -> BlockCache:
    """Outputs y_t = M(q_t; W_t) into `y_out` and, unless `new_ws` is None, the state after the block.

    `starts`: the chunks' first tokens within the block (the first is 0).
    """
    sigma, sigma_vjp = ACTIVATIONS[cfg.activation][0], ACTIVATION_VJPS[cfg.activation]
    depth, (bh, T, _) = len(ws), k.shape
    dims = [w.shape[-1] // 2 for w in ws]
    start_beta, start_c = _chunk_starts(dec, starts)
    start_coef = torch.stack([start_beta, start_c], -1).unsqueeze(-1)  # [BH, G, 2, 1]
    C = dec.D.clone()  # columns become D[:, s] θ_s chunk by chunk: under the bound θ_s needs the chunk's δ
    bounded = cfg.max_grad_norm is not None
    th = theta.clone() if bounded else theta
    scale = torch.ones_like(theta) if bounded else None
    sq_norm = torch.zeros_like(theta) if bounded else None

    # Keys, chunk by chunk: ℓ_t = ‖M(k_t) − v_t‖² (eq. 12) at the chunk's starting weights,
    # W(t_j − 1) = β̄ W⁰ + c̄ S⁰ − Σ_{s<t_j} γ_s a_sᵀ δ_s with γ = C[t_j − 1, :].
    a = [k] + [k.new_empty(bh, T, w.shape[1]) for w in ws[1:]]
    p = [k.new_empty(bh, T, d) for d in dims]
    delta = [k.new_empty(bh, T, d) for d in dims]
    m: list[Optional[Tensor]] = [k.new_empty(bh, T, w.shape[1]) for w in ws[1:]] + [None]
    # Layer 1's inputs are known in advance on both sides (a_1 = k, h_1 = q): one matmul for both.
    kq_ws = torch.bmm(torch.cat([k, q], 1), ws[0])
    a_ws = [kq_ws[:, :T]] + [k.new_empty(bh, T, 2 * d) for d in dims[1:]]
    for j, (s, e) in enumerate(zip(starts, starts[1:] + [T])):
        bb, cc, coef = start_beta[:, j, None, None], start_c[:, j, None, None], start_coef[:, j : j + 1]
        gamma = C[:, s - 1, :s, None] if s else None
        x = k[:, s:e]
        for i in range(depth):
            if i:
                a[i][:, s:e] = x
                a_ws[i][:, s:e] = torch.bmm(x, ws[i])
            xws = a_ws[i][:, s:e]
            pi = torch.mul(xws[..., : dims[i]], bb).addcmul_(xws[..., dims[i] :], cc)
            if gamma is not None:
                pi.baddbmm_(torch.bmm(x, a[i][:, :s].transpose(1, 2)), gamma * delta[i][:, :s], alpha=-1.0)
            p[i][:, s:e] = pi
            x = sigma(pi) if i < depth - 1 else pi
        out = x + k[:, s:e] if cfg.residual else x
        dl = 2.0 * (out - v[:, s:e])
        delta[-1][:, s:e] = dl
        for i in range(depth - 2, -1, -1):
            mi = torch.bmm(_pair(dl, coef), ws[i + 1].transpose(1, 2))
            if gamma is not None:
                mi.baddbmm_(torch.bmm(dl, delta[i + 1][:, :s].transpose(1, 2)), gamma * a[i + 1][:, :s], alpha=-1.0)
            m[i][:, s:e] = mi  # type: ignore[index]
            dl = sigma_vjp(mi, p[i][:, s:e])
            delta[i][:, s:e] = dl
        if bounded:
            # ‖a_sᵀ δ_s‖_F = ‖a_s‖ ‖δ_s‖: token gradient norms without the per-token gradients
            sq = sum((a[i][:, s:e].square().sum(-1) * delta[i][:, s:e].square().sum(-1) for i in range(depth)))
            sc = grad_norm_scale(sq, cfg.max_grad_norm)
            sq_norm[:, s:e], scale[:, s:e] = sq, sc  # type: ignore[index]
            th[:, s:e] = theta[:, s:e] * sc
        C[:, :, s:e] *= th[:, None, s:e]

    # Queries at W_t = β_t W⁰ + c_t S⁰ − Σ_{s≤t} C[t,s] a_sᵀ δ_s, layer by layer, all rows of the block at once.
    beta, c = dec.beta.unsqueeze(-1), dec.c.unsqueeze(-1)
    h_list, h_ws, r_list = [], [], []
    h = q
    for i in range(depth):
        hws = kq_ws[:, T:] if i == 0 else torch.bmm(h, ws[i])
        r = torch.mul(hws[..., : dims[i]], beta).addcmul_(hws[..., dims[i] :], c)
        r.baddbmm_(C * torch.bmm(h, a[i].transpose(1, 2)), delta[i], alpha=-1.0)
        h_list.append(h)
        h_ws.append(hws)
        r_list.append(r)
        h = sigma(r) if i < depth - 1 else r
    if cfg.residual:
        torch.add(q, h, out=y_out)
    else:
        y_out.copy_(h)

    if new_ws is not None:
        # The block's last row: W ← β_T W⁰ + c_T S⁰ − aᵀ diag(C[T,:]) δ;  S ← e_T S⁰ − aᵀ diag(θ ⊙ E[T,:]) δ,
        # both halves in one rank-T update.
        keep = torch.stack([dec.beta[:, -1], dec.e_last], -1).view(bh, 1, 2, 1)
        c_T = dec.c[:, -1].view(bh, 1, 1)
        u = torch.stack([C[:, -1, :], th * dec.E_last], -1).unsqueeze(-1)  # [u_w | u_m]  [BH, T, 2, 1]
        for i, d in enumerate(dims):
            torch.mul(ws[i].unflatten(-1, (2, d)), keep, out=new_ws[i].unflatten(-1, (2, d)))
            new_ws[i][..., :d].addcmul_(ws[i][..., d:], c_T)
            new_ws[i].baddbmm_(a[i].transpose(1, 2), _pair(delta[i], u), alpha=-1.0)
    return BlockCache(a, p, a_ws, m, delta, h_list, h_ws, r_list, th, scale, sq_norm, C, start_beta, start_c)


# --- one block, backward -----------------------------------------------------------------------------


def _correction_backward(x: Tensor, X: Tensor, Y: Tensor, gamma: Tensor, d_out: Tensor, d_X: Tensor, d_Y: Tensor,
                         d_gamma: Tensor) -> Tensor:
    """Backward of out −= (x Xᵀ)(γ ⊙ Y), a chunk's key-side correction by the block's earlier rows X, Y:
    accumulates into d_X, d_Y, d_gamma and returns ∂L/∂x."""
    Z, Yg = torch.bmm(x, X.transpose(1, 2)), gamma * Y
    d_Z, d_Yg = torch.bmm(d_out, Yg.transpose(1, 2)), torch.bmm(Z.transpose(1, 2), d_out)
    d_Y.sub_(gamma * d_Yg)
    d_gamma.sub_((d_Yg * Y).sum(-1, keepdim=True))
    d_X.baddbmm_(d_Z.transpose(1, 2), x, alpha=-1.0)
    return torch.bmm(d_Z, X).neg_()


class BlockGrads(NamedTuple):
    q: Tensor
    k: Tensor
    v: Tensor
    theta: Tensor
    decays: SpanDecays  # gradients w.r.t. the SpanDecays fields


def _block_backward(
    cfg: ScanConfig, ws: State, cache: BlockCache, theta: Tensor, dec: SpanDecays, starts: list[int], dy: Tensor,
    d_new: State, d_ws: State,
) -> BlockGrads:
    """Gradients of one block by hand; writes ∂L/∂(starting state) into `d_ws` given ∂L/∂(state after) `d_new`.

    `_block_forward` in reverse: the state update, the queries (last layer first), then the keys chunk by
    chunk from the last (each chunk's θ and gradient-norm bound first, then the δ recursion with its σ'' terms,
    the second-order part of the outer gradient, then the layers). Every ∂L/∂[W_i | S_i] term is a product
    xᵀ g of rows; they are collected and applied at the end as one matmul per layer.
    """
    sigma_grad2, sigma_vjp = ACTIVATIONS[cfg.activation][2], ACTIVATION_VJPS[cfg.activation]
    depth, (bh, T, _) = len(ws), cache.a[0].shape
    dims = [w.shape[-1] // 2 for w in ws]
    a, p, a_ws, m, delta = cache.a, cache.p, cache.a_ws, cache.m, cache.delta
    C, th = cache.C, cache.theta
    left: list[list[Tensor]] = [[] for _ in range(depth)]  # ∂L/∂[W_i | S_i] += Σ left_ᵀ right
    right: list[list[Tensor]] = [[] for _ in range(depth)]
    d_a = [torch.zeros_like(x) for x in a]  # d_a[0]: ∂L/∂k through the keys' layer-1 input
    d_delta = [torch.zeros_like(x) for x in delta]

    # 1. State update: new = [β_T W + c_T S | e_T S] − aᵀ [u_w ⊙ δ | u_m ⊙ δ].
    u_w, u_m = C[:, -1, :], th * dec.E_last
    d_u_w, d_u_m = torch.zeros_like(u_w), torch.zeros_like(u_m)
    d_beta_T, d_c_T, d_e_T = (torch.zeros_like(dec.e_last) for _ in range(3))
    keep = torch.stack([dec.beta[:, -1], dec.e_last], -1).view(bh, 1, 2, 1)
    c_T = dec.c[:, -1].view(bh, 1, 1)
    u = torch.stack([u_w, u_m], -1).unsqueeze(-1)  # [BH, T, 2, 1]
    scratch = _acquire(max(w.numel() for w in ws), th)  # the dots' products: warm memory, not fresh pages
    for i, d in enumerate(dims):
        S, dW_new = ws[i][..., d:], d_new[i][..., :d]
        prod = torch.mul(ws[i], d_new[i], out=scratch[: ws[i].numel()].view(ws[i].shape))
        same = prod.unflatten(-1, (2, d)).sum((1, 3))  # [⟨W, dW'⟩, ⟨S, dS'⟩]
        d_beta_T += same[:, 0]
        d_e_T += same[:, 1]
        d_c_T += torch.mul(S, dW_new, out=prod[..., :d]).sum((1, 2))
        torch.mul(d_new[i].unflatten(-1, (2, d)), keep, out=d_ws[i].unflatten(-1, (2, d)))
        d_ws[i][..., d:].addcmul_(dW_new, c_T)
        a_dnew = torch.bmm(a[i], d_new[i]).unflatten(-1, (2, d))  # [a dW' | a dS']
        d_delta[i] -= (a_dnew * u).sum(-2)
        d_u = (a_dnew * delta[i].unsqueeze(-2)).sum(-1)
        d_u_w -= d_u[..., 0]
        d_u_m -= d_u[..., 1]
        d_a[i].baddbmm_(_pair(delta[i], u), d_new[i].transpose(1, 2), alpha=-1.0)
    _release(scratch)

    # 2. Queries, last layer first: r_i = β ⊙ h W + c ⊙ h S − (C ⊙ h aᵀ) δ.
    d_beta, d_c, d_C = torch.zeros_like(dec.beta), torch.zeros_like(dec.c), torch.zeros_like(C)
    beta_c = torch.stack([dec.beta, dec.c], -1).unsqueeze(-1)  # [BH, T, 2, 1]
    d_r = dy
    d_q = dy.clone() if cfg.residual else torch.zeros_like(dy)
    for i in range(depth - 1, -1, -1):
        d, h = dims[i], cache.h[i]
        d_beta += (d_r * cache.h_ws[i][..., :d]).sum(-1)
        d_c += (d_r * cache.h_ws[i][..., d:]).sum(-1)
        g = _pair(d_r, beta_c)
        left[i].append(h)
        right[i].append(g)
        # Layer 1's g Wᵀ only feeds ∂L/∂q: it waits for the keys' and both go in one matmul.
        d_h = torch.bmm(g, ws[i].transpose(1, 2)) if i > 0 else torch.zeros_like(h)
        h_a = torch.bmm(h, a[i].transpose(1, 2))
        r_d = torch.bmm(d_r, delta[i].transpose(1, 2))  # dr_t · δ_s
        d_C -= r_d * h_a
        M = C * r_d
        d_h.baddbmm_(M, a[i], alpha=-1.0)
        d_a[i].baddbmm_(M.transpose(1, 2), h, alpha=-1.0)
        d_delta[i].baddbmm_((C * h_a).transpose(1, 2), d_r, alpha=-1.0)
        if i > 0:
            d_r = sigma_vjp(d_h, cache.r[i - 1])
        else:
            d_q += d_h
    d_C[:, -1, :] += d_u_w

    # 3. Keys, chunk by chunk from the last. A chunk's rows a, δ are used by its own keys and queries, the
    # update, and (through γ) every later chunk's keys, all already walked: their gradients are complete.
    # What does not feed the next chunk back (σ', σ'', the starting coefficients' gradients, ∂L/∂state terms,
    # θ without the bound) is done for the whole block, before or after the loop.
    ends = starts[1:] + [T]
    chunk_of_row = torch.repeat_interleave(torch.arange(len(starts)), torch.tensor([e - s for s, e in zip(starts, ends)]))
    row_coef = torch.stack([cache.start_beta, cache.start_c], -1)[:, chunk_of_row].unsqueeze(-1)  # [BH, T, 2, 1]
    sg2 = [sigma_grad2(x) for x in p[:-1]]
    d_P = [torch.empty_like(x) for x in p]  # ∂L/∂p_i
    d_M = [torch.empty_like(x) for x in m[:-1]]  # ∂L/∂m_i
    dm_WS = [x.new_empty(bh, T, 2 * d) for x, d in zip(m[:-1], dims[1:])]  # ∂L/∂m_i [W_{i+1} | S_{i+1}]
    d_k, d_v, d_theta = torch.empty_like(cache.a[0]), torch.empty_like(delta[-1]), torch.empty_like(theta)
    bounded = cfg.max_grad_norm is not None
    for j in range(len(starts) - 1, -1, -1):
        s, e = starts[j], ends[j]
        coef = row_coef[:, s : s + 1]  # [β̄_j, c̄_j]

        if bounded:
            # θ of this chunk: C = D diag(θ), u_m = θ ⊙ E[T,:], θ = θ_raw · min(1, c/‖∇ℓ‖).
            d_th = (d_C[:, :, s:e] * dec.D[:, :, s:e]).sum(-2) + d_u_m[:, s:e] * dec.E_last[:, s:e]
            sc, sq = cache.scale[:, s:e], cache.sq_norm[:, s:e]  # type: ignore[index]
            d_theta[:, s:e] = d_th * sc
            # scale = c / sqrt(max(sq, c²)): d scale / d sq = −scale / (2 sq) above the bound, 0 below
            d_sq = torch.where(sq > cfg.max_grad_norm**2, -0.5 * d_th * theta[:, s:e] * sc / sq.clamp_min(1e-30), 0.0)
            for i in range(depth):
                ai, di = a[i][:, s:e], delta[i][:, s:e]
                d_a[i][:, s:e] += (2.0 * d_sq * di.square().sum(-1)).unsqueeze(-1) * ai
                d_delta[i][:, s:e] += (2.0 * d_sq * ai.square().sum(-1)).unsqueeze(-1) * di

        gamma = C[:, s - 1, :s, None] if s else None
        d_gamma = torch.zeros_like(gamma) if s else None

        # δ recursion, first layer first (the forward pass went last first): δ_i = m_i ⊙ σ'(p_i),
        # m_i = β̄ δ_{i+1} W_{i+1}ᵀ + c̄ δ_{i+1} S_{i+1}ᵀ − (δ_{i+1} Δ_{i+1}ᵀ)(γ ⊙ A_{i+1}).
        d_p: list[Optional[Tensor]] = [None] * depth
        for i in range(depth - 1):
            dd, nxt, d = d_delta[i][:, s:e], delta[i + 1][:, s:e], dims[i + 1]
            d_m = sigma_vjp(dd, p[i][:, s:e])
            d_p[i] = dd * m[i][:, s:e] * sg2[i][:, s:e]  # type: ignore[index]
            d_M[i][:, s:e] = d_m
            dm_ws = torch.bmm(d_m, ws[i + 1])  # [d_m W | d_m S]
            dm_WS[i][:, s:e] = dm_ws
            d_nxt = d_delta[i + 1][:, s:e]
            d_nxt.add_((dm_ws.unflatten(-1, (2, d)) * coef).sum(-2))
            if s:
                d_nxt.add_(_correction_backward(nxt, delta[i + 1][:, :s], a[i + 1][:, :s], gamma, d_m,
                                                d_delta[i + 1][:, :s], d_a[i + 1][:, :s], d_gamma))

        # Layers, last first: p_i = β̄ a_i W_i + c̄ a_i S_i − (a_i Aᵀ)(γ ⊙ Δ), a_{i+1} = σ(p_i), out = p_L (+ k).
        d_out = 2.0 * d_delta[-1][:, s:e]  # δ_L = 2 (out − v)
        d_v[:, s:e] = -d_out
        d_p[-1] = d_out
        for i in range(depth - 1, -1, -1):
            x, dp = a[i][:, s:e], d_p[i]
            d_P[i][:, s:e] = dp
            d_x = d_a[i][:, s:e].clone()
            if i > 0:  # layer 1's β̄ dp W_1ᵀ + c̄ dp S_1ᵀ: after the loop, for all rows at once
                d_x.baddbmm_(_pair(dp, coef), ws[i].transpose(1, 2))
            if s:
                d_x += _correction_backward(x, a[i][:, :s], delta[i][:, :s], gamma, dp, d_a[i][:, :s],
                                            d_delta[i][:, :s], d_gamma)
            if i > 0:
                d_prev = sigma_vjp(d_x, p[i - 1][:, s:e])
                d_p[i - 1] = d_prev if d_p[i - 1] is None else d_p[i - 1] + d_prev
            else:
                d_k[:, s:e] = d_x + d_out if cfg.residual else d_x
        if s:
            d_C[:, s - 1, :s] += d_gamma.squeeze(-1)  # type: ignore[union-attr]

    if not bounded:
        d_theta = (d_C * dec.D).sum(-2) + d_u_m * dec.E_last
    # β̄_j, c̄_j weigh every product with [W | S] of chunk j's keys and δ recursion: sum those rows per chunk.
    d_rows = sum((xws.unflatten(-1, (2, d)) * dp.unsqueeze(-2)).sum(-1) for xws, dp, d in zip(a_ws, d_P, dims))
    d_rows = d_rows + sum((mws.unflatten(-1, (2, d)) * nxt.unsqueeze(-2)).sum(-1)
                          for mws, nxt, d in zip(dm_WS, delta[1:], dims[1:]))
    d_start = d_rows.new_zeros(bh, len(starts), 2).index_add_(1, chunk_of_row, d_rows)  # [BH, G, (β̄, c̄)]
    for i in range(depth):
        left[i].append(a[i])
        right[i].append(_pair(d_P[i], row_coef))
        if i > 0:
            left[i].append(d_M[i - 1])
            right[i].append(_pair(delta[i], row_coef))
    d_qk = torch.bmm(torch.cat(right[0], 1), ws[0].transpose(1, 2))  # [queries; keys] rows of layer 1
    d_q += d_qk[:, :T]
    d_k += d_qk[:, T:]
    for i in range(depth):
        d_ws[i].baddbmm_(torch.cat(left[i], 1).transpose(1, 2), torch.cat(right[i], 1))

    # Gate algebra: C = D diag(θ); the chunks' starting coefficients are rows of β, c; the update uses row T.
    prev = [s - 1 for s in starts[1:]]
    d_beta[:, prev] += d_start[:, 1:, 0]
    d_c[:, prev] += d_start[:, 1:, 1]
    d_beta[:, -1] += d_beta_T
    d_c[:, -1] += d_c_T
    decays = SpanDecays(d_beta, d_c, d_C * th.unsqueeze(-2), d_u_m * th, d_e_T)
    return BlockGrads(d_q, d_k, d_v, d_theta, decays)


# --- the scan over blocks ----------------------------------------------------------------------------


class Block(NamedTuple):
    start: int  # first token in the sequence
    end: int
    starts: list[int]  # the chunks' first tokens, relative to the block's start


def _blocks(seq: int, chunk_size: int, block_chunks: int) -> list[Block]:
    """Blocks of `block_chunks` chunks; a sequence that is not a multiple of `chunk_size` ends with a ragged chunk."""
    chunk_starts = list(range(0, seq, chunk_size))
    blocks = []
    for b in range(0, len(chunk_starts), block_chunks):
        first = chunk_starts[b : b + block_chunks]
        end = first[-1] + chunk_size if b + block_chunks < len(chunk_starts) else seq
        blocks.append(Block(first[0], end, [s - first[0] for s in first]))
    return blocks


def _span_decays(eta: Tensor, alpha: Tensor, blocks: list[Block]) -> list[SpanDecays]:
    """Decays of every block: the full-length blocks in one batched computation, then the last one if shorter."""
    length = blocks[0].end - blocks[0].start
    full = [b for b in blocks if b.end - b.start == length]
    out = []
    if full:
        stop = full[-1].end
        batched = decay_terms(eta[:, :stop].unflatten(-1, (-1, length)), alpha[:, :stop].unflatten(-1, (-1, length)))
        out = [SpanDecays(*(x[:, j] for x in batched)) for j in range(len(full))]
    if len(full) < len(blocks):
        tail = blocks[-1]
        out.append(decay_terms(eta[:, tail.start : tail.end], alpha[:, tail.start : tail.end]))
    return out


def _groups(num_blocks: int, cfg: ScanConfig) -> list[range]:
    size = math.ceil(cfg.group_chunks / cfg.block_chunks) if cfg.group_chunks else num_blocks
    return [range(s, min(s + size, num_blocks)) for s in range(0, num_blocks, size)]


def _numel(state: State) -> int:
    return sum(t.numel() for t in state)


def _run_blocks(cfg: ScanConfig, start: State, ids: range, blocks: list[Block], decays: list[SpanDecays], q, k, v,
                theta, y: Tensor, slots: list[State]) -> tuple[list[State], list[BlockCache]]:
    """Run blocks `ids` from `start`, the idx-th one's end state into `slots[idx]` (no slot: not computed);
    return every block's starting state and cache."""
    starts, caches = [start], []
    for idx, b in enumerate(ids):
        s, e = blocks[b].start, blocks[b].end
        nxt = slots[idx] if idx < len(slots) else None
        caches.append(_block_forward(cfg, starts[-1], q[:, s:e], k[:, s:e], v[:, s:e], theta[:, s:e], decays[b],
                                     blocks[b].starts, y[:, s:e], nxt))
        if nxt is not None:
            starts.append(nxt)
    return starts[: len(ids)], caches


class MemoryScan(torch.autograd.Function):
    """(q, k, v, θ, η, α, W_1, S_1, …) -> (y, W_1', S_1', …), all `[BH, …]`; see the module docstring.

    Recording for the backward pass, the blocks form groups (`ScanConfig.group_chunks` chunks each). With one
    group, the forward pass keeps every block's starting state (in a pooled buffer) and cache, and the
    backward pass uses them. With several, only the group boundaries are kept and each group is recomputed.
    """

    @staticmethod
    def forward(ctx, cfg: ScanConfig, q, k, v, theta, eta, alpha, *pairs):  # type: ignore[override]
        blocks = _blocks(q.shape[1], cfg.chunk_size, cfg.block_chunks)
        decays = _span_decays(eta, alpha, blocks)
        y = q.new_empty(q.shape[:2] + (v.shape[2],))
        template = [torch.cat(pairs[2 * i : 2 * i + 2], -1) for i in range(len(pairs) // 2)]
        size = _numel(template)
        ctx.kept, ctx.boundaries = None, []  # boundaries: the starting states of groups 2, 3, …
        groups = _groups(len(blocks), cfg) if cfg.record else [range(len(blocks))]
        if cfg.record and len(groups) == 1:
            buf = _acquire((len(blocks) + 1) * size, q)
            slots = _carve(buf, template, len(blocks) + 1)
            starts, caches = _run_blocks(cfg, _join(list(pairs), slots[0]), groups[0], blocks, decays, q, k, v, theta,
                                         y, slots[1:])
            ctx.kept = (buf, starts, caches)
            final = slots[-1]
        else:
            buf = _acquire(3 * size, q)
            slots = _carve(buf, template, 3)
            cur = _join(list(pairs), slots[2])
            for ids in groups:
                if cfg.record and ids.start > 0:
                    ctx.boundaries.append([t.clone() for t in cur])
                for b in ids:
                    # Blocks alternate between slots 0 and 1 (the input sits in slot 2).
                    _run_blocks(cfg, cur, range(b, b + 1), blocks, decays, q, k, v, theta, y, [slots[b % 2]])
                    cur = slots[b % 2]
            final = cur
        out = _split(final)
        if ctx.kept is None:
            _release(buf)
        if cfg.record:
            ctx.cfg = cfg
            ctx.save_for_backward(q, k, v, theta, eta, alpha, *pairs)
        return (y, *out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, *d_final):  # type: ignore[override]
        cfg: ScanConfig = ctx.cfg
        q, k, v, theta, eta, alpha, *pairs = ctx.saved_tensors
        blocks = _blocks(q.shape[1], cfg.chunk_size, cfg.block_chunks)
        decays = _span_decays(eta, alpha, blocks)
        d_decays: list[Optional[SpanDecays]] = [None] * len(blocks)
        # The kept states serve one backward pass; another one (retain_graph) recomputes from the input state.
        kept, ctx.kept = ctx.kept, None
        if kept is not None:
            groups, template = [range(len(blocks))], kept[1][0]
        else:
            groups = _groups(len(blocks), cfg) if ctx.boundaries else [range(len(blocks))]
            template = [torch.cat(pairs[2 * i : 2 * i + 2], -1) for i in range(len(pairs) // 2)]
            boundaries = [template, *ctx.boundaries]

        # Workspace: two slots between which the state gradient ping-pongs, then (recomputing) the block
        # states of one group.
        recompute = 0 if kept is not None else max(len(g) for g in groups) - 1
        size = _numel(template)
        buf = _acquire((2 + recompute) * size, q)
        slots = _carve(buf, template, 2 + recompute)
        d_slots, recompute_slots = slots[:2], slots[2:]
        d_cur = _join(list(d_final), d_slots[0])
        dy = dy.contiguous()
        d_q, d_k, d_v, d_theta = (torch.empty_like(t) for t in (q, k, v, theta))
        y_scratch = torch.empty_like(dy) if kept is None else None

        flip = 1
        for g in range(len(groups) - 1, -1, -1):
            ids = groups[g]
            if kept is not None:
                starts, caches = kept[1], kept[2]
            else:
                starts, caches = _run_blocks(cfg, boundaries[g], ids, blocks, decays, q, k, v, theta, y_scratch,
                                             recompute_slots[: len(ids) - 1])
            for idx in range(len(ids) - 1, -1, -1):
                b = ids[idx]
                s, e = blocks[b].start, blocks[b].end
                d_prev = d_slots[flip]
                grads = _block_backward(cfg, starts[idx], caches[idx], theta[:, s:e], decays[b], blocks[b].starts,
                                        dy[:, s:e], d_cur, d_prev)
                d_q[:, s:e], d_k[:, s:e], d_v[:, s:e], d_theta[:, s:e] = grads.q, grads.k, grads.v, grads.theta
                d_decays[b] = grads.decays
                d_cur, flip = d_prev, 1 - flip
            del starts, caches
        d_state = _split(d_cur)
        _release(buf)
        if kept is not None:
            _release(kept[0])

        # The gate algebra (η, α -> decays) is small: autograd differentiates it.
        with torch.enable_grad():
            eta_, alpha_ = eta.detach().requires_grad_(), alpha.detach().requires_grad_()
            outs = [x for block in _span_decays(eta_, alpha_, blocks) for x in block]
            d_eta, d_alpha = torch.autograd.grad(outs, (eta_, alpha_), [x for dd in d_decays for x in dd])
        return (None, d_q, d_k, d_v, d_theta, d_eta, d_alpha, *d_state)
