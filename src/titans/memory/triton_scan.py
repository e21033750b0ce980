"""The chunk-parallel memory as Triton kernels: the GPU path beside `fused.py` (DESIGN.md §2, the dual form).

Same mathematics as `fused.py`, line for line, with the chunk loop inside the kernel: one program per batch·head row
runs every chunk of the sequence, its state (W_i, S_i of each layer) held on chip from chunk to chunk, so a chunk
costs no kernel launch and no trip of the state through memory. Per chunk of n tokens the program

1. forwards the keys through M(·; W⁰) and back-propagates ℓ by hand (δ_i), bounds each token's step
   (max_grad_norm), forms C = D diag(θ) and, under the normalised chunk step, its Gram factors K;
2. answers the queries at W_t = β_t W⁰ + c_t S⁰ − Σ_s C[t,s] a_sᵀ δ_s layer by layer (step 3);
3. writes the state after the chunk (step 4) and puts it back on its ball (max_state_norm), recording the factors.

The backward kernel walks the chunks in reverse from each chunk's saved starting state, recomputing the chunk's
n-row forward (cheap) and then `fused._chunk_backward`'s steps 1–5, the gradient of the state carried on chip. With
recomputation groups (`ScanConfig.group_chunks`) the forward keeps only each group's starting state and the backward
re-runs the forward kernel over one group at a time. The gate algebra (η, α → β, c, D = B E, E[n,:], e_n; n × n per
chunk) is computed and differentiated by autograd outside the kernels, as in `fused.py`.

What the kernels serve is decided in `unsupported` (memory depth 1 or 2, each state matrix at most `MAX_STATE_BLOCK`
elements once padded to powers of two, CUDA tensors or the interpreter); `parallel.py` asks it in one place. q, k, v
may be bf16 (read as such, computed in the state's dtype); the state is float32 (float64 for tests). Matmuls run at
IEEE precision (no TF32): the outer gradient goes through hundreds of chunk steps.

Under `TRITON_INTERPRET=1` (set before this module is imported) the kernels run on CPU tensors through Triton's numpy
interpreter: `tests/memory/test_triton.py` holds them to the token-by-token reference and the autograd path there,
on every machine.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .checks import without_autocast
from .fused import ChunkDecays, ScanConfig, _block_decays, _groups, refuse_double_backward

# Set before this module is imported (`triton.jit` reads it when it decorates): the kernels run on CPU tensors, in
# numpy.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# What a program holds on chip: its state matrices (d_in × d_out, each padded to a power of two ≥ 16) and the
# chunk's tiles (CH rows). The backward kernel's shared memory grows with both, and an sm_90 GPU (H100, H200) gives a
# program at most SHARED_MEMORY_LIMIT. State matrices of up to 2048 elements (32 × 64, 16 × 128, 128 × 16, …) in
# chunks of 16 stay under it. 64 × 64 does not, and neither does 128 × 16 in chunks of 32. An H100 refused 64 × 128
# with "out of resource: shared memory". tests/memory/test_triton.py compiles the largest shapes admitted here for
# sm_90. Larger shapes take the fused chunk loop (DESIGN.md §2).
MAX_STATE_BLOCK = 64 * 32
MAX_CHUNK_BLOCK = 16
SHARED_MEMORY_LIMIT = 227 * 1024

_ACTIVATION_CODES = {"gelu": 0, "silu": 1}
# A compiled kernel reads a module global only as a tl.constexpr (the interpreter reads any global, so only a
# compilation catches a plain float here: tests/memory/test_triton.py compiles every kernel for sm_90).
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT2PI = tl.constexpr(0.3989422804014327)


def _block(n: int) -> int:
    """A tile side: the next power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def unsupported(q: Tensor, weights, chunk_size: int) -> Optional[str]:
    """Why the kernels cannot serve a call with these queries, state and chunk size, or None where they can."""
    if not (q.is_cuda or (INTERPRET and q.is_cpu)):
        return (f"the tensors are on {q.device}: the Triton kernels run on CUDA tensors (or on CPU tensors under "
                "TRITON_INTERPRET=1, set before titans.memory.triton_scan is imported)")
    if len(weights) not in (1, 2):
        return f"memory depth {len(weights)}: the Triton kernels serve depth 1 and 2"
    if weights[0].dtype not in (torch.float32, torch.float64):
        return f"state dtype {weights[0].dtype}: the Triton kernels keep a float32 (or float64) state"
    if q.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return f"q/k/v dtype {q.dtype}: the Triton kernels read float32, float64, bfloat16 or float16"
    for i, w in enumerate(weights):
        block = _block(w.shape[-2]) * _block(w.shape[-1])
        if block > MAX_STATE_BLOCK:
            return (f"weights[{i}] is {w.shape[-2]} × {w.shape[-1]} ({block} elements padded), above the "
                    f"{MAX_STATE_BLOCK} a Triton program holds on chip")
    if _block(chunk_size) > MAX_CHUNK_BLOCK:
        return f"chunk size {chunk_size}: a Triton program holds chunks of at most {MAX_CHUNK_BLOCK} tokens on chip"
    return None


# --- elementwise pieces ----------------------------------------------------------------------------


