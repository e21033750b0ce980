"""The chunk-parallel memory with a hand-written backward pass: the fast path beside `parallel.py`.

Same mathematics as `parallel.py` (DESIGN.md §2, the dual form), organised for speed on the state,
the only large tensor: every memory layer carries W and S (`[batch·heads, d_in, d_out]`), and a chunk of
n = 16 tokens touches them only through matmuls with n rows. The autograd version spends half its time
on allocator traffic around those matmuls: a fresh state tensor per chunk page-faults, gradients of a
state used four times are summed in four fresh tensors, slicing a stacked state allocates zeros. Here

* the forward pass writes each chunk's new state into one of two reused buffers (in place, `out=`);
* the backward pass is written by hand (derivation in `_chunk_backward`), writing the gradient of each state
  in one pass with its rank-n updates; only the tiny gate algebra (η, α → decays, a few n × n matrices) goes
  through autograd;
* every state-sized operation (`x W`, `g Wᵀ`, the updates) goes through `state_ops.py`: C++ kernels for float32
  on AVX-512 CPUs, each beside its ATen reference;
* the states of a group of chunks are recomputed in the backward pass from a saved group boundary
  (activation checkpointing); with groups of √chunks (NeuralMemory's choice beyond 64 chunks) memory
  holds O(√chunks) states;
* those buffers live in a workspace (a pool of released buffers) kept between calls, so a training loop touches
  warm memory instead of page-faulting hundreds of MiB per step;
* the chunk loop itself (`_run_chunks`, `_backward_chunks`) runs in C++ where the kernels are built
  (`kernels/scan.cpp`, line for line the Python below, one slice of batch·heads rows per thread): a chunk is ~400
  small operations between its state kernels, which in Python ran on one core at a time.

Exactness is tested against `parallel.py`'s autograd path and the token-by-token reference in float64
(values and gradients, ≤ 1e-10) and by `gradcheck`, and the C++ loop against the Python one (≤ 1e-12). The
backward is not itself differentiable (no double backward); the autograd path is, and
`parallel_memory(..., implementation="autograd")` selects it.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .checks import without_autocast
from .decays import chunk_decays
from .mlp import (
    ACTIVATION_VJPS,
    ACTIVATIONS,
    chunk_step_norm,
    forward_cached,
    grad_norm_scale,
    state_norm_scale,
    token_grad_sq_norm,
)
from .rule import MemoryRule
from .state_ops import Pair, kernels, momentum_grad, update_state, weight_grad, xw, xwt

State = list[Tensor]  # [W_1, S_1, W_2, S_2, …], each [BH, d_in, d_out]


@dataclass(frozen=True)
class ScanConfig:
    """What a scan (`MemoryScan`, `triton_chunk.TritonScan`) computes besides its tensors: the rule, how to run it."""

    chunk_size: int
    rule: MemoryRule  # the update (parallel_memory's rule)
    group_chunks: Optional[int]  # chunks per recomputation group; None: one group, nothing recomputed
    record: bool  # save what the backward pass needs


class ScanInputs(NamedTuple):
    """The scan's per-token inputs `[BH, seq, ...]` (or one chunk's, `[BH, n, ...]`), and their gradients in the same
    layout: q, k, v, the learning rate θ (η and α enter as the chunks' decays), the loss's gate (None without one)."""

    q: Tensor
    k: Tensor
    v: Tensor
    theta: Tensor
    loss_gate: Optional[Tensor]

    def span(self, start: int, end: int) -> ScanInputs:
        return ScanInputs(*(None if t is None else t[:, start:end] for t in self))


class ChunkDecays(NamedTuple):
    """Gate algebra of one chunk (or of all chunks, chunk dim before the last): see `decay_terms`."""

    beta: Tensor  # β_t = Π_{j≤t}(1 − α_j)                 [.., n]
    c: Tensor  # c_t, weight of S⁰ in W_t                 [.., n]
    D: Tensor  # D[t,s] = Σ_r B[t,r] E[r,s], so C = D diag(θ) [.., n, n]
    E_last: Tensor  # E[n,s] = Π_{s<j≤n} η_j (momentum carried to the chunk's end) [.., n]
    e_last: Tensor  # e_n = Π_{j≤n} η_j                      [..]


def decay_terms(eta: Tensor, alpha: Tensor) -> ChunkDecays:
    d = chunk_decays(eta, alpha)
    return ChunkDecays(d.beta, d.c, d.B @ d.E, d.E[..., -1, :], d.e[..., -1])


# --- workspace -------------------------------------------------------------------------------------

# Released buffers by (device, dtype, made under inference mode). One pool for the process, not one per
# thread: autograd may run a backward pass on another thread than its forward (it does on CUDA), and the
# forward's buffers, released there, must come back to the forward's next call instead of piling up in the
# other thread's pool. Inference tensors may not be written outside inference mode: they have their own key.
_pool: dict[tuple[torch.device, torch.dtype, bool], list[Tensor]] = {}
_pool_lock = threading.Lock()


def _acquire(numel: int, like: Tensor) -> Tensor:
    """A flat buffer of at least `numel` elements from the pool of released buffers.

    State buffers are hundreds of MiB; fresh ones page-fault on first touch (about as slow as the matmuls
    that fill them) and glibc hands them straight back to the OS on free, so a training loop would fault
    on every step. The pool keeps released buffers warm for the next call, like a caching allocator.
    """
    with _pool_lock:
        free = _pool.setdefault((like.device, like.dtype, torch.is_inference_mode_enabled()), [])
        fitting = [i for i, buf in enumerate(free) if buf.numel() >= numel]
        if fitting:
            return free.pop(min(fitting, key=lambda i: free[i].numel()))[:numel]
        free.clear()  # every free buffer is too small: stale sizes, let them go before allocating
    return torch.empty(numel, device=like.device, dtype=like.dtype)


def _release(buf: Tensor) -> None:
    """Give a buffer from `_acquire` back to the pool (its views must no longer be used)."""
    base = buf if buf._base is None else buf._base
    with _pool_lock:
        _pool.setdefault((base.device, base.dtype, base.is_inference()), []).append(base)


def release_workspace() -> None:
    """Free the buffers the fused memory keeps between calls."""
    with _pool_lock:
        _pool.clear()


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


def _fresh_like(template: State) -> State:
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in template]


# --- one chunk, forward ------------------------------------------------------------------------------


class ChunkCache(NamedTuple):
    """What the backward pass of one chunk needs (all small: n rows)."""

    a: list[Tensor]  # layer inputs on the keys, a_1 = k
    p: list[Tensor]  # pre-activations on the keys, p_i = a_i W_i
    m: list[Tensor]  # m_i = δ_{i+1} W_{i+1}ᵀ (so δ_i = m_i ⊙ σ'(p_i)); None for the last layer
    delta: list[Tensor]  # δ_i = ∂ℓ/∂p_i per token
    step: list[Tensor]  # ρ_i δ_i, what layer i's update applies (δ_i itself where ρ_i = 1)
    dsigma: list[Tensor]  # σ'(p_i); None for the last layer
    h: list[Tensor]  # layer inputs on the queries, h_1 = q
    hW: list[Tensor]  # h_i W_i⁰
    hS: list[Tensor]  # h_i S_i⁰
    r: list[Tensor]  # pre-activations on the queries
    h_a: list[Tensor]  # h_i a_iᵀ [n, n]
    C_h_a: list[Tensor]  # C ⊙ h_i a_iᵀ
    theta: Tensor  # effective θ (after the gradient-norm bound)
    scale: Optional[Tensor]  # the bound's factor min(1, c/‖∇ℓ‖), None without a bound
    sq_norm: Optional[Tensor]  # ‖∇ℓ_t‖²
    norm: Optional[Tensor]  # the normalised chunk step's factors K (C = (D diag(θ)) ⊙ K), None without it
    C: Tensor  # C = D diag(θ) (⊙ K)
    u_m: Tensor  # the momentum's coefficients θ ⊙ E[n,:] (⊙ K[n,:])
    error: Optional[Tensor]  # e = M(k) − v where the loss's backward reads it (`Loss.needs_error`), else None
    gate: Optional[Tensor]  # the loss's per-token gate, None without one


def _chunk_forward(cfg: ScanConfig, state: State, x: ScanInputs, dec: ChunkDecays, y_out: Tensor,
                   new_state: Optional[State]) -> ChunkCache:
    """Outputs y_t = M(q_t; W_t) into `y_out` and, unless `new_state` is None, the state after the chunk."""
    rule = cfg.rule
    sigma, sigma_vjp = ACTIVATIONS[rule.activation][0], ACTIVATION_VJPS[rule.activation]
    q, k, v, theta, gate = x
    W, S = state[0::2], state[1::2]
    depth = len(W)
    # Keys at the chunk's starting weights: the associative loss ℓ_t = Σ_j h(M(k_t) − v_t)_j (eq. 12, h the rule's
    # loss) and its δ, from g = h' (`losses.py`).
    out, a, p = forward_cached(k, W, rule, matmul=xw)
    delta: list[Tensor] = [None] * depth  # type: ignore[list-item]
    m: list[Tensor] = [None] * depth  # type: ignore[list-item]
    dsigma: list[Tensor] = [None] * depth  # type: ignore[list-item]
    error = out - v
    delta[-1] = rule.loss.grad(error, gate)
    for i in range(depth - 2, -1, -1):
        m[i] = xwt(delta[i + 1], W[i + 1])
        if cfg.record:  # the backward pass multiplies by σ'(p_i) twice more: evaluate it once
            dsigma[i] = sigma_vjp(torch.ones_like(p[i]), p[i])
            delta[i] = m[i] * dsigma[i]
        else:
            delta[i] = sigma_vjp(m[i], p[i])
    scale = sq_norm = None
    if rule.max_grad_norm is not None:
        sq_norm = token_grad_sq_norm(a, delta)
        scale = grad_norm_scale(sq_norm, rule.max_grad_norm)
        theta = theta * scale
    C, u_m = dec.D * theta.unsqueeze(-2), theta * dec.E_last
    norm = None
    if rule.normalize_chunk:  # token s's step in W_t times K[t,s] (mlp.chunk_step_norm); the end state is row n
        norm = chunk_step_norm(a, delta)
        C, u_m = C * norm, u_m * norm[:, -1, :]
    beta, c = dec.beta.unsqueeze(-1), dec.c.unsqueeze(-1)
    # The hidden layers step ρ θ: their a_sᵀ δ_s terms scaled after the bounds above saw the whole gradient.
    step = [delta[i] if rule.layer_step(i, depth) == 1.0 else delta[i] * rule.layer_step(i, depth)
            for i in range(depth)]

    # Queries at W_t = β_t W⁰ + c_t S⁰ − Σ_s C[t,s] a_sᵀ δ_s, layer by layer (DESIGN.md §2 step 3), and the state after
    # the chunk, its last row (step 4): W ← β_n W⁰ + c_n S⁰ − aᵀ diag(C[n,:]) δ,  S ← e_n S⁰ − aᵀ diag(u_m) δ.
    # Both read W⁰ and S⁰: one pass over them (`update_state` returns h W⁰, h S⁰ beside the update).
    u_w = C[:, -1, :].unsqueeze(-1)
    u_m_col = u_m.unsqueeze(-1)
    h_list, hW, hS, r_list, h_a, C_h_a = [], [], [], [], [], []
    h = q
    for i in range(depth):
        h_list.append(h)
        if new_state is not None:
            reads = update_state(Pair(new_state[2 * i], new_state[2 * i + 1]), Pair(W[i], S[i]),
                                 (dec.beta[:, -1], dec.c[:, -1], dec.e_last), a[i],
                                 Pair(u_w * step[i], u_m_col * step[i]), h)
            hW.append(reads.W)
            hS.append(reads.S)
        else:
            hW.append(xw(h, W[i]))
            hS.append(xw(h, S[i]))
        r = hW[i] * beta
        r.addcmul_(hS[i], c)
        h_a.append(torch.bmm(h, a[i].transpose(1, 2)))
        C_h_a.append(C * h_a[i])
        r.baddbmm_(C_h_a[i], step[i], alpha=-1.0)
        r_list.append(r)
        h = sigma(r) if i < depth - 1 else r
    if rule.residual:
        torch.add(q, h, out=y_out)
    else:
        y_out.copy_(h)
    return ChunkCache(a, p, m, delta, step, dsigma, h_list, hW, hS, r_list, h_a, C_h_a, theta, scale, sq_norm, norm, C,
                      u_m, error if cfg.record and rule.loss.needs_error else None, gate)


# --- one chunk, backward -----------------------------------------------------------------------------


class ChunkGrads(NamedTuple):
    inputs: ScanInputs  # gradients w.r.t. q, k, v, θ and the loss's gate (None without one)
    decays: ChunkDecays  # gradients w.r.t. the ChunkDecays fields


def _chunk_backward(
    cfg: ScanConfig, state: State, cache: ChunkCache, theta: Tensor, dec: ChunkDecays, dy: Tensor,
    d_new: State, d_state: State,
) -> ChunkGrads:
    """Gradients of one chunk by hand; writes ∂L/∂(W⁰, S⁰) into `d_state` given ∂L/∂(W, S after) `d_new`.

    The forward pass, per layer i (W, S the chunk's starting state, u_w = C[n,:], u_m = θ ⊙ E[n,:]; under the
    normalised chunk step C carries ⊙ K and u_m ⊙ K[n,:]; g = h' the loss's gradient, 2e for the squared loss):
        keys:     p_i = a_i W_i,  a_{i+1} = σ(p_i),  δ_L = g(p_L (+k) − v),  δ_i = (δ_{i+1} W_{i+1}ᵀ) ⊙ σ'(p_i)
        queries:  r_i = β ⊙ h_i W_i + c ⊙ h_i S_i − (C ⊙ h_i a_iᵀ) δ_i,  h_{i+1} = σ(r_i),  y = r_L (+q)
        update:   W_i' = β_n W_i + c_n S_i − a_iᵀ (u_w ⊙ δ_i),  S_i' = e_n S_i − a_iᵀ (u_m ⊙ δ_i)
    and this function walks it in reverse: update, queries (last layer first), the θ algebra, the δ
    recursion (whose σ'' terms are the second-order part of the outer gradient), then the keys.
    """
    rule = cfg.rule
    sigma_grad2, sigma_vjp = ACTIVATIONS[rule.activation][2], ACTIVATION_VJPS[rule.activation]
    W, S = state[0::2], state[1::2]
    dW_new, dS_new = d_new[0::2], d_new[1::2]
    dW, dS = d_state[0::2], d_state[1::2]
    a, p, m, delta, h, hW, hS, r = cache.a, cache.p, cache.m, cache.delta, cache.h, cache.hW, cache.hS, cache.r
    C, th, u_m = cache.C, cache.theta, cache.u_m
    depth = len(W)
    u_w = C[:, -1, :]

    # 1–2. State update and queries, last layer first. Per layer, one pass over ∂W', ∂S', W, S (`momentum_grad`) gives
    # every product of this part with them:
    #   update:   ∂δ_i = −(u_w ⊙ a ∂W' + u_m ⊙ a ∂S'),  ∂a_i = −((u_w ⊙ δ) ∂W'ᵀ + (u_m ⊙ δ) ∂S'ᵀ),
    #             ∂S⁰ = e_n ∂S' + c_n ∂W' + hᵀ (c ⊙ ∂r), with ∂c_n = Σ⟨S, ∂W'⟩ and ∂e_n = Σ⟨S, ∂S'⟩;
    #   queries:  ∂h_i = (β ⊙ ∂r) Wᵀ + (c ⊙ ∂r) Sᵀ.
    # ∂W⁰ = β_n ∂W' + (rank-n terms) is written in step 5, once all its rank-n terms are known; that pass also gives
    # ∂β_n = Σ⟨W, ∂W'⟩.
    d_u_w = torch.zeros_like(u_w)
    d_u_m = torch.zeros_like(u_m)
    d_c_n = torch.zeros_like(dec.e_last)
    d_e_n = torch.zeros_like(dec.e_last)
    d_beta = torch.zeros_like(dec.beta)
    d_c = torch.zeros_like(dec.c)
    d_C = torch.zeros_like(C)
    beta, c = dec.beta.unsqueeze(-1), dec.c.unsqueeze(-1)
    d_delta: list[Tensor] = [None] * depth  # type: ignore[list-item]
    d_a: list[Tensor] = [None] * depth  # type: ignore[list-item]
    # Rank-n terms of ∂L/∂W_i are collected and applied in one pass over all of them (K = 2n or 3n rows instead
    # of three K = n updates: fewer passes over the state), read in place as blocks of rows.
    w_left: list[list[Tensor]] = [[] for _ in range(depth)]
    w_right: list[list[Tensor]] = [[] for _ in range(depth)]
    d_r = dy
    # Without the residual, v (hence dy) may be narrower or wider than q and k: size d_q, d_k like them.
    d_q = dy.clone() if rule.residual else torch.zeros_like(h[0])
    for i in range(depth - 1, -1, -1):
        g_w, g_s = beta * d_r, c * d_r
        step_i = cache.step[i]
        g_u_w, g_u_m = u_w.unsqueeze(-1) * step_i, u_m.unsqueeze(-1) * step_i
        reads = momentum_grad(dS[i], Pair(dW_new[i], dS_new[i]), Pair(W[i], S[i]), (dec.c[:, -1], dec.e_last), h[i],
                              a[i], (Pair(g_u_w, g_u_m), Pair(g_w, g_s)))
        a_dS, a_dW, d_h = reads.a_dS, reads.a_dW, reads.h_grad
        d_e_n += reads.d_e
        d_c_n += reads.d_c
        d_delta[i] = -(u_w.unsqueeze(-1) * a_dW + u_m.unsqueeze(-1) * a_dS)
        d_u_w -= (a_dW * step_i).sum(-1)
        d_u_m -= (a_dS * step_i).sum(-1)
        d_a[i] = reads.a_grad.neg_()
        d_beta += (d_r * hW[i]).sum(-1)
        d_c += (d_r * hS[i]).sum(-1)
        w_left[i].append(h[i])
        w_right[i].append(g_w)
        # r −= (C ⊙ h aᵀ) ρ δ
        r_d = torch.bmm(d_r, step_i.transpose(1, 2))  # dr_t · ρ δ_s
        d_C -= r_d * cache.h_a[i]
        M = C * r_d
        d_h.baddbmm_(M, a[i], alpha=-1.0)
        d_a[i].baddbmm_(M.transpose(1, 2), h[i], alpha=-1.0)
        d_delta[i].baddbmm_(cache.C_h_a[i].transpose(1, 2), d_r, alpha=-1.0)
        if rule.layer_step(i, depth) != 1.0:  # so far the gradient of ρ δ_i: make it that of δ_i
            d_delta[i].mul_(rule.layer_step(i, depth))
        if i > 0:
            d_r = sigma_vjp(d_h, r[i - 1])
        else:
            d_q += d_h

    # 3. θ: C = D diag(θ) (⊙ K), u_w = C[n,:], u_m = θ ⊙ E[n,:] (⊙ K[n,:]), θ = θ_raw · min(1, c/‖∇ℓ‖); K is a
    # constant to the outer gradient, so it only scales what reaches D, E and θ.
    d_C[:, -1, :] += d_u_w
    if cache.norm is not None:
        d_C = d_C * cache.norm
        d_u_m = d_u_m * cache.norm[:, -1, :]
    d_th = (d_C * dec.D).sum(-2) + d_u_m * dec.E_last
    d_D = d_C * th.unsqueeze(-2)
    d_E_last = d_u_m * th
    d_theta = d_th
    if rule.max_grad_norm is not None:
        d_theta = d_th * cache.scale
        # scale = c / sqrt(max(sq, c²)): d scale / d sq = −scale / (2 sq) above the bound, 0 below
        above = cache.sq_norm > rule.max_grad_norm**2
        d_sq = torch.where(above, -0.5 * d_th * theta * cache.scale / cache.sq_norm.clamp_min(1e-30), 0.0)
        for i in range(depth):
            sa, sd = (a[i] * a[i]).sum(-1), (delta[i] * delta[i]).sum(-1)
            d_a[i] += (2.0 * d_sq * sd).unsqueeze(-1) * a[i]
            d_delta[i] += (2.0 * d_sq * sa).unsqueeze(-1) * delta[i]

    # 4. δ recursion: δ_i = m_i ⊙ σ'(p_i), m_i = δ_{i+1} W_{i+1}ᵀ.
    d_p: list[Optional[Tensor]] = [None] * depth
    for i in range(depth - 1):
        d_m = d_delta[i] * cache.dsigma[i]
        d_p[i] = d_delta[i] * m[i] * sigma_grad2(p[i])
        w_left[i + 1].append(d_m)
        w_right[i + 1].append(delta[i + 1])
        xw(d_m, W[i + 1], out=d_delta[i + 1], accumulate=True)
    # δ_L = g(e), e = out − v: ∂L/∂e = ∂L/∂δ_L ⊙ g'(e) (2 ∂L/∂δ_L for the squared loss), and the loss's gate's
    # gradient (∂g/∂gate, summed over the output's coordinates)
    d_out, d_gate = rule.loss.backward(d_delta[-1], cache.error, cache.gate)
    d_v = -d_out

    # 5. Keys: p_i = a_i W_i, a_{i+1} = σ(p_i), out = p_L (+ k).
    d_k = d_out.clone() if rule.residual else torch.zeros_like(a[0])
    d_p[-1] = d_out
    for i in range(depth - 1, -1, -1):
        w_left[i].append(a[i])
        w_right[i].append(d_p[i])
        d_beta[:, -1] += weight_grad(dW[i], dW_new[i], dec.beta[:, -1], w_left[i], w_right[i], W[i])
        xwt(d_p[i], W[i], out=d_a[i], accumulate=True)
        if i > 0:
            d_p[i - 1].addcmul_(d_a[i], cache.dsigma[i - 1])
        else:
            d_k += d_a[0]

    d_c[:, -1] += d_c_n
    return ChunkGrads(ScanInputs(d_q, d_k, d_v, d_theta, d_gate), ChunkDecays(d_beta, d_c, d_D, d_E_last, d_e_n))


# --- the scan over chunks ----------------------------------------------------------------------------

# The chunk loop runs in C++ (`kernels/scan.cpp`: `_run_chunks` and `_backward_chunks` line for line, one slice of
# batch·heads rows per thread) wherever the kernels are built and the tensors are on the CPU; False keeps it in
# Python, the reference that loop is tested against (`tests/memory/test_native_scan.py`).
NATIVE = True


def _native(x: Tensor):
    """The compiled module whose chunk loop serves `x`, or None."""
    return kernels() if NATIVE and x.is_cpu else None


def _bounds(j: int, seq: int, chunk_size: int) -> tuple[int, int]:
    """Token range of chunk j; the last chunk of a ragged sequence is shorter."""
    return j * chunk_size, min((j + 1) * chunk_size, seq)


def chunk_blocks(x: Tensor, chunk_size: int) -> list[Tensor]:
    """A per-token gate `[BH, seq, ...]` as its full chunks `[BH, chunks, n, ...]` (where there are any), then its
    ragged tail `[BH, 1, r, ...]` (where there is one): the blocks whose decays are computed in one batch each."""
    seq = x.shape[1]
    full = seq - seq % chunk_size
    return ([x[:, :full].unflatten(1, (-1, chunk_size))] if full else []) + \
        ([x[:, full:].unsqueeze(1)] if full < seq else [])


def _block_decays(eta: Tensor, alpha: Tensor, chunk_size: int) -> list[ChunkDecays]:
    """Decays of all full chunks in one batched computation (chunk dim 1), then of the ragged tail."""
    return [decay_terms(e, a) for e, a in zip(chunk_blocks(eta, chunk_size), chunk_blocks(alpha, chunk_size))]


def _decays_of(blocks: list[ChunkDecays], j: int) -> ChunkDecays:
    """Chunk j's view into the blocks of `_block_decays`."""
    full = blocks[0].beta.shape[1]
    block, at = (blocks[0], j) if j < full or len(blocks) == 1 else (blocks[1], j - full)
    return ChunkDecays(*(x[:, at] for x in block))


def _groups(num_chunks: int, group_chunks: Optional[int]) -> list[range]:
    size = group_chunks or num_chunks
    return [range(s, min(s + size, num_chunks)) for s in range(0, num_chunks, size)]


def _state_numel(state: State) -> int:
    return sum(t.numel() for t in state)


def _state_norms(state: State) -> Tensor:
    """‖·‖_F of every matrix of a state, per row: `[BH, len(state)]`."""
    return torch.stack([torch.linalg.vector_norm(t, dim=(-2, -1)) for t in state], dim=1)


def _quad(gram: Tensor, u: Tensor) -> Tensor:
    """uᵀ G u per row, for G `[BH, n, n]` and u `[BH, n]`."""
    return (torch.bmm(gram, u.unsqueeze(-1)).squeeze(-1) * u).sum(-1)


def _next_norm_bound(cache: ChunkCache, dec: ChunkDecays, bound: Tensor) -> Tensor:
    """An upper bound on the norms of a chunk's end state, from one on its start state's, without a pass over the state:
    W' = β_n W + c_n S − aᵀ(u_w ⊙ δ) and S' = e_n S − aᵀ(u_m ⊙ δ) (β_n, c_n, e_n ≥ 0), with
    ‖aᵀ(u ⊙ δ)‖²_F = uᵀ((a aᵀ) ⊙ (δ δᵀ)) u from n × n products."""
    u_w, u_m = cache.C[:, -1, :], cache.u_m
    beta_n, c_n, e_n = dec.beta[:, -1:], dec.c[:, -1:], dec.e_last.unsqueeze(-1)
    w, s = bound[:, 0::2], bound[:, 1::2]
    rank_w, rank_s = [], []
    for a, delta in zip(cache.a, cache.step):  # the step each layer takes: ρ δ for a hidden layer
        gram = torch.bmm(a, a.transpose(1, 2)) * torch.bmm(delta, delta.transpose(1, 2))
        rank_w.append(_quad(gram, u_w))
        rank_s.append(_quad(gram, u_m))
    new_w = beta_n * w + c_n * s + torch.stack(rank_w, 1).clamp_min(0).sqrt()
    new_s = e_n * s + torch.stack(rank_s, 1).clamp_min(0).sqrt()
    return torch.stack([new_w, new_s], dim=2).flatten(1)  # back to [W_1, S_1, W_2, S_2, …]


def _without_host_reads(t: Tensor) -> bool:
    """Whether the bound skips its data-dependent branches for `t`: on an accelerator every read of a device value on
    the host waits for the whole queue (a sync per chunk), so there the state is measured and scaled every chunk, a
    pass over it that changes no value (a factor of 1 is exact); on a CPU the reads are free and spare that pass."""
    return t.device.type != "cpu"


def _bound_state(cfg: ScanConfig, state: State, scales: Tensor, bound: Tensor) -> Tensor:
    """The bounded state: every matrix of a chunk's end state back on its ball ‖·‖_F ≤ max_state_norm · √d_out, in
    place; the factors min(1, R / ‖·‖) go to `scales` `[BH, len(state)]`, for the backward pass. `bound` (from
    `_next_norm_bound`) bounds the matrices' norms from above: a matrix is read for its norm only where the bound
    reaches its ball (almost never), so the rule costs no pass over the state. Returns the bound after the chunk."""
    for i, t in enumerate(state):
        limit = cfg.rule.max_state_norm * t.shape[-1] ** 0.5
        always = _without_host_reads(t)
        if always or bool((bound[:, i] > limit * (1 - 1e-3)).any()):  # may be outside: measure, and bring back
            factor = state_norm_scale(t, cfg.rule.max_state_norm)
            scales[:, i] = factor.view(-1)
            bound[:, i] = torch.linalg.vector_norm(t, dim=(-2, -1)).clamp_max(limit)
            if always or bool((factor < 1).any()):
                t.mul_(factor)
    return bound


def _scale_rows(state: State, scales: Tensor) -> None:
    """Each matrix times its recorded factor, in place: the backward pass of `_bound_state` (its factors are constants
    to the outer gradient), and its replay when a group of chunks is recomputed."""
    if _without_host_reads(scales) or bool((scales < 1).any()):
        for i, t in enumerate(state):
            t.mul_(scales[:, i].view(-1, 1, 1))


class Record(NamedTuple):
    """What the backward pass needs of a run of chunks (the native loop keeps its own, `ScanRecord`)."""

    first_chunk: int
    starts: list[State]  # each chunk's starting state
    caches: list[ChunkCache]


class Outputs(NamedTuple):
    """Where `_run_chunks` writes: the outputs y `[BH, seq, d_out]`, the state after each chunk (chunk idx of the run in
    `slots[idx % len(slots)]`, the last one in `last`; None: not computed) and, where the state is bounded, each
    chunk's factors (`scales` `[chunks, BH, len(state)]`, None where it is not)."""

    y: Tensor
    slots: list[State]
    last: Optional[State]
    scales: Optional[Tensor]


def _run_chunks(cfg: ScanConfig, x: ScanInputs, blocks: list[ChunkDecays], chunks: range, start: State, out: Outputs,
                keep: bool, replay: bool = False):
    """Run `chunks` from the state `start` into `out`. Where `out.scales` is given the state is bounded: `_bound_state`
    writes chunk j's factors into `scales[j]`, or, with `replay` (the backward pass's recomputation), the recorded
    factors are applied. With `keep`, return what `_backward_chunks` needs (a `Record`), else None."""
    native = _native(x.q)
    if native is not None:
        record = native.run_chunks(native_config(cfg), native.ScanInputs(*x), [list(b) for b in blocks],
                                   (chunks.start, chunks.stop), start,
                                   native.ScanOutputs(out.y, out.slots, out.last or [], out.scales), keep, replay)
        return record if keep else None
    y, slots, last, scales = out
    starts, caches, cur = [], [], start
    bound = _state_norms(start) if scales is not None and not replay else None
    for idx, j in enumerate(chunks):
        s, e = _bounds(j, x.q.shape[1], cfg.chunk_size)
        nxt = slots[idx % len(slots)] if j + 1 < chunks.stop else last
        dec = _decays_of(blocks, j)
        cache = _chunk_forward(cfg, cur, x.span(s, e), dec, y[:, s:e], nxt)
        if nxt is not None and scales is not None:
            if replay:
                _scale_rows(nxt, scales[j])
            else:
                bound = _bound_state(cfg, nxt, scales[j], _next_norm_bound(cache, dec, bound))
        if keep:
            starts.append(cur)
            caches.append(cache)
        cur = nxt
    return Record(chunks.start, starts, caches) if keep else None


def _backward_chunks(cfg: ScanConfig, record, x: ScanInputs, blocks: list[ChunkDecays], d_blocks: list[ChunkDecays],
                     dy: Tensor, d_end: State, targets: list[State], grads: ScanInputs,
                     scales: Optional[Tensor]) -> None:
    """The recorded chunks in reverse: the i-th from the end writes the gradient of its starting state into
    `targets[i]`, given that of its end state (`d_end`, then the previous target; scaled in place by the chunk's
    `scales` where the state is bounded), and its rows of the inputs' gradients `grads` and of the decays' gradients
    `d_blocks`."""
    if not isinstance(record, Record):
        native = _native(dy)
        native.backward_chunks(native_config(cfg), record, native.ScanInputs(*x), [list(b) for b in blocks],
                               [list(b) for b in d_blocks], dy, d_end, targets, native.ScanInputs(*grads), scales)
        return
    d_cur = d_end
    for i, idx in enumerate(range(len(record.caches) - 1, -1, -1)):
        j = record.first_chunk + idx
        s, e = _bounds(j, dy.shape[1], cfg.chunk_size)
        if scales is not None:
            _scale_rows(d_cur, scales[j])
        chunk = _chunk_backward(cfg, record.starts[idx], record.caches[idx], x.theta[:, s:e], _decays_of(blocks, j),
                                dy[:, s:e], d_cur, targets[i])
        for dst, src in zip(grads, chunk.inputs):
            if dst is not None:
                dst[:, s:e] = src
        for dst, src in zip(_decays_of(d_blocks, j), chunk.decays):
            dst.copy_(src)
        d_cur = targets[i]


@functools.lru_cache(maxsize=256)
def native_config(cfg: ScanConfig):
    """The C++ loop's config (`kernels/scan.cpp`, `Config`) of a scan: the one place the rule crosses to C++. A loss the
    C++ loop lacks is refused here, naming the implementations that serve it."""
    module = kernels()
    rule = cfg.rule
    native = module.ScanConfig()
    native.chunk_size = cfg.chunk_size
    native.gelu = {"gelu": True, "silu": False}[rule.activation]
    native.residual = rule.residual
    native.max_grad_norm = rule.max_grad_norm
    native.max_state_norm = rule.max_state_norm
    native.normalize_chunk = rule.normalize_chunk
    native.hidden_step = float(rule.hidden_step)
    native.record = cfg.record
    if rule.loss.name not in module.LOSSES:
        raise ValueError(f"the fused scan's C++ loop has no {rule.loss.name} loss (kernels/losses.h): use "
                         "parallel_memory(..., implementation='autograd'), or fused.NATIVE = False for the Python loop")
    native.set_loss(rule.loss.name, *rule.loss.native_params(), rule.loss.has_gate)
    return native


def refuse_double_backward(name: str) -> None:
    """Refuse a backward pass taken under create_graph=True (the only time grad mode is on in one). The scans'
    backward passes are written by hand and not differentiable; `once_differentiable` raises only when an incoming
    gradient requires grad, so a loss linear in y would get a silent zero second derivative instead."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"the {name} memory's backward pass is not differentiable (create_graph=True): use "
                           "parallel_memory(..., implementation='autograd') for higher-order gradients")


class MemoryScan(torch.autograd.Function):
    """(q, k, v, θ, η, α, loss gate or None, W_1, S_1, …) -> (y, W_1', S_1', …), all `[BH, …]`; see the module
    docstring.

    Recording for the backward pass, the chunks form groups (`ScanConfig.group_chunks`). With one group,
    the forward pass keeps every chunk's state and cache (in a pooled buffer) and the backward pass
    uses them. With several, only the group boundaries are kept and each group is recomputed.
    """

    @staticmethod
    def forward(ctx, cfg: ScanConfig, q, k, v, theta, eta, alpha, loss_gate, *state):  # type: ignore[override]
        x = ScanInputs(q, k, v, theta, loss_gate)
        num_chunks = -(-q.shape[1] // cfg.chunk_size)
        blocks = _block_decays(eta, alpha, cfg.chunk_size)
        groups = _groups(num_chunks, cfg.group_chunks) if cfg.record else [range(num_chunks)]
        y = q.new_empty(q.shape[:2] + (v.shape[2],))
        template = list(state)
        ctx.kept = None
        # Factors of the bounded state, per chunk, row and state matrix (1 where a matrix was within its ball).
        scales = q.new_ones(num_chunks, q.shape[0], len(state)) if cfg.rule.max_state_norm is not None else None
        ctx.scales = scales
        if cfg.record and len(groups) == 1:
            buf = _acquire(max(num_chunks - 1, 1) * _state_numel(template), q)
            final = _fresh_like(template)
            record = _run_chunks(cfg, x, blocks, groups[0], template,
                                 Outputs(y, _carve(buf, template, num_chunks - 1), final, scales), keep=True)
            ctx.kept = (buf, record)
            boundaries: list[Tensor] = []
        else:
            buf = _acquire(2 * _state_numel(template), q)
            slots = _carve(buf, template, 2)
            cur, boundaries = template, []
            for chunks in groups:
                if chunks.start > 0:
                    boundaries.extend(cur)
                # Chunks alternate between the two slots; a group's end state is fresh memory (saved as the next
                # group's boundary, or returned).
                last = _fresh_like(template)
                _run_chunks(cfg, x, blocks, chunks, cur, Outputs(y, slots, last, scales), keep=False)
                cur = last
            final = cur
            _release(buf)
        if cfg.record:
            ctx.cfg, ctx.n_state = cfg, len(state)
            # An output the loss does not use (in training, usually the final state) gets None in the backward pass
            # instead of a state-sized tensor of zeros that would only be copied.
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(q, k, v, theta, eta, alpha, loss_gate, *state, *boundaries)
        return (y, *final)

    @staticmethod
    def backward(ctx, dy, *d_final):  # type: ignore[override]
        refuse_double_backward("fused")
        return MemoryScan._backward(ctx, dy, *d_final)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def _backward(ctx, dy, *d_final):
        cfg: ScanConfig = ctx.cfg
        q, k, v, theta, eta, alpha, loss_gate, *saved = ctx.saved_tensors
        x = ScanInputs(q, k, v, theta, loss_gate)
        n = ctx.n_state
        boundaries = [list(saved[i : i + n]) for i in range(0, len(saved), n)]  # first: the input state
        template = boundaries[0]
        num_chunks = -(-q.shape[1] // cfg.chunk_size)
        # The gate algebra (η, α -> decays) is small: autograd differentiates it at the end, from this graph.
        with torch.enable_grad():
            eta_, alpha_ = eta.detach().requires_grad_(), alpha.detach().requires_grad_()
            graph_blocks = _block_decays(eta_, alpha_, cfg.chunk_size)
        blocks = [ChunkDecays(*(x.detach() for x in block)) for block in graph_blocks]
        d_blocks = [ChunkDecays(*(torch.zeros_like(x) for x in block)) for block in blocks]
        kept, ctx.kept = ctx.kept, None
        groups = [range(num_chunks)] if kept is not None else _groups(num_chunks, cfg.group_chunks)

        # Workspace: two slots between which the state gradient ping-pongs, then (recomputing) the chunk
        # states of one group.
        recompute = 0 if kept is not None else max(len(g) for g in groups) - 1
        buf = _acquire((2 + recompute) * _state_numel(template), q)
        slots = _carve(buf, template, 2 + recompute)
        d_slots, recompute_slots = slots[:2], slots[2:]
        d_cur = d_slots[0]
        for t, d in zip(d_cur, d_final):
            t.zero_() if d is None else t.copy_(d)
        dy = q.new_zeros(q.shape[:2] + (v.shape[2],)) if dy is None else dy.contiguous()
        grads = ScanInputs(*(None if t is None else torch.empty_like(t) for t in x))
        y_scratch = torch.empty_like(dy) if kept is None else None

        flip = 1
        for g in range(len(groups) - 1, -1, -1):
            chunks = groups[g]
            record = kept[1] if kept is not None else _run_chunks(
                cfg, x, blocks, chunks, boundaries[g], Outputs(y_scratch, recompute_slots, None, ctx.scales), keep=True,
                replay=True)
            # The first chunk's gradient leaves the function: fresh memory, not the workspace.
            targets = []
            for j in reversed(chunks):
                targets.append(_fresh_like(template) if j == 0 else d_slots[flip])
                flip = 1 - flip
            _backward_chunks(cfg, record, x, blocks, d_blocks, dy, d_cur, targets, grads, ctx.scales)
            d_cur = targets[-1]
            del record
        _release(buf)
        if kept is not None:
            _release(kept[0])

        outs = [t for block in graph_blocks for t in block]
        d_eta, d_alpha = torch.autograd.grad(outs, (eta_, alpha_), [t for b in d_blocks for t in b])
        d_q, d_k, d_v, d_theta, d_gate = grads
        return (None, d_q, d_k, d_v, d_theta, d_eta, d_alpha, d_gate, *d_cur)
