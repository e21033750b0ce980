"""The chunk-parallel memory as Triton kernels at every model size: the state walked in tiles (DESIGN.md §2).

Same mathematics as `fused.py` (the dual form), organised for a GPU whose on-chip memory cannot hold a real memory's
state: a 64 × 256 head of depth 2 carries W_1, S_1, W_2, S_2 of 64 KiB each in float32, a 128 × 512 head 1 MiB, and
an sm_90 program has 227 KiB of shared memory. So one program per batch·head row runs every chunk of the sequence
with its state in global memory (where the L2 cache keeps it between chunks) and walks it in tiles: every product
with the state is a loop over BK × BN tiles, every product among the chunk's n rows (n ≤ 64) stays in registers, and
what passes between the steps of a chunk (each layer's inputs, δ, the queries' activations) goes through a small
per-row scratch that the L2 also keeps. Per chunk of n tokens the program

1. copies q and k into the scratch and forwards the keys through M(·; W⁰), layer by layer, tile by tile (pass A),
   then back-propagates the inner loss by hand (δ_i, pass B): `losses.py`'s gradient g(M(k) − v) for the last layer,
   δ_i = (δ_{i+1} W_{i+1}ᵀ) ⊙ σ'(p_i) below it;
2. forms the step's n × n algebra: each token's bound (max_grad_norm, from ‖a_i‖² ‖δ_i‖²), C = D diag(θ), the
   normalised chunk step's factors K (from the Gram matrices a_i a_iᵀ ⊙ δ_i δ_iᵀ);
3. answers the queries at W_t = β_t W⁰ + c_t S⁰ − Σ_s C[t,s] a_sᵀ δ_s layer by layer (pass C) and, in the same tile
   loop, writes the state after the chunk in place, W' = β_n W⁰ + c_n S⁰ − aᵀ(C[n,:] ⊙ ρδ), S' = e_n S⁰ − aᵀ(u_m ⊙ ρδ):
   each state tile is read once and written once per chunk.

The bounded state (max_state_norm) is applied lazily: a matrix's factor min(1, R/‖X‖) is known only once its last tile
is written, so it is kept as a number beside the stored matrix and folded into the next chunk's reads (a product
with X becomes f · (x X), the update's coefficients β_n f_W, c_n f_S, e_n f_S), and the stored state is scaled only
at the end of the sequence or when it is saved. No extra pass over the state per chunk.

The backward kernel walks the chunks in reverse from each chunk's saved starting state: it recomputes the chunk's
passes A–C (without the update, keeping what the backward needs in the scratch) and then `fused._chunk_backward`'s
steps 1–5 tile by tile, the gradient of the state in global memory, updated in place from ∂(W', S') to ∂(W⁰, S⁰).
With recomputation groups (`ScanConfig.group_chunks`) the forward keeps only each group's starting state and the
backward re-runs the forward kernel over one group at a time. The gate algebra (η, α → β, c, D = B E, E[n,:], e_n)
is computed and differentiated by autograd outside the kernels, as in `fused.py`; with α per output column (a kernel
variant of its own, CHANNELS) the kernels take E, e and the log-keeps log(1 − α) and form each column's decays where
they are read (the section "α per channel" below), the log-keeps' gradient handed back to autograd.

Precision: the state and every accumulation are float32 (float64 for tests); q, k, v may be bf16 or fp16 (read as
such). Products take `input_precision` from the call: "ieee" (default) or "tf32" for the products that read the
state and the chunk's n × n algebra, the state's own update always at IEEE precision (`Precision`).

Under `TRITON_INTERPRET=1` (set before this module is imported) the kernels run on CPU tensors through Triton's numpy
interpreter: `tests/memory/test_triton.py` holds them to the token-by-token reference and the autograd path there,
at several tile sizes, and compiles every kernel variant for sm_90 and sm_80 with ptxas on any machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .checks import without_autocast
from .decays import log_keep, momentum_decays
from .fused import ChunkDecays, ScanConfig, _block_decays, _groups, chunk_blocks, refuse_double_backward
from .rule import MemoryRule

# Set before this module is imported (`triton.jit` reads it when it decorates): the kernels run on CPU tensors, in
# numpy.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

MAX_DEPTH = 4  # memory depth 1–4 (the hidden layers' widths equal, as NeuralMemory builds them)
MAX_CHUNK = 64  # a chunk's n × n algebra lives in registers: chunks of at most 64 tokens
MAX_WIDTH = 2048  # any width is tiled; this bounds the scratch a program keeps per chunk (rows × widths)
# sm_90 (H100, H200) gives a program at most 227 KiB of shared memory, sm_80 (A100) 163 KiB: the kernels' tiles are
# sized to stay well under both (tests/memory/test_triton.py compiles every variant and checks the report).
SHARED_MEMORY_LIMIT = {90: 227 * 1024, 80: 163 * 1024}

_ACTIVATION_CODES = {"gelu": 0, "silu": 1}
# A compiled kernel reads a module global only as a tl.constexpr (the interpreter reads any global, so only a
# compilation catches a plain float here).
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT2PI = tl.constexpr(0.3989422804014327)


def _pow2(n: int) -> int:
    """A tile side: the next power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


class Geometry(NamedTuple):
    """A memory's shape as the kernels see it: layer i maps w_in(i) → w_out(i) with w_in(0) = d_in, w_out(L−1) =
    d_out and every hidden width `hidden` (NeuralMemory's d_head · expansion)."""

    depth: int
    d_in: int
    hidden: int  # d_out at depth 1 (unused there)
    d_out: int

    def layer_shapes(self) -> list[tuple[int, int]]:
        widths = [self.d_in] + [self.hidden] * (self.depth - 1) + [self.d_out]
        return list(zip(widths, widths[1:]))

    @property
    def total(self) -> int:
        """Elements of one packed state (every layer's W, or every layer's S), per row."""
        return sum(a * b for a, b in self.layer_shapes())

    @property
    def in_total(self) -> int:  # the widths of every layer's input, side by side (the scratch's "in" family)
        return self.d_in + (self.depth - 1) * self.hidden

    @property
    def out_total(self) -> int:  # the widths of every layer's output (the "out" family)
        return (self.depth - 1) * self.hidden + self.d_out


def geometry_of(weights) -> Geometry:
    depth = len(weights)
    d_in, d_out = weights[0].shape[-2], weights[-1].shape[-1]
    return Geometry(depth, d_in, weights[0].shape[-1] if depth > 1 else d_out, d_out)


def unsupported(q: Tensor, weights, chunk_size: int, rule: Optional[MemoryRule] = None) -> Optional[str]:
    """Why the kernels cannot serve a call with these queries, state, chunk size (and rule), or None where they can.
    The one place that decides; `parallel.serving_implementation` asks it."""
    if rule is not None and rule.loss.name not in LOSSES:
        return (f"the {rule.loss.name} loss: the Triton kernels compute the {', '.join(LOSSES)} losses; "
                "implementation='fused' or 'autograd' serves it")
    if not (q.is_cuda or (INTERPRET and q.is_cpu)):
        return (f"the tensors are on {q.device}: the Triton kernels run on CUDA tensors (or on CPU tensors under "
                "TRITON_INTERPRET=1, set before titans.memory.triton_chunk is imported)")
    if not 1 <= len(weights) <= MAX_DEPTH:
        return f"memory depth {len(weights)}: the Triton kernels serve depth 1 to {MAX_DEPTH}"
    if weights[0].dtype not in (torch.float32, torch.float64):
        return f"state dtype {weights[0].dtype}: the Triton kernels keep a float32 (or float64) state"
    if q.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return f"q/k/v dtype {q.dtype}: the Triton kernels read float32, float64, bfloat16 or float16"
    hidden = {w.shape[-1] for w in weights[:-1]}
    if len(hidden) > 1:
        return f"hidden widths {sorted(hidden)}: the Triton kernels serve memories whose hidden layers are one width"
    widths = {weights[0].shape[-2], weights[-1].shape[-1], *hidden}
    if max(widths) > MAX_WIDTH:
        return f"a memory layer {max(widths)} wide: the Triton kernels serve widths up to {MAX_WIDTH}"
    if chunk_size > MAX_CHUNK:
        return f"chunk size {chunk_size}: the Triton kernels hold chunks of at most {MAX_CHUNK} tokens on chip"
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


# The inner loss, one block (losses.py is its definition in Python, kernels/losses.h in C++): for the error e = M(k) − v
# of a token, elementwise, its gradient g(e) = ∂ℓ/∂M(k) (the last layer's δ), the derivative g'(e) the backward pass
# needs, and ∂g/∂γ for the loss's per-token gate γ (Huber's δ_t). LOSS: 0 squared Σ e², 1 Huber (e² within γ,
# 2γ|e| − γ² beyond), 2 smoothed ℓp Σ (e² + ε)^{p/2} (P = p, EPS = ε).


@triton.jit
def _loss_grad(e, gamma, LOSS: tl.constexpr, P, EPS):
    if LOSS == 0:
        return 2.0 * e
    elif LOSS == 1:
        return 2.0 * tl.where(tl.abs(e) <= gamma, e, gamma * tl.where(e > 0, 1.0, tl.where(e < 0, -1.0, 0.0)))
    else:
        return P * e * tl.exp((0.5 * P - 1.0) * tl.log(e * e + EPS))


@triton.jit
def _loss_grad_deriv(e, gamma, LOSS: tl.constexpr, P, EPS):
    if LOSS == 0:
        return tl.full(e.shape, 2.0, e.dtype)
    elif LOSS == 1:
        return tl.where(tl.abs(e) <= gamma, 2.0, 0.0)
    else:
        u = e * e + EPS
        return P * tl.exp((0.5 * P - 2.0) * tl.log(u)) * ((P - 1.0) * e * e + EPS)


@triton.jit
def _loss_gate_grad(e, gamma, LOSS: tl.constexpr):
    if LOSS == 1:
        return tl.where(tl.abs(e) <= gamma, 0.0, 2.0 * tl.where(e > 0, 1.0, tl.where(e < 0, -1.0, 0.0)))
    else:
        return tl.zeros(e.shape, e.dtype)


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _ld(ptr, r, c, n_r, n_c, stride, DT: tl.constexpr):
    """The tile [r, c] of a row-major matrix at ptr (row stride `stride`), zeros outside [0, n_r) × [0, n_c)."""
    m = (r[:, None] < n_r) & (c[None, :] < n_c)
    return tl.load(ptr + r[:, None] * stride + c[None, :], mask=m, other=0.0).to(DT)