@triton.jit
def _act(x, ACT: tl.constexpr):
    """σ: the exact (erf) GELU, or SiLU."""
    if ACT == 0:
        return 0.5 * x * (1.0 + tl.math.erf(x * _INV_SQRT2))
    else:
        return x * tl.sigmoid(x)


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    """σ' (mlp._gelu_grad, mlp._silu_grad)."""
    if ACT == 0:
        return 0.5 * (1.0 + tl.math.erf(x * _INV_SQRT2)) + x * tl.exp(-0.5 * x * x) * _INV_SQRT2PI
    else:
        s = tl.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))


@triton.jit
def _act_grad2(x, ACT: tl.constexpr):
    """σ'' (mlp._gelu_grad2, mlp._silu_grad2): the δ recursion's second-order part of the outer gradient."""
    if ACT == 0:
        return tl.exp(-0.5 * x * x) * _INV_SQRT2PI * (2.0 - x * x)
    else:
        s = tl.sigmoid(x)
        return s * (1.0 - s) * (2.0 + x * (1.0 - 2.0 * s))


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _row(m, rows, at):
    """Row `at` of m as a vector over its columns."""
    return tl.sum(tl.where(rows[:, None] == at, m, 0.0), axis=0)


@triton.jit
def _entry(vec, idx, at):
    return tl.sum(tl.where(idx == at, vec, 0.0), axis=0)


@triton.jit
def _load(ptr, rows, cols, n_rows, n_cols, stride, DT: tl.constexpr):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(DT)


@triton.jit
def _store(ptr, x, rows, cols, n_rows, n_cols, stride):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(ptr + rows[:, None] * stride + cols[None, :], x.to(ptr.dtype.element_ty), mask=mask)


# --- one chunk ---------------------------------------------------------------------------------------


@triton.jit
def _chunk_forward(q, k, v, theta_raw, beta, c, D, E_last, W1, S1, W2, S2, rows, last, max_grad_norm, hidden_step,
                   DEPTH: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr, GRAD_BOUND: tl.constexpr,
                   NORMALIZE: tl.constexpr):
    """`fused._chunk_forward` for one batch·head row: y and everything the chunk's update and backward pass use.

    Rows past `last` (a ragged chunk's padding) hold zeros in q, k, v, θ and the decays, and get δ = 0. With depth 1
    the layer-2 values are placeholders (W2, S2 are unused then)."""
    # Keys at the chunk's starting weights: ℓ_t = ‖M(k_t) − v_t‖² (eq. 12) and δ_i = ∂ℓ/∂p_i by hand (DESIGN.md §2).
    p1 = _mm(k, W1)
    if DEPTH == 2:
        a2 = _act(p1, ACT)
        p2 = _mm(a2, W2)
        out = p2
    else:
        a2 = p1
        out = p1
    if RESIDUAL:
        out = out + k
    delta_last = tl.where((rows <= last)[:, None], 2.0 * (out - v), 0.0)
    if DEPTH == 2:
        delta2 = delta_last
        m1 = _mm(delta2, tl.trans(W2))
        dsigma1 = _act_grad(p1, ACT)
        delta1 = m1 * dsigma1
        # ‖∇ℓ_t‖² = Σ_i ‖a_i‖² ‖δ_i‖² (mlp.token_grad_sq_norm)
        sq_norm = tl.sum(k * k, 1) * tl.sum(delta1 * delta1, 1) + tl.sum(a2 * a2, 1) * tl.sum(delta2 * delta2, 1)
    else:
        delta1 = delta_last
        delta2 = delta_last
        m1 = p1
        dsigma1 = p1
        sq_norm = tl.sum(k * k, 1) * tl.sum(delta1 * delta1, 1)
    if GRAD_BOUND:  # θ_t · min(1, c/‖∇ℓ_t‖) (mlp.grad_norm_scale)
        scale = max_grad_norm / tl.sqrt(tl.maximum(sq_norm, max_grad_norm * max_grad_norm))
        theta = theta_raw * scale
    else:
        scale = theta_raw
        theta = theta_raw
    C = D * theta[None, :]  # C[t,s] = Σ_r B[t,r] E[r,s] θ_s
    u_m = theta * E_last  # the momentum's coefficients θ ⊙ E[n,:]
    if NORMALIZE:  # K[t,s] = G_ss / Σ_{r≤t} |G_sr| (mlp.chunk_step_norm); G is symmetric, so the sum runs down rows
        gram = _mm(k, tl.trans(k)) * _mm(delta1, tl.trans(delta1))
        if DEPTH == 2:
            gram += _mm(a2, tl.trans(a2)) * _mm(delta2, tl.trans(delta2))
        overlap = tl.cumsum(tl.abs(gram), axis=0)
        own = tl.sum(tl.where(rows[:, None] == rows[None, :], gram, 0.0), axis=0)  # G_ss, over s
        # overlap ≥ G_ss ≥ 0, so where it is 0 so is G_ss: K = 0 there (the reference's clamp to `tiny`)
        norm = tl.where(rows[None, :] <= rows[:, None], own[None, :] / tl.where(overlap > 0, overlap, 1.0), 0.0)
        C = C * norm
        u_m = u_m * _row(norm, rows, last)
    else:
        norm = C
    # The hidden layer steps ρ θ: its a_sᵀ δ_s terms scaled after the bounds above saw the whole gradient.
    if DEPTH == 2:
        step1 = delta1 * hidden_step
    else:
        step1 = delta1
    step2 = delta2

    # Queries at W_t, layer by layer (step 3): r_i = β ⊙ h_i W_i⁰ + c ⊙ h_i S_i⁰ − (C ⊙ h_i a_iᵀ) ρ_i δ_i.
    hW1 = _mm(q, W1)
    hS1 = _mm(q, S1)
    ha1 = _mm(q, tl.trans(k))
    Cha1 = C * ha1
    r1 = beta[:, None] * hW1 + c[:, None] * hS1 - _mm(Cha1, step1)
    if DEPTH == 2:
        h2 = _act(r1, ACT)
        hW2 = _mm(h2, W2)
        hS2 = _mm(h2, S2)
        ha2 = _mm(h2, tl.trans(a2))
        Cha2 = C * ha2
        r2 = beta[:, None] * hW2 + c[:, None] * hS2 - _mm(Cha2, step2)
        y = r2
    else:
        h2 = r1
        hW2 = r1
        hS2 = r1
        ha2 = ha1
        Cha2 = Cha1
        y = r1
    if RESIDUAL:
        y = y + q
    return (y, a2, p1, m1, dsigma1, delta1, delta2, step1, step2, hW1, hS1, ha1, Cha1, r1, h2, hW2, hS2, ha2, Cha2,
            theta, scale, sq_norm, norm, C, u_m)


@triton.jit
def _update(W, S, a, step, u_w, u_m, beta_n, c_n, e_n):
    """The state after the chunk (step 4): W' = β_n W + c_n S − aᵀ(u_w ⊙ step), S' = e_n S − aᵀ(u_m ⊙ step)."""
    W_new = beta_n * W + c_n * S - _mm(tl.trans(a), u_w[:, None] * step)
    S_new = e_n * S - _mm(tl.trans(a), u_m[:, None] * step)
    return W_new, S_new


@triton.jit
def _ball_factor(X, radius):
    """min(1, R / ‖X‖_F) (mlp.state_norm_scale); 1 for a zero matrix."""
    norm = tl.sqrt(tl.sum(tl.sum(X * X, 1), 0))
    return tl.where(norm > radius, radius / tl.where(norm > radius, norm, 1.0), 1.0)


@triton.jit
def _layer_backward(d_r, beta, c, u_w, u_m, step, a, h, hW, hS, ha, Cha, C, W, S, dW_new, dS_new, c_n, e_n):
    """`fused._chunk_backward` steps 1–2 for one layer: its update and its queries, given ∂L/∂r_i = d_r and the
    gradient (dW_new, dS_new) of the layer's state after the chunk. Returns ∂S⁰ (complete), the part hᵀ(β ⊙ ∂r) of
    ∂W⁰, ∂a_i, ∂h_i, ∂(ρ_i δ_i), and this layer's terms of ∂u_w, ∂u_m, ∂β, ∂c, ∂C, ∂c_n, ∂e_n."""
    g_w = beta[:, None] * d_r
    g_s = c[:, None] * d_r
    g_u_w = u_w[:, None] * step
    g_u_m = u_m[:, None] * step
    dS0 = e_n * dS_new + c_n * dW_new + _mm(tl.trans(h), g_s)
    dW0_part = _mm(tl.trans(h), g_w)
    d_e_n = tl.sum(tl.sum(S * dS_new, 1), 0)
    d_c_n = tl.sum(tl.sum(S * dW_new, 1), 0)
    a_dS = _mm(a, dS_new)
    a_dW = _mm(a, dW_new)
    d_a = -(_mm(g_u_m, tl.trans(dS_new)) + _mm(g_u_w, tl.trans(dW_new)))
    d_h = _mm(g_s, tl.trans(S)) + _mm(g_w, tl.trans(W))
    d_step = -(u_w[:, None] * a_dW + u_m[:, None] * a_dS)
    d_u_w = -tl.sum(a_dW * step, 1)
    d_u_m = -tl.sum(a_dS * step, 1)
    d_beta = tl.sum(d_r * hW, 1)
    d_c = tl.sum(d_r * hS, 1)
    # r −= (C ⊙ h aᵀ) ρ δ
    r_d = _mm(d_r, tl.trans(step))
    d_C = -(r_d * ha)
    M = C * r_d
    d_h -= _mm(M, a)
    d_a -= _mm(tl.trans(M), h)
    d_step -= _mm(tl.trans(Cha), d_r)
    return dS0, dW0_part, d_a, d_h, d_step, d_u_w, d_u_m, d_beta, d_c, d_C, d_c_n, d_e_n


# --- the kernels -------------------------------------------------------------------------------------