@triton.jit
def _st(ptr, x, r, c, n_r, n_c, stride):
    m = (r[:, None] < n_r) & (c[None, :] < n_c)
    tl.store(ptr + r[:, None] * stride + c[None, :], x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _pair(x, y):
    """[R, C] and [R, C] → [R, 2C], their columns interleaved: one product with a shared operand instead of two
    (x_cols @ … then splits with `_unpair`), or a sum of two products as one with its inner dimension doubled."""
    return tl.reshape(tl.join(x, y), [x.shape[0], 2 * x.shape[1]])


@triton.jit
def _unpair(xy):
    """`_pair`'s inverse: [R, 2C] → the two [R, C]."""
    return tl.split(tl.reshape(xy, [xy.shape[0], xy.shape[1] // 2, 2]))


@triton.jit
def _entry(vec, idx, at):
    return tl.sum(tl.where(idx == at, vec, 0.0), axis=0)


@triton.jit
def _factor(fw_at, fw_on, at, DT: tl.constexpr):
    """A pending factor of the stored state (W_i at 2i, S_i at 2i + 1: the bounded state's min(1, R/‖X‖), kept per
    chunk for the backward pass), read from fw_at where fw_on, else 1; fw_at None: no factors (the state unbounded,
    or the backward's replay of the saved states). A scalar read where it is used: held through the chunk loop as a
    vector, the factors and their addresses were what spilled at chunks of 64."""
    if fw_at is None:
        return 1.0
    else:
        return tl.load(fw_at + at, mask=fw_on, other=1.0).to(DT)


@triton.jit
def _row(m, rows, at):
    """Row `at` of m as a vector over its columns."""
    return tl.sum(tl.where(rows[:, None] == at, m, 0.0), axis=0)


@triton.jit
def _diag(m, rows):
    return tl.sum(tl.where(rows[:, None] == rows[None, :], m, 0.0), axis=1)


# --- one chunk: the passes ---------------------------------------------------------------------------------------
# Layer i of depth L maps w_in(i) → w_out(i); in the state it starts at ST(i), in the scratch's "in" family (a_i, h_i
# and their gradients) at column IN_OFF(i), in the "out" family (p_i, δ_i, r_i, …) at OUT_OFF(i). These are
# compile-time numbers, written out where a loop over the layers needs them:
#     w_in  = D_IN + (HID − D_IN) (i > 0)        w_out   = HID + (D_OUT − HID) (i = L − 1)
#     IN_OFF = (i > 0) (D_IN + (i − 1) HID)       OUT_OFF = i HID
#     ST    = (i > 0) (D_IN HID + (i − 1) HID²)


@dataclass(frozen=True)
class Tiles:
    """The kernels' tile sides (BK rows of the state per step of a product, BN columns of its output) and launch
    options: one software-pipelining stage (a loop's next tiles prefetched into registers would spill them), and
    the kernels' register ceiling where it is given (`choose_tiles`)."""

    BK: int
    BN: int
    warps: int = 8
    stages: int = 1
    maxnreg: Optional[int] = None


def choose_tiles(geo: Geometry, dtype: torch.dtype, chunk_size: int = 16, arch: int = 90,
                 channels: bool = False) -> Tiles:
    """16 × 16 tiles and 8 warps: a small product's FMA operands are a row and a column per thread, so one output
    element per thread keeps every product within 255 registers. Both kernels at chunks of up to 32 tokens get an
    explicit ceiling of 255: without it ptxas held the default model memory's forward (64 × 256, chunk 16) to 128
    registers and spilled 212 bytes, and the depth-4 memory's backward 152; with it, none; both compile for sm_90 and
    sm_80 (`arch`, the compute capability) without a spilled register (tests/memory/test_triton_compile.py reads ptxas's
    report), but for the scalar α's backward at hidden widths of 512 (128 × 512), which spilled 20 bytes at 16 × 16 on
    sm_90 and none at 16 × 8 (α per channel the other way round: none at 16 × 16, 4 at 16 × 8). At 64 an n × n matrix is
    16 registers a thread and ptxas does best without a ceiling; there the tiles depend on the chip and the α: the
    scalar α on sm_90 spills nothing at 16 × 16, and every other variant spills least at 8 × 8 (two elements of a [64,
    8] tile a thread; measured against 16 × 16, 16 × 8 and 8 × 16 and with and without the ceiling,
    docs/bench/gpu/NOTES.md). Open: at 64 those backwards still spill (KNOWN_SPILLS in that test)."""
    if _pow2(chunk_size) <= 32:
        return Tiles(16, 8 if geo.hidden >= 512 and not channels else 16, 8, 1, 255)
    if arch >= 90 and not channels:
        return Tiles(16, 16, 8, 1, None)
    return Tiles(8, 8, 8, 1, None)


def arch_of(device) -> int:
    """The compute capability of a CUDA device as a number (90: H100 and H200, 80: A100); 90 elsewhere (the
    interpreter, where the tiles change nothing but the order of the sums)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@triton.jit
def _chunk_start(q_tok, k_tok, h_b, a_b, aa_b, n_valid, rows, rk,
                 D_IN: tl.constexpr, IN_T: tl.constexpr, CHP: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                 DT: tl.constexpr):
    """q and k of the chunk into the scratch (h_0 and a_0, in the state's dtype, zero past the chunk's end), and the
    keys' Gram matrix a_0 a_0ᵀ."""
    aa = tl.zeros([CHP, CHP], DT)
    for ji in range(0, (D_IN + BK - 1) // BK):
        kk = ji * BK + rk
        q = _ld(q_tok, rows, kk, n_valid, D_IN, D_IN, DT)
        k = _ld(k_tok, rows, kk, n_valid, D_IN, D_IN, DT)
        _st(h_b, q, rows, kk, CHP, D_IN, IN_T)
        _st(a_b, k, rows, kk, CHP, D_IN, IN_T)
        aa += _mm(k, tl.trans(k), PREC)
    _st(aa_b, aa, rows, rows, CHP, CHP, CHP)


@triton.jit
def _keys(wb, fw_at, fw_on, k_tok, v_tok, e_b, a_b, p_b, dl_b, aa_b, dd_b, gamma, n_valid, rows, rk, rn, loss_p,
          loss_eps, D_IN: tl.constexpr, HID: tl.constexpr, D_OUT: tl.constexpr, DEPTH: tl.constexpr, IN_T: tl.constexpr,
          OUT_T: tl.constexpr, CHP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, ACT: tl.constexpr,
          RESIDUAL: tl.constexpr, LOSS: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Pass A: the keys at the chunk's starting weights, p_i = a_i W_i, a_{i+1} = σ(p_i), and the last layer's δ =
    g(M(k) − v) (eq. 12's ℓ_t, differentiated by `_loss_grad`); the Gram matrices a_{i+1} a_{i+1}ᵀ and δ_L δ_Lᵀ."""
    valid = (rows < n_valid)[:, None]
    for i in range(DEPTH):
        W_IN = D_IN + (HID - D_IN) * (i > 0)
        W_OUT = HID + (D_OUT - HID) * (i == DEPTH - 1)
        IN_OFF = (i > 0) * (D_IN + (i - 1) * HID)
        NEXT_IN = D_IN + i * HID
        OUT_OFF = i * HID
        ST = (i > 0) * (D_IN * HID + (i - 1) * HID * HID)
        f_w = _factor(fw_at, fw_on, 2 * i, DT)
        gram = tl.zeros([CHP, CHP], DT)
        for jo in range(0, (W_OUT + BN - 1) // BN):
            cols = jo * BN + rn
            acc = tl.zeros([CHP, BN], DT)
            for ji in range(0, (W_IN + BK - 1) // BK):
                kk = ji * BK + rk
                a = _ld(a_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT)
                w = _ld(wb + ST, kk, cols, W_IN, W_OUT, W_OUT, DT)
                acc += _mm(a, w, PREC)
            acc = acc * f_w
            if i < DEPTH - 1:
                _st(p_b + OUT_OFF, acc, rows, cols, CHP, W_OUT, OUT_T)
                a_next = tl.where(valid, _act(acc, ACT), 0.0)
                _st(a_b + NEXT_IN, a_next, rows, cols, CHP, W_OUT, IN_T)
                gram += _mm(a_next, tl.trans(a_next), PREC)
            else:
                out = acc
                if RESIDUAL:
                    out += _ld(k_tok, rows, cols, n_valid, D_IN, D_IN, DT)
                e = tl.where(valid, out - _ld(v_tok, rows, cols, n_valid, D_OUT, D_OUT, DT), 0.0)
                delta = tl.where(valid, _loss_grad(e, gamma[:, None], LOSS, loss_p, loss_eps), 0.0)
                _st(e_b, e, rows, cols, CHP, D_OUT, D_OUT)
                _st(dl_b + OUT_OFF, delta, rows, cols, CHP, W_OUT, OUT_T)
                gram += _mm(delta, tl.trans(delta), PREC)
        if i < DEPTH - 1:
            _st(aa_b + (i + 1) * CHP * CHP, gram, rows, rows, CHP, CHP, CHP)
        else:
            _st(dd_b + i * CHP * CHP, gram, rows, rows, CHP, CHP, CHP)
        tl.debug_barrier()


@triton.jit
def _deltas(wb, fw_at, fw_on, p_b, dl_b, m_b, dd_b, rows, rk, rn,
            D_IN: tl.constexpr, HID: tl.constexpr, D_OUT: tl.constexpr, DEPTH: tl.constexpr, OUT_T: tl.constexpr,
            CHP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, ACT: tl.constexpr, RECORD: tl.constexpr,
            PREC: tl.constexpr, DT: tl.constexpr):
    """Pass B: δ_i = m_i ⊙ σ'(p_i), m_i = δ_{i+1} W_{i+1}ᵀ, from the last hidden layer down; each δ_i's Gram matrix."""
    for ii in range(DEPTH - 1):
        i = DEPTH - 2 - ii
        NEXT_OUT = HID + (D_OUT - HID) * (i + 1 == DEPTH - 1)
        NEXT_ST = D_IN * HID + i * HID * HID
        OUT_OFF = i * HID
        NEXT_OFF = (i + 1) * HID
        f_w = _factor(fw_at, fw_on, 2 * i + 2, DT)
        gram = tl.zeros([CHP, CHP], DT)
        for jo in range(0, (HID + BN - 1) // BN):
            cols = jo * BN + rn
            acc = tl.zeros([CHP, BN], DT)
            for ji in range(0, (NEXT_OUT + BK - 1) // BK):
                kk = ji * BK + rk
                d = _ld(dl_b + NEXT_OFF, rows, kk, CHP, NEXT_OUT, OUT_T, DT)
                w = _ld(wb + NEXT_ST, cols, kk, HID, NEXT_OUT, NEXT_OUT, DT)  # W_{i+1}[cols, kk]
                acc += _mm(d, tl.trans(w), PREC)
            m = acc * f_w
            delta = m * _act_grad(_ld(p_b + OUT_OFF, rows, cols, CHP, HID, OUT_T, DT), ACT)
            _st(dl_b + OUT_OFF, delta, rows, cols, CHP, HID, OUT_T)
            if RECORD:
                _st(m_b + OUT_OFF, m, rows, cols, CHP, HID, OUT_T)
            gram += _mm(delta, tl.trans(delta), PREC)
        _st(dd_b + i * CHP * CHP, gram, rows, rows, CHP, CHP, CHP)
        tl.debug_barrier()


@triton.jit
def _step(theta_raw, D, E_last, aa_b, dd_b, rows, last, max_grad_norm,
          DEPTH: tl.constexpr, CHP: tl.constexpr, GRAD_BOUND: tl.constexpr, NORMALIZE: tl.constexpr,
          CHANNELS: tl.constexpr, DT: tl.constexpr):
    """The chunk's step: θ_t bounded by max_grad_norm (‖∇ℓ_t‖² = Σ_i ‖a_i‖² ‖δ_i‖², mlp.token_grad_sq_norm), C = D
    diag(θ), u_m = θ ⊙ E[n,:], and under the normalised chunk step K[t,s] = G_ss / Σ_{r≤t} |G_sr| (mlp.chunk_step_norm,
    G = Σ_i a_i a_iᵀ ⊙ δ_i δ_iᵀ) applied to both. With α per channel D has one matrix per column, formed in the
    passes that read it (`_channel_retrieval`): C is then its column-free part [s ≤ t] θ_s (⊙ K)."""
    theta, scale, sq = _bounded_theta(theta_raw, aa_b, dd_b, rows, max_grad_norm, DEPTH, CHP, GRAD_BOUND, DT)
    if CHANNELS:
        C = tl.where(rows[None, :] <= rows[:, None], theta[None, :], 0.0)
    else:
        C = D * theta[None, :]
    u_m = theta * E_last
    if NORMALIZE:  # G is symmetric, so Σ_{r≤t} |G_sr| runs down its rows
        gram = tl.zeros([CHP, CHP], DT)
        for i in range(DEPTH):
            gram += _ld(aa_b + i * CHP * CHP, rows, rows, CHP, CHP, CHP, DT) * _ld(dd_b + i * CHP * CHP, rows, rows,
                                                                                   CHP, CHP, CHP, DT)
        overlap = tl.cumsum(tl.abs(gram), axis=0)
        own = _diag(gram, rows)
        # overlap ≥ G_ss ≥ 0, so where it is 0 so is G_ss: K = 0 there (the reference's clamp to `tiny`)
        norm = tl.where(rows[None, :] <= rows[:, None], own[None, :] / tl.where(overlap > 0, overlap, 1.0), 0.0)
        C = C * norm
        u_m = u_m * _row(norm, rows, last)
    else:
        norm = C
    return theta, scale, sq, norm, C, u_m


@triton.jit
def _ld_diag(ptr, rows, CHP: tl.constexpr, DT: tl.constexpr):
    """The diagonal of the CHP × CHP matrix at ptr, read as a vector (not the matrix, then its diagonal)."""
    return tl.load(ptr + rows * (CHP + 1)).to(DT)


@triton.jit
def _bounded_theta(theta_raw, aa_b, dd_b, rows, max_grad_norm, DEPTH: tl.constexpr, CHP: tl.constexpr,
                   GRAD_BOUND: tl.constexpr, DT: tl.constexpr):
    """(θ, its factor, ‖∇ℓ_t‖²): θ_t · min(1, c/‖∇ℓ_t‖) (mlp.grad_norm_scale), ‖∇ℓ_t‖² = Σ_i ‖a_i‖² ‖δ_i‖² read off
    the diagonals of the Gram matrices in the scratch."""
    sq = tl.zeros([CHP], DT)
    for i in range(DEPTH):
        sq += _ld_diag(aa_b + i * CHP * CHP, rows, CHP, DT) * _ld_diag(dd_b + i * CHP * CHP, rows, CHP, DT)
    if GRAD_BOUND:
        scale = max_grad_norm / tl.sqrt(tl.maximum(sq, max_grad_norm * max_grad_norm))
        theta = theta_raw * scale
    else:
        scale = theta_raw
        theta = theta_raw
    return theta, scale, sq


# --- α per channel (DESIGN.md §2): each output column j of a layer forgets with its own log-keep
# lk_j[t] = log(1 − α_j[t]) (computed outside, `decays.log_keep`), so its decays B_j[t,r] = exp(Σ_{r<j'≤t} lk_j[j']),
# β_j, c_j and D_j = B_j E are per column. D_j would be n × n per column, too large to pass in, so the kernels form
# what they need from lk tile by tile: the retrieval's chunk term of column j, Σ_s D_j[t,s] θ_s K[t,s] (h aᵀ)[t,s]
# ρδ[s,j], as a sum over r of B_j[t,r] Y_r[t,j] with Y_r = (H ⊙ E[r,:]) ρδ and H = ([s ≤ t] θ_s K[t,s]) ⊙ h aᵀ: n
# products where the scalar α has one. Each range sum is accumulated on its own (r from the last row down, adding one
# row of lk at a time), never as a difference of prefix sums, which would lose the small log-decays after a gate at
# LOG_FLOOR (decays.py). The gradient of lk leaves the kernels (n × d per chunk); autograd takes it through the log.


@triton.jit
def _lk_row(lk_tok, r, cols, n_valid, W_OUT, OUT_T: tl.constexpr, DT: tl.constexpr):
    """Row r of the chunk's log-keeps for these columns (zeros past the chunk's end)."""
    return tl.load(lk_tok + r * OUT_T + cols, mask=(cols < W_OUT) & (cols * 0 + r < n_valid), other=0.0).to(DT)


@triton.jit
def _channel_step_r(span, lk_tok, E_at, r, rows, cols, n_valid, W_OUT, OUT_T: tl.constexpr, CH: tl.constexpr,
                    DT: tl.constexpr):
    """One step of the r-loop (r from the last row down): the range sums span[t,j] = Σ_{r<j'≤t} lk_j[j'] (t > r, else
    0) carried from r + 1, B_r[t,j] = B_j[t,r] (t ≥ r, else 0), and E's row r."""
    span = tl.where(rows[:, None] > r, span + _lk_row(lk_tok, r + 1, cols, n_valid, W_OUT, OUT_T, DT)[None, :], 0.0)
    B_r = tl.where(rows[:, None] >= r, tl.exp(span), 0.0)
    E_r = tl.load(E_at + r * CH + rows, mask=(rows < n_valid) & (rows * 0 + r < n_valid), other=0.0).to(DT)
    return span, B_r, E_r


@triton.jit
def _channel_retrieval(H, st, lk_tok, E_at, e, cols, n_valid, rows, W_OUT, OUT_T: tl.constexpr, CH: tl.constexpr,
                       CHP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """(Σ_r B_r ⊙ (H ⊙ E[r,:]) ρδ, c, β) for a column tile: the chunk term of the retrieval, c[t,j] = Σ_{r≤t} B_j[t,r]
    e_r and β[t,j] = Π_{j'≤t} (1 − α_j[j'])."""
    keep = tl.exp(tl.cumsum(_ld(lk_tok, rows, cols, n_valid, W_OUT, OUT_T, DT), 0))
    term = tl.zeros([CHP, BN], DT)
    c = tl.zeros([CHP, BN], DT)
    span = tl.zeros([CHP, BN], DT)
    for rr in range(CHP):
        r = CHP - 1 - rr
        span, B_r, E_r = _channel_step_r(span, lk_tok, E_at, r, rows, cols, n_valid, W_OUT, OUT_T, CH, DT)
        e_r = _entry(e, rows, r)
        term += B_r * _mm(H * E_r[None, :], st, PREC)
        c += B_r * e_r
    return term, c, keep


@triton.jit
def _channel_end(lk_tok, E, e, cols, n_valid, rows, W_OUT, OUT_T: tl.constexpr, PREC: tl.constexpr,
                 DT: tl.constexpr):
    """The last row's decays for a column tile: Bn[r,j] = B_j[n,r] = Π_{r<j'≤n} (1 − α_j[j']) (a suffix sum of the
    log-keeps one row down, summed from the end), Eᵀ Bn (C_j[n,s] = u_w[s] (Eᵀ Bn)[s,j]), β_n and c_n per column."""
    Bn = tl.exp(tl.cumsum(_ld(lk_tok + OUT_T, rows, cols, n_valid - 1, W_OUT, OUT_T, DT), 0, reverse=True))
    EB = _mm(tl.trans(E), Bn, PREC)
    beta_n = tl.exp(tl.sum(_ld(lk_tok, rows, cols, n_valid, W_OUT, OUT_T, DT), 0))
    c_n = tl.sum(Bn * e[:, None], 0)
    return Bn, EB, beta_n, c_n


@triton.jit
def _channel_queries_grad(dy_tok, dr_b, dl_b, hw_b, hs_b, ddl_b, H, lk_tok, dlk_tok, E_at, e_at, dH_b, dE_b, rho, i,
                          n_valid, rows, rn, W_OUT, OUT_OFF, D_OUT: tl.constexpr, OUT_T: tl.constexpr,
                          DEPTH: tl.constexpr, CH: tl.constexpr, CHP: tl.constexpr, BN: tl.constexpr,
                          PREC: tl.constexpr, DT: tl.constexpr):
    """The backward pass of `_channel_retrieval` for layer i (r = β ⊙ h W⁰ + c ⊙ h S⁰ − Σ_r B_r ⊙ (H ⊙ E[r,:]) ρδ), the
    r-loop again: writes β ⊙ ∂r and c ⊙ ∂r over h W⁰ and h S⁰ in the scratch (the passes after read them there), the
    retrieval's part of ∂(ρδ) in ∂δ's place, and the log-keeps' gradient through β, c and the B_r (this chunk's rows
    of the layer, the first write); adds ∂H and ∂E into the scratch at dH_b (zeroed here) and dE_b, a tile or a row
    at a time (held whole through the loop, at chunks of 64 they spilled); returns ∂e."""
    _st(dH_b, tl.zeros([CHP, CHP], DT), rows, rows, CHP, CHP, CHP)
    d_e = tl.zeros([CHP], DT)
    for jo in range(0, (W_OUT + BN - 1) // BN):
        cols = jo * BN + rn
        if i == DEPTH - 1:
            dr = _ld(dy_tok, rows, cols, n_valid, D_OUT, D_OUT, DT)
        else:
            dr = _ld(dr_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT)
        st = _ld(dl_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT) * rho
        keep = tl.exp(tl.cumsum(_ld(lk_tok + OUT_OFF, rows, cols, n_valid, W_OUT, OUT_T, DT), 0))
        d_c = dr * _ld(hs_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT)
        # β[t] = exp(Σ_{j'≤t} lk[j']): ∂lk[j'] = Σ_{t≥j'} ∂β[t] β[t]
        lk_grad = tl.cumsum(dr * _ld(hw_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT) * keep, 0, reverse=True)
        _st(hw_b + OUT_OFF, keep * dr, rows, cols, CHP, W_OUT, OUT_T)  # (now, so that β is not held through the loop)
        c = tl.zeros([CHP, BN], DT)
        d_st = tl.zeros([CHP, BN], DT)
        span = tl.zeros([CHP, BN], DT)
        d_H = tl.zeros([CHP, CHP], DT)
        for rr in range(CHP):
            r = CHP - 1 - rr
            span, B_r, E_r = _channel_step_r(span, lk_tok + OUT_OFF, E_at, r, rows, cols, n_valid, W_OUT, OUT_T, CH,
                                             DT)
            e_r = tl.load(e_at + r, mask=r < n_valid, other=0.0).to(DT)  # (read here: held as a vector, it spilled)
            # H ⊙ E[r,:] = H diag(E[r,:]) is never formed: its products take E[r,:] on their n × BN side
            Es = E_r[:, None] * st
            Q = B_r * dr
            # B_r[t] = exp(Σ_{r<j'≤t} lk[j']): ∂lk[j'] = Σ_{t≥j'} ∂B_r[t] B_r[t] for j' > r
            d_B = d_c * e_r - dr * _mm(H, Es, PREC)
            lk_grad += tl.where(rows[:, None] > r, tl.cumsum(d_B * B_r, 0, reverse=True), 0.0)
            d_e += tl.where(rows == r, tl.sum(tl.sum(d_c * B_r, 1), 0), 0.0)
            c += B_r * e_r
            P = _mm(tl.trans(H), Q, PREC)
            d_st -= E_r[:, None] * P
            d_H -= _mm(Q, tl.trans(Es), PREC)
            # −∂E[r,s] = Σ_t (Q stᵀ)[t,s] H[t,s] = Σ_j st[s,j] (Hᵀ Q)[s,j]
            tl.store(dE_b + r * CHP + rows, tl.load(dE_b + r * CHP + rows) - tl.sum(st * P, 1))
        _st(dH_b, _ld(dH_b, rows, rows, CHP, CHP, CHP, DT) + d_H, rows, rows, CHP, CHP, CHP)
        _st(hs_b + OUT_OFF, c * dr, rows, cols, CHP, W_OUT, OUT_T)
        _st(ddl_b + OUT_OFF, d_st, rows, cols, CHP, W_OUT, OUT_T)
        _st(dlk_tok + OUT_OFF, lk_grad, rows, cols, n_valid, W_OUT, OUT_T)
    return d_e


@triton.jit
def _queries(wb, sb, fw_at, fw_on, h_b, a_b, dl_b, r_b, hw_b, hs_b, ha_b, y_tok, scales_at, radii_ptr,
             beta, c, C_at, u_w, u_m, beta_n, c_n, e_n, hidden_step, n_valid, rows, rk, rn, E_at, e_at, lk_tok,
             D_IN: tl.constexpr, HID: tl.constexpr, D_OUT: tl.constexpr, DEPTH: tl.constexpr, IN_T: tl.constexpr,
             OUT_T: tl.constexpr, CH: tl.constexpr, CHP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
             ACT: tl.constexpr, RESIDUAL: tl.constexpr, UPDATE: tl.constexpr, RECORD: tl.constexpr,
             STATE_BOUND: tl.constexpr, CHANNELS: tl.constexpr, PREC: tl.constexpr, PREC_STATE: tl.constexpr,
             DT: tl.constexpr):
    """Pass C: the queries at W_t, r_i = β ⊙ h_i W_i⁰ + c ⊙ h_i S_i⁰ − (C ⊙ h_i a_iᵀ) ρ_i δ_i, h_{i+1} = σ(r_i), y = r_L
    (+ q); with UPDATE the state after the chunk in place in the same tile loop (each tile read and written once):
    W' = β_n W⁰ + c_n S⁰ − a_iᵀ (C[n,:] ⊙ ρ_i δ_i), S' = e_n S⁰ − a_iᵀ (u_m ⊙ ρ_i δ_i), with its norms for the bounded
    state. C is read from the scratch at C_at. With α per channel (CHANNELS) β, c, β_n, c_n and C are per column,
    formed from the log-keeps at lk_tok, E at E_at and e at e_at (`_channel_retrieval`, `_channel_end`). The stored
    matrices are read times their pending factors (`_factor`); the update's own go to scales_at."""
    valid = (rows < n_valid)[:, None]
    for i in range(DEPTH):
        W_IN = D_IN + (HID - D_IN) * (i > 0)
        W_OUT = HID + (D_OUT - HID) * (i == DEPTH - 1)
        IN_OFF = (i > 0) * (D_IN + (i - 1) * HID)
        NEXT_IN = D_IN + i * HID
        OUT_OFF = i * HID
        ST = (i > 0) * (D_IN * HID + (i - 1) * HID * HID)
        rho = tl.where(i < DEPTH - 1, hidden_step, 1.0)  # ρ: the hidden layers step ρ θ (after the bounds saw it)
        f_w = _factor(fw_at, fw_on, 2 * i, DT)
        f_s = _factor(fw_at, fw_on, 2 * i + 1, DT)
        ha = tl.zeros([CHP, CHP], DT)
        for ji in range(0, (W_IN + BK - 1) // BK):
            kk = ji * BK + rk
            ha += _mm(_ld(h_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT),
                      tl.trans(_ld(a_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT)), PREC)
        if RECORD:
            _st(ha_b + i * CHP * CHP, ha, rows, rows, CHP, CHP, CHP)
        cha = _ld(C_at, rows, rows, CHP, CHP, CHP, DT) * ha  # (C read from the scratch: one n × n fewer held)
        if CHANNELS:
            E = _ld(E_at, rows, rows, CH, CH, CH, DT)  # (zero past n_valid: `_channel_gates` pads it)
            e = tl.load(e_at + rows, mask=rows < n_valid, other=0.0).to(DT)
        norm_w = 0.0
        norm_s = 0.0
        for jo in range(0, (W_OUT + BN - 1) // BN):
            cols = jo * BN + rn
            st = _ld(dl_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT) * rho
            if CHANNELS:
                _, EB, beta_end, c_end = _channel_end(lk_tok + OUT_OFF, E, e, cols, n_valid, rows, W_OUT, OUT_T,
                                                      PREC_STATE, DT)
                uw_st = u_w[:, None] * EB * st  # C_j[n,s] ρδ[s,j]
                beta_end = beta_end[None, :]
                c_end = c_end[None, :]
            else:
                uw_st = u_w[:, None] * st
                beta_end = beta_n
                c_end = c_n
            um_st = u_m[:, None] * st
            acc = tl.zeros([CHP, 2 * BN], DT)
            U = _pair(uw_st, um_st)
            for ji in range(0, (W_IN + BK - 1) // BK):
                kk = ji * BK + rk
                h = _ld(h_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT)
                w = _ld(wb + ST, kk, cols, W_IN, W_OUT, W_OUT, DT)
                s = _ld(sb + ST, kk, cols, W_IN, W_OUT, W_OUT, DT)
                acc += _mm(h, _pair(w, s), PREC)  # h W⁰ and h S⁰ as one product
                if UPDATE:  # the state's own update at IEEE precision: its rounding would build up chunk after chunk
                    a_t = tl.trans(_ld(a_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT))
                    up_w, up_s = _unpair(_mm(a_t, U, PREC_STATE))
                    w_new = (beta_end * f_w) * w + (c_end * f_s) * s - up_w
                    s_new = (e_n * f_s) * s - up_s
                    _st(wb + ST, w_new, kk, cols, W_IN, W_OUT, W_OUT)
                    _st(sb + ST, s_new, kk, cols, W_IN, W_OUT, W_OUT)
                    norm_w += tl.sum(tl.sum(w_new * w_new, 1), 0)
                    norm_s += tl.sum(tl.sum(s_new * s_new, 1), 0)
            acc_w, acc_s = _unpair(acc)
            hw = acc_w * f_w
            hs = acc_s * f_s
            if CHANNELS:  # (after the state's tiles: what it holds is not held through them)
                term, c_t, beta_t = _channel_retrieval(cha, st, lk_tok + OUT_OFF, E_at, e, cols, n_valid, rows,
                                                       W_OUT, OUT_T, CH, CHP, BN, PREC, DT)
                r = beta_t * hw + c_t * hs - term
            else:
                r = beta[:, None] * hw + c[:, None] * hs - _mm(cha, st, PREC)
            if RECORD:
                _st(r_b + OUT_OFF, r, rows, cols, CHP, W_OUT, OUT_T)
                _st(hw_b + OUT_OFF, hw, rows, cols, CHP, W_OUT, OUT_T)
                _st(hs_b + OUT_OFF, hs, rows, cols, CHP, W_OUT, OUT_T)
            if i < DEPTH - 1:
                _st(h_b + NEXT_IN, tl.where(valid, _act(r, ACT), 0.0), rows, cols, CHP, W_OUT, IN_T)
            elif not RECORD:  # (the backward pass's recomputation needs no y)
                if RESIDUAL:
                    r += _ld(h_b, rows, cols, CHP, D_IN, IN_T, DT)  # q, from the scratch
                _st(y_tok, r, rows, cols, n_valid, D_OUT, D_OUT)
        if UPDATE:
            if STATE_BOUND:  # the bounded state: min(1, R/‖X‖) (mlp.state_norm_scale), kept for the backward pass
                radius = tl.load(radii_ptr + i).to(DT)
                new_w = tl.where(norm_w > radius * radius, radius / tl.sqrt(tl.maximum(norm_w, radius * radius)), 1.0)
                new_s = tl.where(norm_s > radius * radius, radius / tl.sqrt(tl.maximum(norm_s, radius * radius)), 1.0)
                tl.store(scales_at + 2 * i, new_w.to(scales_at.dtype.element_ty))
                tl.store(scales_at + 2 * i + 1, new_s.to(scales_at.dtype.element_ty))
        tl.debug_barrier()


@triton.jit
def _copy_state(src_w, src_s, dst_w, dst_s, fw_at, fw_on, rk, rn,
                D_IN: tl.constexpr, HID: tl.constexpr, D_OUT: tl.constexpr, DEPTH: tl.constexpr,
                BK: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr):
    """dst = the state as it stands (each stored matrix times its pending factor); dst may be src."""
    for i in range(DEPTH):
        W_IN = D_IN + (HID - D_IN) * (i > 0)
        W_OUT = HID + (D_OUT - HID) * (i == DEPTH - 1)
        ST = (i > 0) * (D_IN * HID + (i - 1) * HID * HID)
        f_w = _factor(fw_at, fw_on, 2 * i, DT)
        f_s = _factor(fw_at, fw_on, 2 * i + 1, DT)
        for ji in range(0, (W_IN + BK - 1) // BK):
            kk = ji * BK + rk
            for jo in range(0, (W_OUT + BN - 1) // BN):
                cols = jo * BN + rn
                w = _ld(src_w + ST, kk, cols, W_IN, W_OUT, W_OUT, DT)
                s = _ld(src_s + ST, kk, cols, W_IN, W_OUT, W_OUT, DT)
                _st(dst_w + ST, w * f_w, kk, cols, W_IN, W_OUT, W_OUT)
                _st(dst_s + ST, s * f_s, kk, cols, W_IN, W_OUT, W_OUT)
    tl.debug_barrier()


@triton.jit
def _chunk_gates(theta_ptr, gate_ptr, beta_ptr, c_ptr, D_ptr, E_last_ptr, e_last_ptr, bh, j, seq, num_chunks, rows,
                 params_ptr, CH: tl.constexpr, GATED: tl.constexpr, DT: tl.constexpr):
    """Chunk j's θ, the loss's gate γ (Huber's δ: per token where GATED, else the rule's constant), and its gate
    algebra; rows past the chunk's end read as zeros."""
    start = j * CH
    n_valid = tl.minimum(seq - start, CH)
    valid = rows < n_valid
    tok = bh * seq + start
    theta_raw = tl.load(theta_ptr + tok + rows, mask=valid, other=0.0).to(DT)
    if GATED:
        gamma = tl.load(gate_ptr + tok + rows, mask=valid, other=1.0).to(DT)
    else:
        gamma = tl.full(rows.shape, 1.0, DT) * tl.load(params_ptr + 4).to(DT)  # the constant δ (read here: held
        # through the chunk, it was a spilled register at chunks of 64)
    dec = (bh * num_chunks + j) * CH
    beta = tl.load(beta_ptr + dec + rows, mask=valid, other=0.0).to(DT)
    c = tl.load(c_ptr + dec + rows, mask=valid, other=0.0).to(DT)
    E_last = tl.load(E_last_ptr + dec + rows, mask=valid, other=0.0).to(DT)
    D = _ld(D_ptr + dec * CH, rows, rows, n_valid, n_valid, CH, DT)
    e_n = tl.load(e_last_ptr + bh * num_chunks + j).to(DT)
    return theta_raw, gamma, beta, c, D, E_last, e_n, n_valid


# A program's scratch is one row of one buffer (`_scratch`): its parts sit at compile-time offsets from the row's
# start, so the kernel holds one pointer for all of them (at chunks of 64, a pointer per part cost the registers
# that spilled). The forward's parts first, then what the backward adds.


@triton.jit
def _forward_parts(scr, CHP: tl.constexpr, IN_T: tl.constexpr, OUT_T: tl.constexpr, D_OUT: tl.constexpr,
                   DEPTH: tl.constexpr):
    """h, a (the layers' inputs), p, δ (their pre-activations and deltas), e (the loss's error), a aᵀ and δ δᵀ per
    layer."""
    H: tl.constexpr = 0
    A: tl.constexpr = H + CHP * IN_T
    P: tl.constexpr = A + CHP * IN_T
    DL: tl.constexpr = P + CHP * OUT_T
    E: tl.constexpr = DL + CHP * OUT_T
    AA: tl.constexpr = E + CHP * D_OUT
    DD: tl.constexpr = AA + DEPTH * CHP * CHP
    return scr + H, scr + A, scr + P, scr + DL, scr + E, scr + AA, scr + DD


@triton.jit
def _backward_parts(scr, CHP: tl.constexpr, IN_T: tl.constexpr, OUT_T: tl.constexpr, D_OUT: tl.constexpr,
                    DEPTH: tl.constexpr):
    """After the forward's parts: m, r, h W⁰, h S⁰, h aᵀ per layer, and the gradients ∂a, ∂r, ∂δ, ∂m, ∂p, and the
    chunk's n × n matrices C, M, C ⊙ h aᵀ, ∂C, K (and with α per channel ∂E, then a row of every layer's β_n)."""
    M: tl.constexpr = 2 * CHP * IN_T + 2 * CHP * OUT_T + CHP * D_OUT + 2 * DEPTH * CHP * CHP  # the forward's size
    R: tl.constexpr = M + CHP * OUT_T
    HW: tl.constexpr = R + CHP * OUT_T
    HS: tl.constexpr = HW + CHP * OUT_T
    HA: tl.constexpr = HS + CHP * OUT_T
    DA: tl.constexpr = HA + DEPTH * CHP * CHP
    DR: tl.constexpr = DA + CHP * IN_T
    DDL: tl.constexpr = DR + CHP * OUT_T
    DM: tl.constexpr = DDL + CHP * OUT_T
    DP: tl.constexpr = DM + CHP * OUT_T
    NN: tl.constexpr = DP + CHP * OUT_T
    return (scr + M, scr + R, scr + HW, scr + HS, scr + HA, scr + DA, scr + DR, scr + DDL, scr + DM, scr + DP,
            scr + NN)


# --- the kernels -------------------------------------------------------------------------------------------------


# Triton compiles a kernel anew for an integer argument equal to 1 or divisible by 16; the sizes and the chunk range
# change from call to call (a group of chunks, a batch of one), so they are left unspecialised: one compilation per
# memory shape and rule.
_RUN_TIME = ["BH", "seq", "num_chunks", "first_chunk", "last_chunk", "scr_row"]


@triton.jit(do_not_specialize=_RUN_TIME + ["save_every"])
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, theta_ptr, gate_ptr, beta_ptr, c_ptr, D_ptr, E_last_ptr, e_last_ptr, lk_ptr, params_ptr,
    radii_ptr, w_ptr, s_ptr, saved_w, saved_s, y_ptr, scales_ptr, scr_ptr, scr_row,
    BH, seq, num_chunks, first_chunk, last_chunk, save_every,
    D_IN: tl.constexpr, HID: tl.constexpr, D_OUT: tl.constexpr, DEPTH: tl.constexpr, CH: tl.constexpr,
    CHP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    GRAD_BOUND: tl.constexpr, STATE_BOUND: tl.constexpr, NORMALIZE: tl.constexpr, LOSS: tl.constexpr,
    GATED: tl.constexpr, CHANNELS: tl.constexpr, PREC: tl.constexpr, PREC_STATE: tl.constexpr, DT: tl.constexpr,
):
    """Chunks [first_chunk, last_chunk) of row bh: y, the state updated in place at w_ptr/s_ptr (the end state on
    exit), the bounded state's factors per chunk, and (save_every > 0) the starting state of every save_every-th
    chunk into saved_* slots (a run-time number: recording or not, and the group size, compile no new kernel). With
    α per channel (CHANNELS), c_ptr holds e and D_ptr E (`_channel_gates`), and lk_ptr the log-keeps."""
    bh = tl.program_id(0).to(tl.int64)
    TOT: tl.constexpr = D_IN * HID * (DEPTH > 1) + (DEPTH - 2) * HID * HID * (DEPTH > 2) + HID * D_OUT * (DEPTH > 1) \
        + D_IN * D_OUT * (DEPTH == 1)
    IN_T: tl.constexpr = D_IN + (DEPTH - 1) * HID
    OUT_T: tl.constexpr = (DEPTH - 1) * HID + D_OUT
    rows = tl.arange(0, CHP)
    rk = tl.arange(0, BK)
    rn = tl.arange(0, BN)
    wb = w_ptr + bh * TOT
    sb = s_ptr + bh * TOT
    h_b, a_b, p_b, dl_b, e_b, aa_b, dd_b = _forward_parts(scr_ptr + bh * scr_row, CHP, IN_T, OUT_T, D_OUT, DEPTH)
    for j in range(first_chunk, last_chunk):
        # the stored state's pending factors, the previous chunk's (1 for the first: it starts materialised)
        if STATE_BOUND:
            fw_at = scales_ptr + ((j - 1) * BH + bh) * (2 * DEPTH)
        else:
            fw_at = None
        fw_on = j > first_chunk
        if save_every > 0:
            if (j - first_chunk) % save_every == 0:
                slot = ((j - first_chunk) // save_every) * BH + bh
                _copy_state(wb, sb, saved_w + slot * TOT, saved_s + slot * TOT, fw_at, fw_on, rk, rn,
                            D_IN, HID, D_OUT, DEPTH, BK, BN, DT)
        theta_raw, gamma, beta, c, D, E_last, e_n, n_valid = _chunk_gates(
            theta_ptr, gate_ptr, beta_ptr, c_ptr, D_ptr, E_last_ptr, e_last_ptr, bh, j, seq, num_chunks, rows,
            params_ptr, CH, GATED, DT)
        last = n_valid - 1
        tok = bh * seq + j * CH
        _chunk_start(q_ptr + tok * D_IN, k_ptr + tok * D_IN, h_b, a_b, aa_b, n_valid, rows, rk, D_IN, IN_T, CHP, BK,
                     PREC, DT)
        tl.debug_barrier()
        # the rule's numbers, read where they are used, as in the backward (held through the chunk loop, they spilled
        # with α per channel)
        loss_p = tl.load(params_ptr + 2).to(DT)
        loss_eps = tl.load(params_ptr + 3).to(DT)
        _keys(wb, fw_at, fw_on, k_ptr + tok * D_IN, v_ptr + tok * D_OUT, e_b, a_b, p_b, dl_b, aa_b, dd_b, gamma,
              n_valid, rows, rk, rn, loss_p, loss_eps, D_IN, HID, D_OUT, DEPTH, IN_T, OUT_T, CHP, BK, BN, ACT, RESIDUAL,
              LOSS, PREC, DT)
        _deltas(wb, fw_at, fw_on, p_b, dl_b, dl_b, dd_b, rows, rk, rn, D_IN, HID, D_OUT, DEPTH, OUT_T, CHP, BK, BN, ACT,
                False, PREC, DT)
        theta, scale, sq, norm, C, u_m = _step(theta_raw, D, E_last, aa_b, dd_b, rows, last,
                                               tl.load(params_ptr).to(DT), DEPTH, CHP, GRAD_BOUND, NORMALIZE, CHANNELS,
                                               DT)
        u_w = _row(C, rows, last)
        beta_n = _entry(beta, rows, last)
        c_n = _entry(c, rows, last)
        dec = (bh * num_chunks + j) * CH
        tl.debug_barrier()  # the Gram matrices are read: C takes the first one's place, and _queries reads it there
        _st(aa_b, C, rows, rows, CHP, CHP, CHP)
        tl.debug_barrier()
        _queries(wb, sb, fw_at, fw_on, h_b, a_b, dl_b, dl_b, dl_b, dl_b, aa_b, y_ptr + tok * D_OUT,
                 scales_ptr + (j * BH + bh) * (2 * DEPTH), radii_ptr, beta, c, aa_b, u_w, u_m, beta_n, c_n, e_n,
                 tl.load(params_ptr + 1).to(DT), n_valid, rows, rk, rn, D_ptr + dec * CH, c_ptr + dec,
                 lk_ptr + tok * OUT_T, D_IN, HID, D_OUT, DEPTH, IN_T, OUT_T, CH, CHP, BK, BN, ACT, RESIDUAL, True,
                 False, STATE_BOUND, CHANNELS, PREC, PREC_STATE, DT)
    if STATE_BOUND:  # the end state as it stands: each matrix times its pending factor
        _copy_state(wb, sb, wb, sb, scales_ptr + ((last_chunk - 1) * BH + bh) * (2 * DEPTH), True, rk, rn, D_IN, HID,
                    D_OUT, DEPTH, BK, BN, DT)


@triton.jit(do_not_specialize=_RUN_TIME)
def _backward_kernel(
    q_ptr, k_ptr, v_ptr, theta_ptr, gate_ptr, beta_ptr, c_ptr, D_ptr, E_last_ptr, e_last_ptr, lk_ptr, params_ptr,
    saved_w, saved_s, dy_ptr, d_state_ptr,
    dq_ptr, dk_ptr, dv_ptr, dtheta_ptr, dgate_ptr, dbeta_ptr, dc_ptr, dD_ptr, dE_last_ptr, de_last_ptr, dlk_ptr,
    scales_ptr, scr_ptr, scr_row,
    BH, seq, num_chunks, first_chunk, last_chunk,
    D_IN: tl.constexpr, HID: tl.constexpr, D_OUT: tl.constexpr, DEPTH: tl.constexpr, CH: tl.constexpr,
    CHP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    GRAD_BOUND: tl.constexpr, STATE_BOUND: tl.constexpr, NORMALIZE: tl.constexpr, LOSS: tl.constexpr,
    GATED: tl.constexpr, CHANNELS: tl.constexpr, PREC: tl.constexpr, PREC_STATE: tl.constexpr, DT: tl.constexpr,
):
    """Chunks [first_chunk, last_chunk) of row bh in reverse (`fused._chunk_backward`, tile by tile), from their
    starting states in saved_* (one slot per chunk): d_state ([BH, 2, TOT]: ∂W, ∂S) holds the gradient of the state
    after the last of them on entry and that of the state before the first on exit (updated in place). Writes the
    chunks' rows of ∂q, ∂k, ∂v, ∂θ, the loss gate's gradient and the decays' gradients."""
    bh = tl.program_id(0).to(tl.int64)
    TOT: tl.constexpr = D_IN * HID * (DEPTH > 1) + (DEPTH - 2) * HID * HID * (DEPTH > 2) + HID * D_OUT * (DEPTH > 1) \
        + D_IN * D_OUT * (DEPTH == 1)
    IN_T: tl.constexpr = D_IN + (DEPTH - 1) * HID
    OUT_T: tl.constexpr = (DEPTH - 1) * HID + D_OUT
    rows = tl.arange(0, CHP)
    rk = tl.arange(0, BK)
    rn = tl.arange(0, BN)
    dwb = d_state_ptr + bh * (2 * TOT)  # ∂W and ∂S of the row side by side: one pointer held, ∂S at a fixed offset
    dsb = dwb + TOT
    scr_b = scr_ptr + bh * scr_row  # the forward's parts, then the backward's
    h_b, a_b, p_b, dl_b, e_b, aa_b, dd_b = _forward_parts(scr_b, CHP, IN_T, OUT_T, D_OUT, DEPTH)
    m_b, r_b, hw_b, hs_b, ha_b, da_b, dr_b, ddl_b, dm_b, dp_b, nn_b = _backward_parts(scr_b, CHP, IN_T, OUT_T, D_OUT,
                                                                                        DEPTH)
    for step_back in range(0, last_chunk - first_chunk):
        j = last_chunk - 1 - step_back
        slot = (j - first_chunk) * BH + bh
        wb = saved_w + slot * TOT
        sb = saved_s + slot * TOT
        if STATE_BOUND:  # the bounded state's factors are constants: its backward pass is a product with them
            phi_at = scales_ptr + (j * BH + bh) * (2 * DEPTH)
        else:
            phi_at = None
        # --- recompute the chunk's forward (passes A–C without the update), keeping what the backward reads ------
        theta_raw, gamma, beta, c, D, E_last, e_n, n_valid = _chunk_gates(
            theta_ptr, gate_ptr, beta_ptr, c_ptr, D_ptr, E_last_ptr, e_last_ptr, bh, j, seq, num_chunks, rows,
            params_ptr, CH, GATED, DT)
        last = n_valid - 1
        valid = (rows < n_valid)[:, None]
        tok = bh * seq + j * CH
        _chunk_start(q_ptr + tok * D_IN, k_ptr + tok * D_IN, h_b, a_b, aa_b, n_valid, rows, rk, D_IN, IN_T, CHP, BK,
                     PREC, DT)
        tl.debug_barrier()
        # the loss's p and ε, read where they are used (held through the chunk, they were what spilled at chunks of 64)
        loss_p = tl.load(params_ptr + 2).to(DT)
        loss_eps = tl.load(params_ptr + 3).to(DT)
        _keys(wb, None, False, k_ptr + tok * D_IN, v_ptr + tok * D_OUT, e_b, a_b, p_b, dl_b, aa_b, dd_b, gamma,
              n_valid, rows, rk, rn, loss_p, loss_eps, D_IN, HID, D_OUT, DEPTH, IN_T, OUT_T, CHP, BK, BN, ACT,
              RESIDUAL, LOSS, PREC, DT)
        _deltas(wb, None, False, p_b, dl_b, m_b, dd_b, rows, rk, rn, D_IN, HID, D_OUT, DEPTH, OUT_T, CHP, BK, BN, ACT,
                True, PREC, DT)
        # the rule's numbers, read where they are used: each held through the chunk loop is a register,
        # and at chunks of 64 those were what spilled
        max_grad_norm = tl.load(params_ptr).to(DT)
        hidden_step = tl.load(params_ptr + 1).to(DT)
        theta, scale, sq, norm, C, u_m = _step(theta_raw, D, E_last, aa_b, dd_b, rows, last, max_grad_norm, DEPTH,
                                               CHP, GRAD_BOUND, NORMALIZE, CHANNELS, DT)
        # At chunks of 64 an n × n matrix is 16 registers a thread, and holding the step's (D, K, C, θ's factors)
        # through the layer loop spilled: C, K and the layer's M, C ⊙ h aᵀ and ∂C wait in the scratch for the loops
        # that read them, and step 3 re-reads the gates and θ's bound (tests/memory/test_triton_compile.py).
        u_w = _row(C, rows, last)
        beta_n = _entry(beta, rows, last)
        c_n = _entry(c, rows, last)
        _st(nn_b, C, rows, rows, CHP, CHP, CHP)
        if NORMALIZE:
            _st(nn_b + 4 * CHP * CHP, norm, rows, rows, CHP, CHP, CHP)
        tl.debug_barrier()
        E_at = D_ptr + (bh * num_chunks + j) * CH * CH  # α per channel: E and e (`_channel_gates`), the log-keeps
        e_at = c_ptr + (bh * num_chunks + j) * CH
        lk_tok = lk_ptr + tok * OUT_T
        _queries(wb, sb, None, False, h_b, a_b, dl_b, r_b, hw_b, hs_b, ha_b, dy_ptr, scales_ptr, params_ptr,
                 beta, c, nn_b, u_w, u_m, beta_n, c_n, e_n, hidden_step, n_valid, rows, rk, rn, E_at, e_at, lk_tok,
                 D_IN, HID, D_OUT, DEPTH, IN_T, OUT_T, CH, CHP, BK, BN, ACT, RESIDUAL, False, True, False, CHANNELS,
                 PREC, PREC_STATE, DT)
        # --- 1–2. the state update and the queries, last layer first ---------------------------------------------
        _st(nn_b + 3 * CHP * CHP, tl.zeros([CHP, CHP], DT), rows, rows, CHP, CHP, CHP)  # ∂C
        if CHANNELS:
            _st(nn_b + 5 * CHP * CHP, tl.zeros([CHP, CHP], DT), rows, rows, CHP, CHP, CHP)  # ∂E
            d_e = tl.zeros([CHP], DT)
        d_u_w = tl.zeros([CHP], DT)
        d_u_m = tl.zeros([CHP], DT)
        d_beta = tl.zeros([CHP], DT)
        d_c = tl.zeros([CHP], DT)
        d_c_n = 0.0
        d_e_n = 0.0
        d_beta_n = 0.0
        for ii in range(DEPTH):
            i = DEPTH - 1 - ii
            W_IN = D_IN + (HID - D_IN) * (i > 0)
            W_OUT = HID + (D_OUT - HID) * (i == DEPTH - 1)
            IN_OFF = (i > 0) * (D_IN + (i - 1) * HID)
            OUT_OFF = i * HID
            PREV_OFF = (i > 0) * (i - 1) * HID
            ST = (i > 0) * (D_IN * HID + (i - 1) * HID * HID)
            rho = tl.where(i < DEPTH - 1, tl.load(params_ptr + 1).to(DT), 1.0)
            ph_w = _factor(phi_at, True, 2 * i, DT)
            ph_s = _factor(phi_at, True, 2 * i + 1, DT)
            if CHANNELS:  # the retrieval's per-column terms (`_channel_queries_grad`); M = −∂(h aᵀ) = −∂H ⊙ C
                H = _ld(nn_b, rows, rows, CHP, CHP, CHP, DT) * _ld(ha_b + i * CHP * CHP, rows, rows, CHP, CHP, CHP, DT)
                d_e += _channel_queries_grad(
                    dy_ptr + tok * D_OUT, dr_b, dl_b, hw_b, hs_b, ddl_b, H, lk_tok, dlk_ptr + tok * OUT_T, E_at,
                    e_at, nn_b + CHP * CHP,
                    nn_b + 5 * CHP * CHP, rho, i, n_valid, rows, rn, W_OUT, OUT_OFF, D_OUT, OUT_T, DEPTH, CH, CHP, BN,
                    PREC, DT)
                tl.debug_barrier()
                # (C and h aᵀ read again, not held through the r-loop, where at chunks of 64 they spilled)
                d_H = _ld(nn_b + CHP * CHP, rows, rows, CHP, CHP, CHP, DT)  # (∂H, in M's place)
                _st(nn_b + 3 * CHP * CHP, _ld(nn_b + 3 * CHP * CHP, rows, rows, CHP, CHP, CHP, DT)
                    + d_H * _ld(ha_b + i * CHP * CHP, rows, rows, CHP, CHP, CHP, DT), rows, rows, CHP, CHP, CHP)
                tl.debug_barrier()
                _st(nn_b + CHP * CHP, -(d_H * _ld(nn_b, rows, rows, CHP, CHP, CHP, DT)), rows, rows, CHP, CHP, CHP)  # M
            else:
                # r_d = ∂r ρδᵀ (r −= (C ⊙ h aᵀ) ρ δ), ∂β = Σ ∂r ⊙ h W⁰, ∂c = Σ ∂r ⊙ h S⁰
                r_d = tl.zeros([CHP, CHP], DT)
                for jo in range(0, (W_OUT + BN - 1) // BN):
                    cols = jo * BN + rn
                    if i == DEPTH - 1:
                        dr = _ld(dy_ptr + tok * D_OUT, rows, cols, n_valid, D_OUT, D_OUT, DT)
                    else:
                        dr = _ld(dr_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT)
                    st = _ld(dl_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT) * rho
                    r_d += _mm(dr, tl.trans(st), PREC)
                    d_beta += tl.sum(dr * _ld(hw_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT), 1)
                    d_c += tl.sum(dr * _ld(hs_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT), 1)
                ha = _ld(ha_b + i * CHP * CHP, rows, rows, CHP, CHP, CHP, DT)
                _st(nn_b + 3 * CHP * CHP, _ld(nn_b + 3 * CHP * CHP, rows, rows, CHP, CHP, CHP, DT) - r_d * ha, rows,
                    rows, CHP, CHP, CHP)
                C = _ld(nn_b, rows, rows, CHP, CHP, CHP, DT)
                _st(nn_b + CHP * CHP, C * r_d, rows, rows, CHP, CHP, CHP)  # M
                _st(nn_b + 2 * CHP * CHP, C * ha, rows, rows, CHP, CHP, CHP)
            tl.debug_barrier()
            for ji in range(0, (W_IN + BK - 1) // BK):  # ∂a = −Mᵀ h, the rest added tile by tile below
                kk = ji * BK + rk
                M = _ld(nn_b + CHP * CHP, rows, rows, CHP, CHP, CHP, DT)
                _st(da_b + IN_OFF, -_mm(tl.trans(M), _ld(h_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT), PREC), rows,
                    kk, CHP, W_IN, IN_T)
            tl.debug_barrier()
            # The update's gradient, through ∂W', ∂S' (and S⁰ for ∂c_n, ∂e_n): ∂S⁰, ∂a, ∂(ρδ).
            if CHANNELS:
                E = _ld(E_at, rows, rows, CH, CH, CH, DT)  # (zero past n_valid: `_channel_gates` pads it)
                e = tl.load(e_at + rows, mask=rows < n_valid, other=0.0).to(DT)
                d_E = tl.zeros([CHP, CHP], DT)
            for jo in range(0, (W_OUT + BN - 1) // BN):
                cols = jo * BN + rn
                if i == DEPTH - 1:
                    dr = _ld(dy_ptr + tok * D_OUT, rows, cols, n_valid, D_OUT, D_OUT, DT)
                else:
                    dr = _ld(dr_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT)
                st = _ld(dl_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT) * rho
                if CHANNELS:  # β_n, c_n and C[n,:] per column; c ⊙ ∂r from the scratch (`_channel_queries_grad`)
                    Bn, EB, beta_end, c_end = _channel_end(lk_tok + OUT_OFF, E, e, cols, n_valid, rows, W_OUT, OUT_T,
                                                           PREC_STATE, DT)
                    g_s = _ld(hs_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT)
                    g_uw = u_w[:, None] * EB * st
                    # β_n per column, kept in the scratch for ∂W⁰ (step 5; re-forming it there kept the log-keeps'
                    # pointer alive through step 4, and it spilled)
                    tl.store(nn_b + 6 * CHP * CHP + OUT_OFF + cols, beta_end, mask=cols < W_OUT)
                    c_end = c_end[None, :]
                    d_beta_end = tl.zeros([BN], DT)
                    d_c_end = tl.zeros([BN], DT)
                else:
                    g_s = c[:, None] * dr
                    g_uw = u_w[:, None] * st
                    c_end = c_n
                g_um = u_m[:, None] * st
                g_u = _pair(g_um, g_uw)
                a_d = tl.zeros([CHP, 2 * BN], DT)  # a ∂S' and a ∂W', paired
                for ji in range(0, (W_IN + BK - 1) // BK):
                    kk = ji * BK + rk
                    s = _ld(sb + ST, kk, cols, W_IN, W_OUT, W_OUT, DT)
                    dwn = _ld(dwb + ST, kk, cols, W_IN, W_OUT, W_OUT, DT) * ph_w
                    dsn = _ld(dsb + ST, kk, cols, W_IN, W_OUT, W_OUT, DT) * ph_s
                    h = _ld(h_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT)
                    a = _ld(a_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT)
                    # ∂S⁰ = e_n ∂S' + c_n ∂W' + hᵀ (c ⊙ ∂r), complete: written in place of ∂S'
                    _st(dsb + ST, e_n * dsn + c_end * dwn + _mm(tl.trans(h), g_s, PREC_STATE), kk, cols, W_IN,
                        W_OUT, W_OUT)
                    d_new = _pair(dsn, dwn)
                    a_d += _mm(a, d_new, PREC)
                    # ∂a −= (u_m ⊙ ρδ) ∂S'ᵀ + (u_w ⊙ ρδ) ∂W'ᵀ, one product
                    da = _ld(da_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT) - _mm(g_u, tl.trans(d_new), PREC)
                    _st(da_b + IN_OFF, da, rows, kk, CHP, W_IN, IN_T)
                    d_e_n += tl.sum(tl.sum(s * dsn, 1), 0)
                    if CHANNELS:  # ∂β_n and ∂c_n per column: ⟨W⁰, ∂W'⟩ and ⟨S⁰, ∂W'⟩ down each column
                        d_beta_end += tl.sum(_ld(wb + ST, kk, cols, W_IN, W_OUT, W_OUT, DT) * dwn, 0)
                        d_c_end += tl.sum(s * dwn, 0)
                    else:
                        d_c_n += tl.sum(tl.sum(s * dwn, 1), 0)
                a_ds, a_dw = _unpair(a_d)
                if CHANNELS:
                    # ∂(ρδ) = −(C[n,:] ⊙ a ∂W' + u_m ⊙ a ∂S') + the retrieval's part (in ∂δ's place), then ρ;
                    # C_j[n,s] = u_w[s] (Eᵀ Bn)[s,j]: ∂u_w, ∂E, and ∂Bn, ∂β_n → the log-keeps (`_channel_end_grad`)
                    d_step = -(u_w[:, None] * EB * a_dw + u_m[:, None] * a_ds) \
                        + _ld(ddl_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT)
                    _st(ddl_b + OUT_OFF, d_step * rho, rows, cols, CHP, W_OUT, OUT_T)
                    d_Cn = -a_dw * st
                    d_u_w += tl.sum(d_Cn * EB, 1)
                    X = d_Cn * u_w[:, None]  # ∂(Eᵀ Bn)
                    d_E += _mm(Bn, tl.trans(X), PREC)
                    d_Bn = _mm(E, X, PREC) + e[:, None] * d_c_end[None, :]
                    d_e += tl.sum(Bn * d_c_end[None, :], 1)
                    P = d_Bn * Bn  # Bn[r] = exp(Σ_{r<j'≤n} lk[j']): ∂lk[j'] = Σ_{r<j'} P[r], and β_n's Σ_{j'≤n}
                    lk_grad = tl.cumsum(P, 0) - P + (d_beta_end * beta_end)[None, :]
                    dlk_at = dlk_ptr + tok * OUT_T + OUT_OFF
                    _st(dlk_at, _ld(dlk_at, rows, cols, n_valid, W_OUT, OUT_T, DT) + lk_grad, rows, cols, n_valid,
                        W_OUT, OUT_T)
                else:
                    # ∂(ρδ) = −(u_w ⊙ a ∂W' + u_m ⊙ a ∂S') − (C ⊙ h aᵀ)ᵀ ∂r, then ρ: the gradient of δ_i
                    cha = _ld(nn_b + 2 * CHP * CHP, rows, rows, CHP, CHP, CHP, DT)
                    d_step = -(u_w[:, None] * a_dw + u_m[:, None] * a_ds) - _mm(tl.trans(cha), dr, PREC)
                    _st(ddl_b + OUT_OFF, d_step * rho, rows, cols, CHP, W_OUT, OUT_T)
                    d_u_w -= tl.sum(a_dw * st, 1)
                d_u_m -= tl.sum(a_ds * st, 1)
                tl.debug_barrier()
            if CHANNELS:
                _st(nn_b + 5 * CHP * CHP, _ld(nn_b + 5 * CHP * CHP, rows, rows, CHP, CHP, CHP, DT) + d_E, rows, rows,
                    CHP, CHP, CHP)
            # The queries' gradient through W⁰, S⁰: ∂h = (β ⊙ ∂r) W⁰ᵀ + (c ⊙ ∂r) S⁰ᵀ − M a, then ∂r of the layer below
            # (∂h ⊙ σ'(r_{i−1})) or ∂q.
            for ji in range(0, (W_IN + BK - 1) // BK):
                kk = ji * BK + rk
                M = _ld(nn_b + CHP * CHP, rows, rows, CHP, CHP, CHP, DT)
                dh = -_mm(M, _ld(a_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT), PREC)
                for jo in range(0, (W_OUT + BN - 1) // BN):
                    cols = jo * BN + rn
                    if i == DEPTH - 1:
                        dr = _ld(dy_ptr + tok * D_OUT, rows, cols, n_valid, D_OUT, D_OUT, DT)
                    else:
                        dr = _ld(dr_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT)
                    state = _pair(_ld(sb + ST, kk, cols, W_IN, W_OUT, W_OUT, DT), _ld(wb + ST, kk, cols, W_IN, W_OUT,
                                                                                       W_OUT, DT))
                    if CHANNELS:  # c ⊙ ∂r and β ⊙ ∂r per column, from the scratch
                        dh += _mm(_pair(_ld(hs_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT),
                                        _ld(hw_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT)), tl.trans(state), PREC)
                    else:
                        dh += _mm(_pair(c[:, None] * dr, beta[:, None] * dr), tl.trans(state), PREC)
                if i > 0:
                    r_prev = _ld(r_b + PREV_OFF, rows, kk, CHP, W_IN, OUT_T, DT)
                    _st(dr_b + PREV_OFF, dh * _act_grad(r_prev, ACT), rows, kk, CHP, W_IN, OUT_T)
                else:
                    if RESIDUAL:
                        dh += _ld(dy_ptr + tok * D_OUT, rows, kk, n_valid, D_OUT, D_OUT, DT)
                    _st(dq_ptr + tok * D_IN, dh, rows, kk, n_valid, D_IN, D_IN)
            tl.debug_barrier()
        # --- 3. θ: C = D diag(θ) (⊙ K), u_w = C[n,:], u_m = θ ⊙ E[n,:] (⊙ K[n,:]), θ = θ_raw · min(1, c/‖∇ℓ‖) -------
        d_C = _ld(nn_b + 3 * CHP * CHP, rows, rows, CHP, CHP, CHP, DT) + tl.where(rows[:, None] == last, d_u_w[None, :],
                                                                                   0.0)
        theta_raw, gamma, _, _, D, E_last, _, _ = _chunk_gates(
            theta_ptr, gate_ptr, beta_ptr, c_ptr, D_ptr, E_last_ptr, e_last_ptr, bh, j, seq, num_chunks, rows,
            params_ptr, CH, GATED, DT)
        max_grad_norm = tl.load(params_ptr).to(DT)
        theta, scale, sq = _bounded_theta(theta_raw, aa_b, dd_b, rows, max_grad_norm, DEPTH, CHP, GRAD_BOUND, DT)
        if NORMALIZE:  # K is a constant to the outer gradient
            norm = _ld(nn_b + 4 * CHP * CHP, rows, rows, CHP, CHP, CHP, DT)
            d_C = d_C * norm
            d_u_m = d_u_m * _row(norm, rows, last)
        if CHANNELS:  # C = [s ≤ t] θ_s (⊙ K); D's place takes ∂E, gathered by the layers
            d_th = tl.sum(tl.where(rows[None, :] <= rows[:, None], d_C, 0.0), 0) + d_u_m * E_last
            d_D = _ld(nn_b + 5 * CHP * CHP, rows, rows, CHP, CHP, CHP, DT)
        else:
            d_th = tl.sum(d_C * D, 0) + d_u_m * E_last
            d_D = d_C * theta[None, :]
        d_E_last = d_u_m * theta
        d_theta = d_th
        if GRAD_BOUND:
            d_theta = d_th * scale
            # scale = c / sqrt(max(sq, c²)): d scale / d sq = −scale / (2 sq) above the bound, 0 below
            above = sq > max_grad_norm * max_grad_norm
            d_sq = tl.where(above, -0.5 * d_th * theta_raw * scale / tl.where(above, sq, 1.0), 0.0)
            for i in range(DEPTH):  # ‖∇ℓ_t‖² = Σ_i ‖a_i‖² ‖δ_i‖²
                W_IN = D_IN + (HID - D_IN) * (i > 0)
                W_OUT = HID + (D_OUT - HID) * (i == DEPTH - 1)
                IN_OFF = (i > 0) * (D_IN + (i - 1) * HID)
                OUT_OFF = i * HID
                sa = _ld_diag(aa_b + i * CHP * CHP, rows, CHP, DT)
                sd = _ld_diag(dd_b + i * CHP * CHP, rows, CHP, DT)
                for ji in range(0, (W_IN + BK - 1) // BK):
                    kk = ji * BK + rk
                    da = _ld(da_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT) \
                        + (2.0 * d_sq * sd)[:, None] * _ld(a_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT)
                    _st(da_b + IN_OFF, da, rows, kk, CHP, W_IN, IN_T)
                for jo in range(0, (W_OUT + BN - 1) // BN):
                    cols = jo * BN + rn
                    dd = _ld(ddl_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT) \
                        + (2.0 * d_sq * sa)[:, None] * _ld(dl_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT)
                    _st(ddl_b + OUT_OFF, dd, rows, cols, CHP, W_OUT, OUT_T)
            tl.debug_barrier()
        vrows = rows < n_valid
        tl.store(dtheta_ptr + tok + rows, d_theta.to(dtheta_ptr.dtype.element_ty), mask=vrows)
        dec = (bh * num_chunks + j) * CH
        tl.store(dE_last_ptr + dec + rows, d_E_last.to(dE_last_ptr.dtype.element_ty), mask=vrows)
        _st(dD_ptr + dec * CH, d_D, rows, rows, n_valid, n_valid, CH)
        tl.store(de_last_ptr + bh * num_chunks + j, d_e_n.to(de_last_ptr.dtype.element_ty))
        # --- 4. the δ recursion: δ_i = m_i ⊙ σ'(p_i), m_i = δ_{i+1} W_{i+1}ᵀ, from the first layer up ----------------
        for i in range(DEPTH - 1):
            NEXT_OUT = HID + (D_OUT - HID) * (i + 1 == DEPTH - 1)
            NEXT_ST = D_IN * HID + i * HID * HID
            OUT_OFF = i * HID
            NEXT_OFF = (i + 1) * HID
            for jo in range(0, (HID + BN - 1) // BN):
                cols = jo * BN + rn
                ddl = _ld(ddl_b + OUT_OFF, rows, cols, CHP, HID, OUT_T, DT)
                p = _ld(p_b + OUT_OFF, rows, cols, CHP, HID, OUT_T, DT)
                _st(dm_b + OUT_OFF, ddl * _act_grad(p, ACT), rows, cols, CHP, HID, OUT_T)
                _st(dp_b + OUT_OFF, ddl * _ld(m_b + OUT_OFF, rows, cols, CHP, HID, OUT_T, DT) * _act_grad2(p, ACT),
                    rows, cols, CHP, HID, OUT_T)
            tl.debug_barrier()
            for jo in range(0, (NEXT_OUT + BN - 1) // BN):  # ∂δ_{i+1} += ∂m_i W_{i+1}
                cols = jo * BN + rn
                acc = _ld(ddl_b + NEXT_OFF, rows, cols, CHP, NEXT_OUT, OUT_T, DT)
                for ji in range(0, (HID + BK - 1) // BK):
                    kk = ji * BK + rk
                    acc += _mm(_ld(dm_b + OUT_OFF, rows, kk, CHP, HID, OUT_T, DT),
                               _ld(wb + NEXT_ST, kk, cols, HID, NEXT_OUT, NEXT_OUT, DT), PREC)
                _st(ddl_b + NEXT_OFF, acc, rows, cols, CHP, NEXT_OUT, OUT_T)
            tl.debug_barrier()
        # the loss: δ_L = g(e), e = M(k) − v, so ∂e = ∂δ_L ⊙ g'(e), ∂v = −∂e, ∂γ = Σ_j ∂δ_L ⊙ ∂g/∂γ
        LAST_OFF = (DEPTH - 1) * HID
        d_gamma = tl.zeros([CHP], DT)
        loss_p = tl.load(params_ptr + 2).to(DT)
        loss_eps = tl.load(params_ptr + 3).to(DT)
        for jo in range(0, (D_OUT + BN - 1) // BN):
            cols = jo * BN + rn
            ddl = _ld(ddl_b + LAST_OFF, rows, cols, CHP, D_OUT, OUT_T, DT)
            e = _ld(e_b, rows, cols, CHP, D_OUT, D_OUT, DT)
            d_out = tl.where(valid, ddl * _loss_grad_deriv(e, gamma[:, None], LOSS, loss_p, loss_eps), 0.0)
            _st(dp_b + LAST_OFF, d_out, rows, cols, CHP, D_OUT, OUT_T)
            _st(dv_ptr + tok * D_OUT, -d_out, rows, cols, n_valid, D_OUT, D_OUT)
            if GATED:
                d_gamma += tl.sum(ddl * _loss_gate_grad(e, gamma[:, None], LOSS), 1)
        if GATED:
            tl.store(dgate_ptr + tok + rows, d_gamma.to(dgate_ptr.dtype.element_ty), mask=vrows)
        tl.debug_barrier()
        # --- 5. the keys, last layer first: ∂W⁰ = β_n ∂W' + its rank-n terms, ∂a_i = ∂p_i W_iᵀ ------------------------
        for ii in range(DEPTH):
            i = DEPTH - 1 - ii
            W_IN = D_IN + (HID - D_IN) * (i > 0)
            W_OUT = HID + (D_OUT - HID) * (i == DEPTH - 1)
            IN_OFF = (i > 0) * (D_IN + (i - 1) * HID)
            OUT_OFF = i * HID
            PREV_OFF = (i > 0) * (i - 1) * HID
            ST = (i > 0) * (D_IN * HID + (i - 1) * HID * HID)
            ph_w = _factor(phi_at, True, 2 * i, DT)
            for ji in range(0, (W_IN + BK - 1) // BK):
                kk = ji * BK + rk
                # hᵀ (β ⊙ ∂r) + aᵀ ∂p as two products: paired, their inner dimension would be 2n, and a float32
                # product on the FMA units holds a row and a column of that length per thread (at n = 64, 256 registers)
                h_t = tl.trans(_ld(h_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT))
                a_t = tl.trans(_ld(a_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT))
                # ∂m_{i−1} (zeros for the first layer, which has none)
                dm_t = tl.trans(_ld(dm_b + PREV_OFF, rows, kk, CHP, W_IN * (i > 0), OUT_T, DT))
                acc = _ld(da_b + IN_OFF, rows, kk, CHP, W_IN, IN_T, DT)
                for jo in range(0, (W_OUT + BN - 1) // BN):
                    cols = jo * BN + rn
                    dp = _ld(dp_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT)
                    w = _ld(wb + ST, kk, cols, W_IN, W_OUT, W_OUT, DT)
                    acc += _mm(dp, tl.trans(w), PREC)
                    if i == DEPTH - 1:
                        dr = _ld(dy_ptr + tok * D_OUT, rows, cols, n_valid, D_OUT, D_OUT, DT)
                    else:
                        dr = _ld(dr_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT)
                    dwn = _ld(dwb + ST, kk, cols, W_IN, W_OUT, W_OUT, DT) * ph_w
                    if CHANNELS:  # β_n per column, β ⊙ ∂r from the scratch (∂β_n was taken with the update's)
                        beta_end = tl.load(nn_b + 6 * CHP * CHP + OUT_OFF + cols, mask=cols < W_OUT, other=0.0).to(DT)
                        dw0 = beta_end[None, :] * dwn + _mm(h_t, _ld(hw_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T,
                                                                     DT), PREC_STATE) + _mm(a_t, dp, PREC_STATE)
                    else:
                        d_beta_n += tl.sum(tl.sum(w * dwn, 1), 0)  # ∂β_n = Σ ⟨W⁰, ∂W'⟩
                        dw0 = beta_n * dwn + _mm(h_t, beta[:, None] * dr, PREC_STATE) + _mm(a_t, dp, PREC_STATE)
                    if i > 0:
                        dw0 += _mm(dm_t, _ld(dl_b + OUT_OFF, rows, cols, CHP, W_OUT, OUT_T, DT), PREC_STATE)
                    _st(dwb + ST, dw0, kk, cols, W_IN, W_OUT, W_OUT)
                if i > 0:
                    dp_prev = _ld(dp_b + PREV_OFF, rows, kk, CHP, W_IN, OUT_T, DT) \
                        + acc * _act_grad(_ld(p_b + PREV_OFF, rows, kk, CHP, W_IN, OUT_T, DT), ACT)
                    _st(dp_b + PREV_OFF, dp_prev, rows, kk, CHP, W_IN, OUT_T)
                else:
                    if RESIDUAL:
                        acc += _ld(dp_b + LAST_OFF, rows, kk, CHP, D_OUT, OUT_T, DT)
                    _st(dk_ptr + tok * D_IN, acc, rows, kk, n_valid, D_IN, D_IN)
            tl.debug_barrier()
        d_beta += tl.where(rows == last, d_beta_n, 0.0)
        d_c += tl.where(rows == last, d_c_n, 0.0)
        tl.store(dbeta_ptr + dec + rows, d_beta.to(dbeta_ptr.dtype.element_ty), mask=vrows)
        if CHANNELS:  # c's place holds e: its gradient, gathered by the layers
            tl.store(dc_ptr + dec + rows, d_e.to(dc_ptr.dtype.element_ty), mask=vrows)
        else:
            tl.store(dc_ptr + dec + rows, d_c.to(dc_ptr.dtype.element_ty), mask=vrows)


# --- the autograd function ---------------------------------------------------------------------------------------


def _channel_gates(eta: Tensor, alpha: Tensor, chunk_size: int) -> tuple[ChunkDecays, Tensor]:
    """α per channel (`alpha` [BH, seq, Σ d_out], every layer's columns side by side): η's decays as the kernels read
    them, `ChunkDecays(β=0, c=e, D=E, E_last, e_last)` padded like `_padded_decays` (β, c and D = B E are per column,
    formed in the kernels), and the log-keeps log(1 − α) (`decays.log_keep`). Differentiable, like
    `_padded_decays`."""
    parts = []
    for block in chunk_blocks(eta, chunk_size):
        E, e = momentum_decays(block)
        pad = chunk_size - block.shape[-1]
        parts.append(ChunkDecays(F.pad(torch.zeros_like(e), (0, pad)), F.pad(e, (0, pad)), F.pad(E, (0, pad, 0, pad)),
                                 F.pad(E[..., -1, :], (0, pad)), e[..., -1]))
    dec = ChunkDecays(*(torch.cat(p, dim=1).contiguous() for p in zip(*parts)))
    return dec, log_keep(alpha).contiguous()


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


class Launch(NamedTuple):
    """What a call's kernels are compiled for (constexprs and launch options) and the numbers they read at run
    time."""

    constexprs: dict
    options: dict  # the register ceiling (`Tiles.maxnreg`), where there is one
    params: Tensor  # [max_grad_norm, ρ, p, ε, δ] in the state's dtype
    radii: Tensor  # max_state_norm · √d_out of each layer


# The products' input precision: (PREC) those that read the state or the chunk's n × n algebra, (PREC_STATE) those
# that write the state or its gradient, whose rounding would build up from chunk to chunk. "ieee": float32 FMAs, no
# tensor cores; "tf32x3": three TF32 tensor-core products per product, about float32's accuracy; "tf32": the reads
# at TF32 (10-bit mantissa), the state's own update at tf32x3. A float64 state always runs "ieee".
PRECISIONS = {
    "ieee": dict(PREC="ieee", PREC_STATE="ieee"),
    "tf32x3": dict(PREC="tf32x3", PREC_STATE="tf32x3"),
    "tf32": dict(PREC="tf32", PREC_STATE="tf32x3"),
}
DEFAULT_PRECISION = "ieee"

# The inner losses the kernels compute (`losses.LOSSES` by name; `unsupported` refuses the others), and their codes.
LOSS_CODES = {"squared": 0, "huber": 1, "lp": 2}
LOSSES = tuple(LOSS_CODES)


def _loss_of(cfg: ScanConfig) -> tuple[int, float, float, float]:
    """(LOSS code, p, ε, δ) of the rule's inner loss (`cfg.rule.loss`, `losses.py`); a gated Huber's δ is the gate."""
    loss = cfg.rule.loss
    return (LOSS_CODES[loss.name], float(getattr(loss, "p", 2.0)), float(getattr(loss, "eps", 0.0)),
            float(getattr(loss, "delta", 1.0)))


def launch_of(cfg: ScanConfig, geo: Geometry, q: Tensor, state_dtype: torch.dtype, device, gated: bool,
              tiles: Optional[Tiles] = None, precision: str = "ieee", channels: bool = False) -> Launch:
    """The kernels' constexprs and run-time numbers for a call: the one place that turns the rule into them."""
    tiles = tiles or choose_tiles(geo, state_dtype, cfg.chunk_size, arch_of(device), channels)
    rule = cfg.rule
    code, p, eps, delta = _loss_of(cfg)
    dt = tl.float64 if state_dtype == torch.float64 else tl.float32
    constexprs = dict(
        D_IN=geo.d_in, HID=geo.hidden, D_OUT=geo.d_out, DEPTH=geo.depth, CH=cfg.chunk_size,
        CHP=_pow2(cfg.chunk_size), BK=tiles.BK, BN=tiles.BN, ACT=_ACTIVATION_CODES[rule.activation],
        RESIDUAL=rule.residual, GRAD_BOUND=rule.max_grad_norm is not None, STATE_BOUND=rule.max_state_norm is not None,
        NORMALIZE=rule.normalize_chunk, LOSS=code, GATED=gated, CHANNELS=channels,
        **PRECISIONS["ieee" if state_dtype == torch.float64 else precision], DT=dt, num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    values = [rule.max_grad_norm or 0.0, rule.hidden_step, p, eps, delta]
    radii = [(rule.max_state_norm or 0.0) * w ** 0.5 for _, w in geo.layer_shapes()]
    options = {"maxnreg": tiles.maxnreg} if tiles.maxnreg else {}
    return Launch(constexprs, options, _filled(values, state_dtype, device), _filled(radii, state_dtype, device))


def _filled(values: list[float], dtype: torch.dtype, device) -> Tensor:
    """The numbers as a tensor, filled on the device (torch.tensor(values, device=...) copies them from host memory,
    and on a GPU that copy is a host sync in every training step)."""
    out = torch.empty(len(values), dtype=dtype, device=device)
    for i, value in enumerate(values):
        out[i:i + 1].fill_(value)
    return out


def _pack(tensors: list[Tensor]) -> Tensor:
    """[BH, d_in, d_out] per layer → one [BH, Σ d_in d_out] (a fresh tensor the kernels update in place)."""
    return torch.cat([t.reshape(t.shape[0], -1) for t in tensors], dim=1).contiguous()


def _unpack(flat: Tensor, geo: Geometry) -> list[Tensor]:
    out, at = [], 0
    for a, b in geo.layer_shapes():
        out.append(flat[:, at:at + a * b].reshape(flat.shape[0], a, b).clone())
        at += a * b
    return out


def _scratch(geo: Geometry, bh: int, chp: int, like: Tensor, backward: bool = False) -> Tensor:
    """A program's per-chunk working memory, one row per batch·head, laid out as `_forward_parts` (and, for the
    backward kernel, `_backward_parts` after it) read it: the sizes here are theirs."""
    n_in, n_out, n_n = chp * geo.in_total, chp * geo.out_total, geo.depth * chp * chp
    row = 2 * n_in + 2 * n_out + chp * geo.d_out + 2 * n_n
    if backward:
        row += 8 * n_out + n_n + n_in + 6 * chp * chp + geo.out_total
    return like.new_zeros((bh, row))


class Gating(NamedTuple):
    """A call's gates as the kernels read them: θ, the loss's gate (θ again where the loss has none), the gate algebra
    (`_padded_decays`, or `_channel_gates` with α per channel) and the log-keeps (None for the scalar α)."""

    theta: Tensor
    gate: Tensor
    dec: ChunkDecays
    lk: Optional[Tensor]


def _run_forward(launch: Launch, q, k, v, gating: Gating, w, s, saved: Optional[list[Tensor]],
                 save_every: int, y, scales, scratch: Tensor, chunks: range) -> None:
    """The forward kernel over `chunks`, the state (w, s) updated in place."""
    bh, seq = q.shape[0], q.shape[1]
    dec = gating.dec
    _forward_kernel[(bh,)](
        q, k, v, gating.theta, gating.gate, *dec, gating.theta if gating.lk is None else gating.lk, launch.params,
        launch.radii, w, s, *(saved or (w, s)), y,
        launch.params if scales is None else scales, scratch, scratch.shape[1],
        bh, seq, dec.beta.shape[1], chunks.start, chunks.stop, save_every, **launch.constexprs,
        **launch.options)


class TritonChunk(torch.autograd.Function):
    """(q, k, v, θ, γ, η, α, W_1, S_1, …) -> (y, W_1', S_1', …), all `[BH, …]` contiguous: `fused.MemoryScan`'s
    contract (the same `ScanConfig`) with the loss's per-token gate γ (None where the loss has none), run by the
    kernels above. q, k, v may be bf16 or fp16; the rest is in the state's dtype. Recording for the backward pass,
    the forward keeps every chunk's starting state, or with recomputation groups only each group's, and the backward
    re-runs the forward over one group at a time."""

    @staticmethod
    def forward(ctx, cfg: ScanConfig, precision: str, tiles: Optional[Tiles], q, k, v, theta, gate, eta, alpha,
                *state):  # type: ignore[override]
        W, S = list(state[0::2]), list(state[1::2])
        geo = geometry_of(W)
        channels = alpha.dim() == 3  # α per channel: [BH, seq, Σ d_out]
        launch = launch_of(cfg, geo, q, W[0].dtype, q.device, gate is not None, tiles, precision, channels)
        chp = launch.constexprs["CHP"]
        bh = q.shape[0]
        num_chunks = -(-q.shape[1] // cfg.chunk_size)
        dec, lk = _channel_gates(eta, alpha, cfg.chunk_size) if channels else \
            (_padded_decays(eta, alpha, cfg.chunk_size), None)
        groups = _groups(num_chunks, cfg.group_chunks) if cfg.record else [range(num_chunks)]
        # One group: every chunk's starting state; several: each group's first.
        save_every = (1 if len(groups) == 1 else len(groups[0])) if cfg.record else 0
        w, s = _pack(W), _pack(S)
        saved = [w.new_empty((len(groups) if len(groups) > 1 else num_chunks, *w.shape)) for _ in range(2)] \
            if cfg.record else None
        y = q.new_empty(q.shape[:2] + (v.shape[2],))
        scales = w.new_ones(num_chunks, bh, 2 * geo.depth) if cfg.rule.max_state_norm is not None else None
        scratch = _scratch(geo, bh, chp, w)
        gate_arg = theta if gate is None else gate
        _run_forward(launch, q, k, v, Gating(theta, gate_arg, dec, lk), w, s, saved, save_every, y, scales, scratch,
                     range(num_chunks))
        if cfg.record:
            ctx.cfg, ctx.precision, ctx.tiles, ctx.geo = cfg, precision, tiles, geo
            ctx.scales, ctx.groups, ctx.gated, ctx.channels = scales, groups, gate is not None, channels
            # An output the loss does not use gets None in the backward pass, not a state-sized tensor of zeros.
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(q, k, v, theta, gate_arg, eta, alpha, *saved)
        end_w, end_s = _unpack(w, geo), _unpack(s, geo)
        return (y, *(t for pair in zip(end_w, end_s) for t in pair))

    @staticmethod
    def backward(ctx, dy, *d_final):  # type: ignore[override]
        refuse_double_backward("Triton")
        return TritonChunk._backward(ctx, dy, *d_final)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def _backward(ctx, dy, *d_final):
        cfg: ScanConfig = ctx.cfg
        geo: Geometry = ctx.geo
        q, k, v, theta, gate, eta, alpha, saved_w, saved_s = ctx.saved_tensors
        channels = ctx.channels
        launch = launch_of(cfg, geo, q, saved_w.dtype, q.device, ctx.gated, ctx.tiles, ctx.precision, channels)
        chp = launch.constexprs["CHP"]
        bh = q.shape[0]
        with torch.enable_grad():  # the gate algebra is differentiated by autograd, from this graph
            eta_, alpha_ = eta.detach().requires_grad_(), alpha.detach().requires_grad_()
            graph, lk = _channel_gates(eta_, alpha_, cfg.chunk_size) if channels else \
                (_padded_decays(eta_, alpha_, cfg.chunk_size), None)
        dec = ChunkDecays(*(x.detach() for x in graph))
        d_dec = ChunkDecays(*(torch.zeros_like(x) for x in dec))
        gating = Gating(theta, gate, dec, None if lk is None else lk.detach())
        d_lk = torch.zeros_like(gating.lk) if channels else d_dec.beta  # (a placeholder the kernel does not touch)
        shapes = geo.layer_shapes()

        def packed(grads):  # the incoming gradient of the end state, packed; zeros where the loss left it out
            return torch.cat([(torch.zeros(bh, a * b, dtype=saved_w.dtype, device=q.device) if g is None
                               else g.to(saved_w.dtype).reshape(bh, -1)) for g, (a, b) in zip(grads, shapes)],
                             dim=1).contiguous()

        d_state = torch.stack([packed(d_final[0::2]), packed(d_final[1::2])], 1)  # [BH, 2, TOT]: ∂W, ∂S
        dy = q.new_zeros(q.shape[:2] + (v.shape[2],)) if dy is None else dy.contiguous()
        d_q, d_k, d_v, d_theta = (torch.empty_like(t) for t in (q, k, v, theta))
        d_gate = torch.zeros_like(gate)
        scratch = _scratch(geo, bh, chp, saved_w[0], backward=True)
        groups = ctx.groups
        if len(groups) > 1:
            group_w = saved_w.new_empty((len(groups[0]), *saved_w.shape[1:]))
            group_s = torch.empty_like(group_w)
            scratch_y = torch.empty_like(dy)
        for g in range(len(groups) - 1, -1, -1):
            chunks = groups[g]
            starts = (saved_w, saved_s)
            if len(groups) > 1:  # recompute the group's chunk states from its saved first one
                w, s = saved_w[g].clone(), saved_s[g].clone()
                _run_forward(launch, q, k, v, gating, w, s, [group_w, group_s], 1, scratch_y, ctx.scales, scratch,
                             chunks)
                starts = (group_w, group_s)
            _backward_kernel[(bh,)](
                q, k, v, theta, gate, *dec, gating.theta if lk is None else gating.lk, launch.params, *starts, dy,
                d_state, d_q, d_k, d_v, d_theta, d_gate, *d_dec, d_lk,
                launch.params if ctx.scales is None else ctx.scales,
                scratch, scratch.shape[1], bh, q.shape[1], dec.beta.shape[1], chunks.start, chunks.stop,
                **launch.constexprs, **launch.options)
        if channels:  # (β is not one of the channel path's decays: its place holds zeros)
            d_eta, d_alpha = torch.autograd.grad([*graph[1:], lk], (eta_, alpha_), [*d_dec[1:], d_lk])
        else:
            d_eta, d_alpha = torch.autograd.grad(list(graph), (eta_, alpha_), list(d_dec))
        d_state = [t for pair in zip(_unpack(d_state[:, 0], geo), _unpack(d_state[:, 1], geo)) for t in pair]
        return (None, None, None, d_q, d_k, d_v, d_theta, d_gate if ctx.gated else None, d_eta, d_alpha, *d_state)


def precision() -> str:
    """The products' input precision (`PRECISIONS`): TITANS_TRITON_PRECISION where set, else DEFAULT_PRECISION."""
    name = os.environ.get("TITANS_TRITON_PRECISION", DEFAULT_PRECISION)
    if name not in PRECISIONS:
        raise ValueError(f"TITANS_TRITON_PRECISION={name!r}: the Triton kernels' precisions are {sorted(PRECISIONS)}")
    return name


class TritonScan:
    """`fused.MemoryScan`'s call contract (what `parallel._scan_memory` calls) for the Triton kernels."""

    @staticmethod
    def apply(cfg: ScanConfig, q, k, v, theta, eta, alpha, gate: Optional[Tensor], *state):
        return TritonChunk.apply(cfg, precision(), None, q, k, v, theta, gate, eta, alpha, *state)