@triton.jit
def _load_state(w1, s1, w2, s2, slot, D_IN, N1, D_OUT, BD: tl.constexpr, BN1: tl.constexpr, BV: tl.constexpr,
                DEPTH: tl.constexpr, DT: tl.constexpr):
    """Matrix `slot` of each of the four state buffers (`[slots, d_in, d_out]`); zeros for layer 2 at depth 1."""
    cd = tl.arange(0, BD)
    c1 = tl.arange(0, BN1)
    cv = tl.arange(0, BV)
    W1 = _load(w1 + slot * D_IN * N1, cd, c1, D_IN, N1, N1, DT)
    S1 = _load(s1 + slot * D_IN * N1, cd, c1, D_IN, N1, N1, DT)
    if DEPTH == 2:
        W2 = _load(w2 + slot * N1 * D_OUT, c1, cv, N1, D_OUT, D_OUT, DT)
        S2 = _load(s2 + slot * N1 * D_OUT, c1, cv, N1, D_OUT, D_OUT, DT)
    else:
        W2 = tl.zeros([BN1, BV], DT)
        S2 = tl.zeros([BN1, BV], DT)
    return W1, S1, W2, S2


@triton.jit
def _store_state(w1, s1, w2, s2, slot, W1, S1, W2, S2, D_IN, N1, D_OUT, BD: tl.constexpr, BN1: tl.constexpr,
                 BV: tl.constexpr, DEPTH: tl.constexpr):
    """`_load_state`'s inverse."""
    cd = tl.arange(0, BD)
    c1 = tl.arange(0, BN1)
    cv = tl.arange(0, BV)
    _store(w1 + slot * D_IN * N1, W1, cd, c1, D_IN, N1, N1)
    _store(s1 + slot * D_IN * N1, S1, cd, c1, D_IN, N1, N1)
    if DEPTH == 2:
        _store(w2 + slot * N1 * D_OUT, W2, c1, cv, N1, D_OUT, D_OUT)
        _store(s2 + slot * N1 * D_OUT, S2, c1, cv, N1, D_OUT, D_OUT)


@triton.jit
def _chunk_inputs(q_ptr, k_ptr, v_ptr, theta_ptr, beta_ptr, c_ptr, D_ptr, E_last_ptr, e_last_ptr, bh, j, seq,
                  num_chunks, D_IN, D_OUT, rows, cd, cv, CH: tl.constexpr, DT: tl.constexpr):
    """Chunk j's tokens and gate algebra for row bh; rows past the chunk's end read as zeros."""
    start = j * CH
    n_valid = tl.minimum(seq - start, CH)
    last = n_valid - 1
    tok = bh * seq + start
    q = _load(q_ptr + tok * D_IN, rows, cd, n_valid, D_IN, D_IN, DT)
    k = _load(k_ptr + tok * D_IN, rows, cd, n_valid, D_IN, D_IN, DT)
    v = _load(v_ptr + tok * D_OUT, rows, cv, n_valid, D_OUT, D_OUT, DT)
    valid = rows < n_valid
    theta_raw = tl.load(theta_ptr + tok + rows, mask=valid, other=0.0).to(DT)
    dec = (bh * num_chunks + j) * CH
    beta = tl.load(beta_ptr + dec + rows, mask=valid, other=0.0).to(DT)
    c = tl.load(c_ptr + dec + rows, mask=valid, other=0.0).to(DT)
    E_last = tl.load(E_last_ptr + dec + rows, mask=valid, other=0.0).to(DT)
    D = _load(D_ptr + dec * CH, rows, rows, n_valid, n_valid, CH, DT)
    e_n = tl.load(e_last_ptr + bh * num_chunks + j).to(DT)
    return q, k, v, theta_raw, beta, c, D, E_last, e_n, last, n_valid


@triton.jit
def _scan_forward_kernel(
    q_ptr, k_ptr, v_ptr, theta_ptr, beta_ptr, c_ptr, D_ptr, E_last_ptr, e_last_ptr, params_ptr,
    w1_ptr, s1_ptr, w2_ptr, s2_ptr,
    saved_w1, saved_s1, saved_w2, saved_s2,
    end_w1, end_s1, end_w2, end_s2,
    y_ptr, scales_ptr,
    BH, seq, num_chunks, first_chunk, last_chunk, D_IN, N1, D_OUT,
    CH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BN1: tl.constexpr, BV: tl.constexpr,
    DEPTH: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr, GRAD_BOUND: tl.constexpr,
    STATE_BOUND: tl.constexpr, NORMALIZE: tl.constexpr, SAVE_EVERY: tl.constexpr, DT: tl.constexpr,
):
    """Chunks [first_chunk, last_chunk) of row bh from the state at w*_ptr/s*_ptr: y, the end state, the bounded
    state's factors, and (SAVE_EVERY > 0) the starting state of every SAVE_EVERY-th chunk into saved_* slots."""
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BN)
    cd = tl.arange(0, BD)
    cv = tl.arange(0, BV)
    max_grad_norm = tl.load(params_ptr).to(DT)
    hidden_step = tl.load(params_ptr + 1).to(DT)
    radius1 = tl.load(params_ptr + 2).to(DT)
    radius2 = tl.load(params_ptr + 3).to(DT)
    W1, S1, W2, S2 = _load_state(w1_ptr, s1_ptr, w2_ptr, s2_ptr, bh, D_IN, N1, D_OUT, BD, BN1, BV, DEPTH, DT)
    for j in range(first_chunk, last_chunk):
        if SAVE_EVERY > 0:
            if (j - first_chunk) % SAVE_EVERY == 0:
                slot = ((j - first_chunk) // SAVE_EVERY) * BH + bh
                _store_state(saved_w1, saved_s1, saved_w2, saved_s2, slot, W1, S1, W2, S2, D_IN, N1, D_OUT, BD, BN1,
                             BV, DEPTH)
        q, k, v, theta_raw, beta, c, D, E_last, e_n, last, n_valid = _chunk_inputs(
            q_ptr, k_ptr, v_ptr, theta_ptr, beta_ptr, c_ptr, D_ptr, E_last_ptr, e_last_ptr, bh, j, seq, num_chunks,
            D_IN, D_OUT, rows, cd, cv, CH, DT)
        (y, a2, p1, m1, dsigma1, delta1, delta2, step1, step2, hW1, hS1, ha1, Cha1, r1, h2, hW2, hS2, ha2, Cha2,
         theta, scale, sq_norm, norm, C, u_m) = _chunk_forward(
            q, k, v, theta_raw, beta, c, D, E_last, W1, S1, W2, S2, rows, last, max_grad_norm, hidden_step,
            DEPTH, ACT, RESIDUAL, GRAD_BOUND, NORMALIZE)
        _store(y_ptr + (bh * seq + j * CH) * D_OUT, y, rows, cv, n_valid, D_OUT, D_OUT)
        u_w = _row(C, rows, last)
        beta_n = _entry(beta, rows, last)
        c_n = _entry(c, rows, last)
        W1, S1 = _update(W1, S1, k, step1, u_w, u_m, beta_n, c_n, e_n)
        if DEPTH == 2:
            W2, S2 = _update(W2, S2, a2, step2, u_w, u_m, beta_n, c_n, e_n)
        if STATE_BOUND:  # the bounded state: back on the balls, the factors kept for the backward pass
            f_w1 = _ball_factor(W1, radius1)
            f_s1 = _ball_factor(S1, radius1)
            W1 = W1 * f_w1
            S1 = S1 * f_s1
            at = (j * BH + bh) * (2 * DEPTH)
            tl.store(scales_ptr + at, f_w1.to(scales_ptr.dtype.element_ty))
            tl.store(scales_ptr + at + 1, f_s1.to(scales_ptr.dtype.element_ty))
            if DEPTH == 2:
                f_w2 = _ball_factor(W2, radius2)
                f_s2 = _ball_factor(S2, radius2)
                W2 = W2 * f_w2
                S2 = S2 * f_s2
                tl.store(scales_ptr + at + 2, f_w2.to(scales_ptr.dtype.element_ty))
                tl.store(scales_ptr + at + 3, f_s2.to(scales_ptr.dtype.element_ty))
    _store_state(end_w1, end_s1, end_w2, end_s2, bh, W1, S1, W2, S2, D_IN, N1, D_OUT, BD, BN1, BV, DEPTH)


@triton.jit
def _scan_backward_kernel(
    q_ptr, k_ptr, v_ptr, theta_ptr, beta_ptr, c_ptr, D_ptr, E_last_ptr, e_last_ptr, params_ptr,
    saved_w1, saved_s1, saved_w2, saved_s2,
    dy_ptr, d_w1, d_s1, d_w2, d_s2,
    dq_ptr, dk_ptr, dv_ptr, dtheta_ptr, dbeta_ptr, dc_ptr, dD_ptr, dE_last_ptr, de_last_ptr, scales_ptr,
    BH, seq, num_chunks, first_chunk, last_chunk, D_IN, N1, D_OUT,
    CH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BN1: tl.constexpr, BV: tl.constexpr,
    DEPTH: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr, GRAD_BOUND: tl.constexpr,
    STATE_BOUND: tl.constexpr, NORMALIZE: tl.constexpr, DT: tl.constexpr,
):
    """Chunks [first_chunk, last_chunk) of row bh in reverse (`fused._chunk_backward`), from their starting states in
    saved_* (one slot per chunk): d_* holds the gradient of the state after the last of them on entry and that of
    the state before the first on exit. Writes the chunks' rows of ∂q, ∂k, ∂v, ∂θ and of the decays' gradients."""
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BN)
    cd = tl.arange(0, BD)
    cv = tl.arange(0, BV)
    max_grad_norm = tl.load(params_ptr).to(DT)
    hidden_step = tl.load(params_ptr + 1).to(DT)
    dW1, dS1, dW2, dS2 = _load_state(d_w1, d_s1, d_w2, d_s2, bh, D_IN, N1, D_OUT, BD, BN1, BV, DEPTH, DT)
    for step_back in range(0, last_chunk - first_chunk):
        j = last_chunk - 1 - step_back
        slot = (j - first_chunk) * BH + bh
        W1, S1, W2, S2 = _load_state(saved_w1, saved_s1, saved_w2, saved_s2, slot, D_IN, N1, D_OUT, BD, BN1, BV,
                                     DEPTH, DT)
        if STATE_BOUND:  # the bounded state's factors are constants: its backward pass is a product with them
            at = (j * BH + bh) * (2 * DEPTH)
            dW1 = dW1 * tl.load(scales_ptr + at).to(DT)
            dS1 = dS1 * tl.load(scales_ptr + at + 1).to(DT)
            if DEPTH == 2:
                dW2 = dW2 * tl.load(scales_ptr + at + 2).to(DT)
                dS2 = dS2 * tl.load(scales_ptr + at + 3).to(DT)
        q, k, v, theta_raw, beta, c, D, E_last, e_n, last, n_valid = _chunk_inputs(
            q_ptr, k_ptr, v_ptr, theta_ptr, beta_ptr, c_ptr, D_ptr, E_last_ptr, e_last_ptr, bh, j, seq, num_chunks,
            D_IN, D_OUT, rows, cd, cv, CH, DT)
        (y, a2, p1, m1, dsigma1, delta1, delta2, step1, step2, hW1, hS1, ha1, Cha1, r1, h2, hW2, hS2, ha2, Cha2,
         theta, scale, sq_norm, norm, C, u_m) = _chunk_forward(
            q, k, v, theta_raw, beta, c, D, E_last, W1, S1, W2, S2, rows, last, max_grad_norm, hidden_step,
            DEPTH, ACT, RESIDUAL, GRAD_BOUND, NORMALIZE)
        tok = bh * seq + j * CH
        dy = _load(dy_ptr + tok * D_OUT, rows, cv, n_valid, D_OUT, D_OUT, DT)
        u_w = _row(C, rows, last)
        beta_n = _entry(beta, rows, last)
        c_n = _entry(c, rows, last)

        # 1–2. State update and queries, last layer first.
        if DEPTH == 2:
            (dS2_0, dW2_0, d_a2, d_h2, d_delta2, d_u_w, d_u_m, d_beta, d_c, d_C, d_c_n, d_e_n) = _layer_backward(
                dy, beta, c, u_w, u_m, step2, a2, h2, hW2, hS2, ha2, Cha2, C, W2, S2, dW2, dS2, c_n, e_n)
            d_r1 = d_h2 * _act_grad(r1, ACT)
            (dS1_0, dW1_0, d_a1, d_h1, d_step1, d_u_w1, d_u_m1, d_beta1, d_c1, d_C1, d_c_n1, d_e_n1) = \
                _layer_backward(d_r1, beta, c, u_w, u_m, step1, k, q, hW1, hS1, ha1, Cha1, C, W1, S1, dW1, dS1, c_n,
                                e_n)
            d_delta1 = d_step1 * hidden_step  # the gradient of ρ δ_1 made that of δ_1
            d_u_w += d_u_w1
            d_u_m += d_u_m1
            d_beta += d_beta1
            d_c += d_c1
            d_C += d_C1
            d_c_n += d_c_n1
            d_e_n += d_e_n1
        else:
            (dS1_0, dW1_0, d_a1, d_h1, d_delta1, d_u_w, d_u_m, d_beta, d_c, d_C, d_c_n, d_e_n) = _layer_backward(
                dy, beta, c, u_w, u_m, step1, k, q, hW1, hS1, ha1, Cha1, C, W1, S1, dW1, dS1, c_n, e_n)
            dS2_0 = dS2
            dW2_0 = dW2
            d_a2 = d_a1
            d_delta2 = d_delta1
        d_q = d_h1
        if RESIDUAL:
            d_q += dy

        # 3. θ: C = D diag(θ) (⊙ K), u_w = C[n,:], u_m = θ ⊙ E[n,:] (⊙ K[n,:]), θ = θ_raw · min(1, c/‖∇ℓ‖).
        d_C += tl.where(rows[:, None] == last, d_u_w[None, :], 0.0)
        if NORMALIZE:  # K is a constant to the outer gradient
            d_C = d_C * norm
            d_u_m = d_u_m * _row(norm, rows, last)
        d_th = tl.sum(d_C * D, 0) + d_u_m * E_last
        d_D = d_C * theta[None, :]
        d_E_last = d_u_m * theta
        d_theta = d_th
        if GRAD_BOUND:
            d_theta = d_th * scale
            # scale = c / sqrt(max(sq, c²)): d scale / d sq = −scale / (2 sq) above the bound, 0 below
            above = sq_norm > max_grad_norm * max_grad_norm
            d_sq = tl.where(above, -0.5 * d_th * theta_raw * scale / tl.where(above, sq_norm, 1.0), 0.0)
            d_a1 += (2.0 * d_sq * tl.sum(delta1 * delta1, 1))[:, None] * k
            d_delta1 += (2.0 * d_sq * tl.sum(k * k, 1))[:, None] * delta1
            if DEPTH == 2:
                d_a2 += (2.0 * d_sq * tl.sum(delta2 * delta2, 1))[:, None] * a2
                d_delta2 += (2.0 * d_sq * tl.sum(a2 * a2, 1))[:, None] * delta2

        # 4. δ recursion: δ_1 = m_1 ⊙ σ'(p_1), m_1 = δ_2 W_2ᵀ; then δ_L = 2 (out − v).
        if DEPTH == 2:
            d_m = d_delta1 * dsigma1
            d_p1 = d_delta1 * m1 * _act_grad2(p1, ACT)
            dW2_0 += _mm(tl.trans(d_m), delta2)
            d_delta2 += _mm(d_m, W2)
            d_out = 2.0 * d_delta2
        else:
            d_out = 2.0 * d_delta1
        d_v = -d_out

        # 5. Keys: p_i = a_i W_i, a_2 = σ(p_1), out = p_L (+ k); ∂W⁰ = β_n ∂W' + its rank-n terms, ∂β_n = ⟨W, ∂W'⟩.
        d_beta_n = tl.sum(tl.sum(W1 * dW1, 1), 0)
        if DEPTH == 2:
            d_beta_n += tl.sum(tl.sum(W2 * dW2, 1), 0)
            dW2_0 += beta_n * dW2 + _mm(tl.trans(a2), d_out)
            d_a2 += _mm(d_out, tl.trans(W2))
            d_p1 += d_a2 * dsigma1
        else:
            d_p1 = d_out
        dW1_0 += beta_n * dW1 + _mm(tl.trans(k), d_p1)
        d_a1 += _mm(d_p1, tl.trans(W1))
        d_k = d_a1
        if RESIDUAL:
            d_k += d_out
        d_beta += tl.where(rows == last, d_beta_n, 0.0)
        d_c += tl.where(rows == last, d_c_n, 0.0)

        valid = rows < n_valid
        _store(dq_ptr + tok * D_IN, d_q, rows, cd, n_valid, D_IN, D_IN)
        _store(dk_ptr + tok * D_IN, d_k, rows, cd, n_valid, D_IN, D_IN)
        _store(dv_ptr + tok * D_OUT, d_v, rows, cv, n_valid, D_OUT, D_OUT)
        tl.store(dtheta_ptr + tok + rows, d_theta.to(dtheta_ptr.dtype.element_ty), mask=valid)
        dec = (bh * num_chunks + j) * CH
        tl.store(dbeta_ptr + dec + rows, d_beta.to(dbeta_ptr.dtype.element_ty), mask=valid)
        tl.store(dc_ptr + dec + rows, d_c.to(dc_ptr.dtype.element_ty), mask=valid)
        tl.store(dE_last_ptr + dec + rows, d_E_last.to(dE_last_ptr.dtype.element_ty), mask=valid)
        _store(dD_ptr + dec * CH, d_D, rows, rows, n_valid, n_valid, CH)
        tl.store(de_last_ptr + bh * num_chunks + j, d_e_n.to(de_last_ptr.dtype.element_ty))
        dW1 = dW1_0
        dS1 = dS1_0
        dW2 = dW2_0
        dS2 = dS2_0
    _store_state(d_w1, d_s1, d_w2, d_s2, bh, dW1, dS1, dW2, dS2, D_IN, N1, D_OUT, BD, BN1, BV, DEPTH)


# --- the autograd function ---------------------------------------------------------------------------


def _padded_decays(eta: Tensor, alpha: Tensor, chunk_size: int) -> ChunkDecays:
    """`fused._block_decays` as one block `[BH, chunks, n(, n)]`: a ragged last chunk padded with zeros (its own
    last row, not row n, gives E_last and e_last). Differentiable, for the backward pass's autograd of the gates."""
    blocks = _block_decays(eta, alpha, chunk_size)
    pad = chunk_size - blocks[-1].beta.shape[-1]
    if pad:
        tail = blocks[-1]
        blocks[-1] = ChunkDecays(F.pad(tail.beta, (0, pad)), F.pad(tail.c, (0, pad)), F.pad(tail.D, (0, pad, 0, pad)),
                                 F.pad(tail.E_last, (0, pad)), tail.e_last)
    return ChunkDecays(*(torch.cat(parts, dim=1).contiguous() for parts in zip(*blocks)))


def _compute_dtype(state: Tensor):
    return tl.float64 if state.dtype == torch.float64 else tl.float32


def _layers(state: list[Tensor]) -> list[Tensor]:
    """[W_1, S_1, W_2, S_2] for the kernels: at depth 1 the layer-2 pointers repeat layer 1's (never read)."""
    return list(state) if len(state) == 4 else list(state) * 2


def _meta(cfg: ScanConfig, q: Tensor, v: Tensor, state: list[Tensor]) -> dict:
    """The kernels' shape arguments and switches."""
    depth = len(state) // 2
    d_in, n1 = state[0].shape[-2:]
    d_out = v.shape[-1]
    return dict(
        BH=q.shape[0], seq=q.shape[1], num_chunks=-(-q.shape[1] // cfg.chunk_size), D_IN=d_in, N1=n1, D_OUT=d_out,
        CH=cfg.chunk_size, BN=_block(cfg.chunk_size), BD=_block(d_in), BN1=_block(n1), BV=_block(d_out), DEPTH=depth,
        ACT=_ACTIVATION_CODES[cfg.activation], RESIDUAL=cfg.residual, GRAD_BOUND=cfg.max_grad_norm is not None,
        STATE_BOUND=cfg.max_state_norm is not None, NORMALIZE=cfg.normalize_chunk, DT=_compute_dtype(state[0]),
    )


def _params(cfg: ScanConfig, state: list[Tensor]) -> Tensor:
    """The rule's numbers as a tensor of the state's dtype (a float argument would reach the kernel as float32):
    max_grad_norm, ρ, and the balls' radii max_state_norm · √d_out of layers 1 and 2."""
    radii = [(cfg.max_state_norm or 0.0) * state[i].shape[-1] ** 0.5 for i in (0, len(state) - 2)]
    values = [cfg.max_grad_norm or 0.0, cfg.hidden_step, *radii]
    # Filled on the device, each number a kernel argument: torch.tensor(values, device=...) would copy them from host
    # memory, and on a GPU that copy is a host sync in every training step.
    params = torch.empty(len(values), dtype=state[0].dtype, device=state[0].device)
    for i, value in enumerate(values):
        params[i:i + 1].fill_(value)
    return params


def _run_forward(meta: dict, q, k, v, theta, dec: ChunkDecays, params, start: list[Tensor], saved: list[Tensor],
                 save_every: int, end: list[Tensor], y: Tensor, scales: Optional[Tensor], chunks: range) -> None:
    _scan_forward_kernel[(meta["BH"],)](
        q, k, v, theta, *dec, params, *_layers(start), *_layers(saved or start), *_layers(end), y,
        params if scales is None else scales, first_chunk=chunks.start, last_chunk=chunks.stop,
        SAVE_EVERY=save_every, **meta)


class TritonScan(torch.autograd.Function):
    """(q, k, v, θ, η, α, W_1, S_1, …) -> (y, W_1', S_1', …), all `[BH, …]` contiguous: `fused.MemoryScan`'s
    contract (the same `ScanConfig`), run by the Triton kernels above. q, k, v may be bf16; the rest is in the
    state's dtype. Recording for the backward pass, the forward keeps every chunk's starting state, or with
    recomputation groups only each group's, and the backward re-runs the forward over one group at a time."""

    @staticmethod
    def forward(ctx, cfg: ScanConfig, q, k, v, theta, eta, alpha, *state):  # type: ignore[override]
        state = list(state)
        meta = _meta(cfg, q, v, state)
        num_chunks = meta["num_chunks"]
        dec = _padded_decays(eta, alpha, cfg.chunk_size)
        params = _params(cfg, state)
        groups = _groups(num_chunks, cfg.group_chunks) if cfg.record else [range(num_chunks)]
        # One group: every chunk's starting state; several: each group's first.
        save_every = (1 if len(groups) == 1 else len(groups[0])) if cfg.record else 0
        saved = [t.new_empty((len(groups) if len(groups) > 1 else num_chunks, *t.shape)) for t in state] \
            if cfg.record else []
        end = [torch.empty_like(t) for t in state]
        y = q.new_empty(q.shape[:2] + (v.shape[2],))
        scales = state[0].new_ones(num_chunks, meta["BH"], len(state)) if cfg.max_state_norm is not None else None
        _run_forward(meta, q, k, v, theta, dec, params, state, saved, save_every, end, y, scales, range(num_chunks))
        if cfg.record:
            ctx.cfg, ctx.n_state, ctx.scales, ctx.groups = cfg, len(state), scales, groups
            # An output the loss does not use gets None in the backward pass, not a state-sized tensor of zeros.
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(q, k, v, theta, eta, alpha, *state, *saved)
        return (y, *end)

    @staticmethod
    def backward(ctx, dy, *d_final):  # type: ignore[override]
        refuse_double_backward("Triton")
        return TritonScan._backward(ctx, dy, *d_final)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def _backward(ctx, dy, *d_final):
        cfg: ScanConfig = ctx.cfg
        q, k, v, theta, eta, alpha, *rest = ctx.saved_tensors
        state, saved = rest[: ctx.n_state], rest[ctx.n_state :]
        meta = _meta(cfg, q, v, state)
        with torch.enable_grad():  # the gate algebra is differentiated by autograd, from this graph
            eta_, alpha_ = eta.detach().requires_grad_(), alpha.detach().requires_grad_()
            graph = _padded_decays(eta_, alpha_, cfg.chunk_size)
        dec = ChunkDecays(*(x.detach() for x in graph))
        d_dec = ChunkDecays(*(torch.zeros_like(x) for x in dec))
        params = _params(cfg, state)
        # The kernel reads the gradient of a group's end state from d_state and leaves its start state's there.
        d_state = [torch.zeros_like(t) if d is None else d.to(t.dtype).contiguous().clone()
                   for t, d in zip(state, d_final)]
        dy = q.new_zeros(q.shape[:2] + (v.shape[2],)) if dy is None else dy.contiguous()
        d_q, d_k, d_v, d_theta = (torch.empty_like(t) for t in (q, k, v, theta))
        groups = ctx.groups
        if len(groups) > 1:
            group_states = [t.new_empty((len(groups[0]), *t.shape)) for t in state]
            scratch_end = [torch.empty_like(t) for t in state]
            scratch_y = torch.empty_like(dy)
        for g in range(len(groups) - 1, -1, -1):
            chunks = groups[g]
            starts = saved
            if len(groups) > 1:  # recompute the group's chunk states from its saved first one
                _run_forward(meta, q, k, v, theta, dec, params, [s[g] for s in saved], group_states, 1, scratch_end,
                             scratch_y, ctx.scales, chunks)
                starts = group_states
            _scan_backward_kernel[(meta["BH"],)](
                q, k, v, theta, *dec, params, *_layers(starts), dy, *_layers(d_state), d_q, d_k, d_v, d_theta,
                *d_dec, params if ctx.scales is None else ctx.scales, first_chunk=chunks.start,
                last_chunk=chunks.stop, **meta)
        d_eta, d_alpha = torch.autograd.grad(list(graph), (eta_, alpha_), list(d_dec))
        return (None, d_q, d_k, d_v, d_theta, d_eta, d_alpha, *d_state)
