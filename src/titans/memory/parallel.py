"""Chunk-parallel memory update with exact per-token retrieval (DESIGN.md §2, the "dual form").

Inside a chunk of n tokens starting from weights W⁰ and momentum S⁰, unrolling eqs. 12-13 gives

    W_t = β_t W⁰ + c_t S⁰ − Σ_{s≤t} C[t,s] a_sᵀ δ_s

with E[t,s] = Π_{s<j≤t} η_j, B[t,r] = Π_{r<j≤t} (1 − α_j), β_t = Π_{j≤t} (1 − α_j), e_t = Π_{j≤t} η_j,
C = B (E diag θ) and c = B e. Every quantity is a matmul over the chunk: per-token weight
gradients `a_sᵀ δ_s` are never materialised. The retrieval of token t uses W_t itself (after its own
update), so chunk size 1 is exactly the sequential recurrence and larger chunks only change where
the gradients are taken (at W⁰, as the paper's mini-batch gradient descent prescribes).
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .checks import Alpha, Gates, Theta, check_memory_args, without_autocast
from .decays import Decays, channel_decays, chunk_decays, momentum_decays
from .fused import MemoryScan, ScanConfig
from .mlp import (
    ACTIVATIONS,
    Weights,
    backward_deltas,
    chunk_step_norm,
    forward_cached,
    grad_norm_scale,
    state_norm_scale,
    token_grad_sq_norm,
)
from .rule import MemoryRule, bounded_theta

DEFAULT_RULE = MemoryRule()

# `_chunk_step`'s signature: (state, q, k, v, θ, decays, rule, loss gate) -> (y, state after the chunk)
ChunkStep = Callable[..., tuple[Tensor, Weights]]


def _flat3(t: Tensor) -> Tensor:
    return t.reshape(-1, *t.shape[-2:])


def _chunk_step(
    WS: Weights,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    theta: Union[Tensor, Callable[[Tensor], Tensor]],
    decays: tuple[Decays, ...],
    rule: MemoryRule,
    gate: Optional[Tensor],
) -> tuple[Tensor, Weights]:
    """One chunk: outputs y_t = M(q_t; W_t) for every token, and the state after the chunk (bounded by
    `rule.max_state_norm`). What `implementation="compile"` compiles: tensors in, tensors out, the rule a constant of
    the call (a frozen pydantic model: dynamo guards on it). `gate` is the loss's per-token parameter `[b, h, n]`
    (None for a loss without one).

    The state of layer i is stacked as WS_i = [W_i; S_i] (`[b, h, 2 d_in, d_out]`) so that the two
    terms β_t h W⁰ + c_t h S⁰ are one matmul of [β h, c h] against WS, and the whole state update is
    one matmul plus one batched 2×2 mix. `theta` is the chunk's θ `[b, h, n]`, or a function of the chunk's surprise
    ℓ_t at W⁰ `[b, h, n]` that returns it (the surprise-gated θ). `decays` holds one `Decays` shared by every layer
    under the paper's scalar α, or one per layer with α per output column (`channel_decays`), whose retrieval
    and update scale each column by its own decay instead.
    """
    sigma = ACTIVATIONS[rule.activation][0]
    W0 = tuple(ws[..., : ws.shape[-2] // 2, :] for ws in WS)
    out, inputs, preacts = forward_cached(k, W0, rule)
    if not isinstance(theta, Tensor):  # surprise-gated θ: the loss ℓ_t at W⁰
        theta = theta(rule.loss.value(out - v, gate).sum(-1))
    deltas = backward_deltas(out, v, W0, preacts, rule, gate)
    if rule.max_grad_norm is not None:
        theta = theta * grad_norm_scale(token_grad_sq_norm(inputs, deltas), rule.max_grad_norm)
    E_theta = decays[0].E * theta.unsqueeze(-2)  # E[r,s] θ_s: momentum's part of C, shared by every layer
    momentum_coef = -(theta * decays[0].E[..., -1, :])
    norm = chunk_step_norm(inputs, deltas) if rule.normalize_chunk else None
    if norm is not None:  # token s's step in W_t times K[t,s]; the end state is row n
        momentum_coef = momentum_coef * norm[..., -1, :]
    if rule.hidden_step != 1.0:  # the hidden layers step ρ θ: their a_sᵀ δ_s terms scaled, after the bounds saw them
        deltas = [d * rule.hidden_step for d in deltas[:-1]] + [deltas[-1]]
    e_n = decays[0].e[..., -1]
    momentum_coef = momentum_coef.unsqueeze(-1)

    h = q
    depth = len(WS)
    WS_new = []
    for i in range(depth):
        dec, a = decays[i if len(decays) > 1 else 0], inputs[i]
        channels = dec.B.dim() > E_theta.dim()  # α per output column: β, c [.., d, n], B [.., d, n, n]
        if i == 0 or len(decays) > 1:  # the scalar α's layers share one C
            C = dec.B @ (E_theta.unsqueeze(-3) if channels else E_theta)  # C[t,s] = Σ_r B[t,r] E[r,s] θ_s
            if norm is not None:
                C = C * (norm.unsqueeze(-3) if channels else norm)
        # Retrieval (step 3): z_i = diag(β) h W⁰ + diag(c) h S⁰ − (C ⊙ h aᵀ) δ_i, each column with its own β, c, C
        # when α is per channel.
        if channels:
            w0, s0 = WS[i].chunk(2, dim=-2)
            z = dec.beta.transpose(-1, -2) * (h @ w0) + dec.c.transpose(-1, -2) * (h @ s0)
            z = z - torch.einsum("...cts,...ts,...sc->...tc", C, h @ a.transpose(-1, -2), deltas[i])
        else:
            scores = C * (h @ a.transpose(-1, -2))
            z = torch.cat([dec.beta.unsqueeze(-1) * h, dec.c.unsqueeze(-1) * h], dim=-1) @ WS[i]
            z = torch.baddbmm(_flat3(z), _flat3(scores), _flat3(deltas[i]), alpha=-1.0).view_as(z)
        # State after the chunk (step 4), the last row of the same matrices:
        #   W ← β_n W⁰ + c_n S⁰ − aᵀ diag(C[n,:]) δ      S ← e_n S⁰ − aᵀ diag(θ ⊙ E[n,:]) δ
        ws = WS[i]
        if channels:
            update_w = a.transpose(-1, -2) @ (-C[..., -1, :].transpose(-1, -2) * deltas[i])
            w_new = dec.beta[..., -1].unsqueeze(-2) * w0 + dec.c[..., -1].unsqueeze(-2) * s0 + update_w
            s_new = e_n[..., None, None] * s0 + (momentum_coef * a).transpose(-1, -2) @ deltas[i]
            WS_new.append(torch.cat([w_new, s_new], dim=-2))
        else:
            weight_coef = -C[..., -1, :].unsqueeze(-1)
            update = torch.cat([weight_coef * a, momentum_coef * a], dim=-1).transpose(-1, -2) @ deltas[i]
            mix = torch.stack([dec.beta[..., -1], dec.c[..., -1], torch.zeros_like(e_n), e_n], dim=-1).view(-1, 2, 2)
            flat = torch.baddbmm(update.reshape(mix.shape[0], 2, -1), mix, ws.reshape(mix.shape[0], 2, -1))
            WS_new.append(flat.view_as(ws))
        h = sigma(z) if i < depth - 1 else z
    y = q + h if rule.residual else h
    return y, _bound_state(tuple(WS_new), rule.max_state_norm)


def _bound_state(WS: Weights, max_state_norm: Optional[float]) -> Weights:
    """The bounded state: each W and S (stacked [W; S]) back on its ball ‖·‖_F ≤ max_state_norm · √d_out."""
    if max_state_norm is None:
        return WS
    bounded = []
    for ws in WS:
        w, s = ws.chunk(2, dim=-2)
        bounded.append(torch.cat([w * state_norm_scale(w, max_state_norm), s * state_norm_scale(s, max_state_norm)],
                                 dim=-2))
    return tuple(bounded)


class Tokens(NamedTuple):
    """A call's per-token inputs, `[batch, heads, seq, ...]` (`parallel_memory`'s arguments of the same names)."""

    q: Tensor
    k: Tensor
    v: Tensor
    theta: Theta
    eta: Tensor
    alpha: Alpha
    loss_gate: Optional[Tensor]

    def span(self, start: int, end: int) -> Tokens:
        """Tokens start..end (a callable θ sees every chunk's place in the whole sequence itself)."""
        sl = slice(start, end)
        return Tokens(*(t[:, :, sl] for t in self[:3]), self.theta[:, :, sl] if isinstance(self.theta, Tensor)
                      else self.theta, self.eta[:, :, sl], _alpha_slice(self.alpha, sl),
                      None if self.loss_gate is None else self.loss_gate[:, :, sl])


def _run_chunks(step: ChunkStep, WS: Weights, tokens: Tokens, offset: int, chunk_size: int,
                rule: MemoryRule) -> tuple[Tensor, Weights]:
    """Process `tokens` (a whole number of chunks, or one ragged chunk; the first at `offset` in the sequence) chunk
    after chunk, each through `step` (`_chunk_step`, or its compiled form)."""
    q, k, v, theta, eta, alpha, gate = tokens
    seq = k.shape[2]
    n = min(chunk_size, seq)
    chunks = seq // n

    def by_chunk(x: Tensor) -> Tensor:
        """[b, h, seq, ...] → [chunks, b, h, n, ...]: chunk j is one contiguous block whose strides do not depend on
        the sequence length (a compiled step's guards see the same tensors for every length)."""
        return x.unflatten(2, (chunks, n)).movedim(2, 0).contiguous()

    # Decays for all chunks at once: gates [chunks, b, h, n] (α per channel: [chunks, b, h, n, d] per layer).
    eta_chunks = by_chunk(eta)
    if isinstance(alpha, Tensor):
        layer_decays = (chunk_decays(eta_chunks, by_chunk(alpha)),)  # one, shared by every layer
    else:
        E, e = momentum_decays(eta_chunks)
        layer_decays = tuple(channel_decays(E, e, by_chunk(a)) for a in alpha)
    q_chunks, k_chunks, v_chunks = by_chunk(q), by_chunk(k), by_chunk(v)
    theta_chunks = by_chunk(theta) if isinstance(theta, Tensor) else None
    gate_chunks = by_chunk(gate) if gate is not None else None
    outputs = []
    for j in range(chunks):
        step_decays = tuple(Decays(*(x[j] for x in decays)) for decays in layer_decays)
        if theta_chunks is not None:
            step_theta = theta_chunks[j]
        else:  # the surprise-gated θ sees the chunk's place in the sequence
            start = offset + j * n
            step_theta = lambda surprise, start=start: theta(surprise, start, start + n)  # noqa: E731
        y, WS = step(WS, q_chunks[j], k_chunks[j], v_chunks[j], step_theta, step_decays, rule,
                     None if gate_chunks is None else gate_chunks[j])
        outputs.append(y)
    return torch.cat(outputs, dim=2), WS


def _alpha_slice(alpha: Alpha, sl: slice) -> Alpha:
    """Tokens `sl` of the forgetting gate, scalar `[b, h, seq]` or per channel (one `[b, h, seq, d]` per layer)."""
    return alpha[:, :, sl] if isinstance(alpha, Tensor) else tuple(a[:, :, sl] for a in alpha)


def _scan_memory(scan: type[torch.autograd.Function], tokens: Tokens, weights: Weights, momentum: Weights,
                 chunk_size: int, checkpoint_chunks: Optional[int],
                 rule: MemoryRule) -> tuple[Tensor, Weights, Weights]:
    """`parallel_memory` through `fused.MemoryScan` or `triton_chunk.TritonScan` (one contract: the rule in a
    `ScanConfig`, then q, k, v, θ, η, α, the loss's gate or None, and the state), which work on `[batch·heads, …]`
    contiguous tensors."""
    batch, heads = tokens.k.shape[:2]
    if not isinstance(tokens.alpha, Tensor):  # α per channel (the Triton scan): every layer's columns side by side
        tokens = tokens._replace(alpha=torch.cat(tokens.alpha, dim=-1))
    inputs = [None if t is None else t.reshape(batch * heads, *t.shape[2:]).contiguous() for t in tokens]
    state = [t.reshape(batch * heads, *t.shape[2:]).contiguous() for pair in zip(weights, momentum) for t in pair]
    record = torch.is_grad_enabled() and any(t.requires_grad for t in inputs + state if t is not None)
    cfg = ScanConfig(chunk_size, rule, checkpoint_chunks, record)
    y, *final = scan.apply(cfg, *inputs, *state)
    final = [t.view(batch, heads, *t.shape[1:]) for t in final]
    return y.view(batch, heads, *y.shape[1:]), tuple(final[0::2]), tuple(final[1::2])


IMPLEMENTATIONS = ("fused", "autograd", "triton", "compile")

# Graphs of the compiled chunk step one process may hold: one per (activation, residual, rule, shapes, dtype, device,
# grad mode) it has seen. Dynamo counts them per code object, all of them against one limit (8 by default), and with
# fullgraph=True reaching it is an error, not a fallback: a model whose layers differ, trained and evaluated at a few
# batch sizes, would reach 8.
COMPILED_GRAPHS = 64


@functools.lru_cache(maxsize=None)
def _triton_scan():
    """`triton_chunk` (the Triton kernels), or None where triton is not installed."""
    try:
        from . import triton_chunk
    except ImportError:
        return None
    return triton_chunk


@functools.lru_cache(maxsize=None)
def compile_unavailable(device_type: str) -> Optional[str]:
    """Why `torch.compile` (dynamo and inductor) cannot compile the chunk step for tensors on `device_type`, or None
    where it can: inductor writes C++ for CPU tensors (a compiler on PATH, $CXX or g++) and Triton for CUDA ones."""
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile is not supported on this Python/platform ({sys.version.split()[0]}, {sys.platform})"
    if device_type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception:  # InvalidCxxCompiler; its message is a paragraph on installing one
            return "inductor finds no C++ compiler for CPU code (set $CXX, or install g++)"
        return None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "inductor needs triton for CUDA tensors (pip install 'titans[gpu]')"
    return f"inductor does not compile for {device_type} tensors here"


@functools.lru_cache(maxsize=None)
def _compiled_chunk_step() -> ChunkStep:
    """`_chunk_step` through `torch.compile`: one graph, no breaks (fullgraph), static shapes. Dynamo's guards key its
    cache on everything the graph depends on (the constants activation, residual and rule, every tensor's shape,
    stride, dtype and device, the grad mode), so this one callable serves every configuration, each with its own
    graph; only the limit on how many is raised (COMPILED_GRAPHS), for the duration of the call."""
    compiled = torch.compile(_chunk_step, fullgraph=True, dynamic=False)

    @functools.wraps(_chunk_step)
    def step(*args):
        with torch._dynamo.config.patch(recompile_limit=COMPILED_GRAPHS):
            return compiled(*args)

    return step


def serving_implementation(implementation: Optional[str], q: Tensor, theta: Theta, alpha: Alpha,
                           weights: Weights, chunk_size: int = 16, rule: MemoryRule = DEFAULT_RULE) -> str:
    """Which implementation runs a `parallel_memory` call: the one place that decides.

    None picks "triton" where the kernels serve the call (CUDA tensors, triton installed, memory depth 1 to 4, chunks
    of at most 64 tokens, a loss they compute: `triton_chunk.unsupported`), else "fused"; "compile" runs only when
    asked for. A callable θ (evaluated per chunk on the chunk's surprise) and an empty sequence always take
    "autograd"; so does a channel-wise α wherever the Triton kernels do not run it (the fused scan and the compiled
    step take the scalar gate only). "triton" or "compile" asked for where it cannot serve the call is an error naming
    why, not a silent fallback."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if not isinstance(theta, Tensor) or q.shape[2] == 0:
        return "autograd"
    fallback = "fused" if isinstance(alpha, Tensor) else "autograd"  # where the kernels do not run the call
    if fallback == "autograd" and implementation not in (None, "triton"):
        return "autograd"
    if implementation == "compile" and (reason := compile_unavailable(q.device.type)) is not None:
        raise ValueError(f"implementation='compile' cannot serve this call: {reason}")
    if implementation == "triton":
        scan = _triton_scan()
        reason = ("triton is not installed (pip install 'titans[gpu]')" if scan is None
                  else scan.unsupported(q, weights, chunk_size, rule))
        if reason is not None:
            raise ValueError(f"implementation='triton' cannot serve this call: {reason}")
    if implementation is None:  # triton is imported only for CUDA tensors
        if not q.is_cuda:
            return fallback
        scan = _triton_scan()
        reason = "triton is not installed (pip install 'titans[gpu]')" if scan is None else \
            scan.unsupported(q, weights, chunk_size, rule)
        if reason is not None:
            _warn_fallback(reason)
            return fallback
        return "triton"
    return implementation


@functools.lru_cache(maxsize=None)
def _warn_fallback(reason: str) -> None:
    """One warning per reason (not per call: a model calls the memory once per layer and step) that a CUDA call runs
    the fused chunk loop, which on a GPU is Python driving small kernels, because the Triton kernels cannot serve it."""
    warnings.warn(f"the memory runs the fused chunk loop (with α per channel, the autograd one) on this CUDA call, "
                  f"much slower than the Triton kernels, which cannot serve it: {reason}", stacklevel=3)


@without_autocast
def parallel_memory(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: Gates,
    weights: Weights,
    momentum: Optional[Weights] = None,
    *,
    rule: MemoryRule = DEFAULT_RULE,
    chunk_size: int = 16,
    checkpoint_chunks: Optional[int] = None,
    implementation: Optional[str] = None,
) -> tuple[Tensor, Weights, Weights]:
    """Run the Titans memory over a sequence; return (y, weights after the last token, momentum).

    Args:
        q, k, v: `[batch, heads, seq, dim]` queries, keys, values (v may have another width without residual).
        gates: `Gates(theta, eta, alpha, loss_gate=None)`, the per-token gates of eqs. 13-14 (and the loss's):
        theta: inner learning rate θ_t `[batch, heads, seq]`, or a callable `(surprise [b, h, n], start, end)
            -> θ [b, h, n]` evaluated per chunk, where surprise is ℓ_t at the chunk's starting weights.
        eta: momentum decay η_t `[batch, heads, seq]` ("past surprise"), in [0, 1].
        alpha: forgetting α_t `[batch, heads, seq]`, in [0, 1]. The decays are computed in log space, so
            a gate of exactly η_t = 0 or α_t = 1 gets a zero gradient (values stay exact).
            Or α per channel: a tuple with one `[batch, heads, seq, d_out]` tensor per memory layer, layer i's
            output column j keeping (1 − α_t[i][j]) of its weights (the paper's later channel-wise forgetting; the
            Triton kernels and the autograd path serve it, the fused scan and the compiled step take the scalar gate
            only).
        weights: tuple of `[batch, heads, d_in, d_out]`, the memory MLP's layers at the start.
        momentum: same shapes; zeros when None.
        rule: the update (`MemoryRule`, DESIGN.md §1): the loss, activation, residual, the bounds (max_grad_norm on
            each token's step, max_state_norm on the state at every chunk end, max_momentum_step κ on θ where
            `rule.gates` is "data": θ_t ← min(θ_t, κ (1 − η_t))), the normalised chunk step and the hidden layers' step
            ρ. The default is the library's stable rule; `MemoryRule.paper()` is the paper's. Its fields that say how
            `NeuralMemory` makes the gates (momentum, forgetting, max_lr, init_*, ...) are not read here: the gates
            are the arguments above.
        chunk_size: tokens per chunk b; gradients of a chunk are all taken at its starting weights.
        checkpoint_chunks: when autograd is recording, recompute groups of this many chunks in the backward
            pass so memory holds one state per group instead of per chunk. None: no recomputation.
        implementation: "fused" (`fused.py`: hand-written backward, reused buffers; the C++ chunk loop on CPUs),
            "triton" (`triton_chunk.py`: the chunk loop inside Triton kernels, one program per batch·head walking its
            state in tiles; memory depth 1 to 4, chunks up to 64; bf16 or fp16 q/k/v read as such), "autograd"
            (this module's chunk loop under autograd: slower, but twice differentiable), or "compile" (the same loop
            with its chunk step through `torch.compile`, inductor's C++ on CPUs and Triton on CUDA: for where the
            Triton kernels are not wanted; compiles a graph per configuration and shape on first use, a ragged last
            chunk runs uncompiled; once differentiable). None (default): "triton" on CUDA where it serves the call,
            else "fused" (`serving_implementation`, the one place that decides; "compile" only when asked for). A
            callable θ always takes the autograd path, and a channel-wise α does where the kernels do not run it.
        loss_gate: the loss's per-token parameter `[batch, heads, seq]` where `rule.loss` takes one (`has_gate`:
            Huber's data-dependent δ_t, ≥ 0), else None. Differentiable like θ, η, α, through every implementation.

    A sequence whose length is not a multiple of `chunk_size` ends with a ragged chunk. The state is
    kept in the dtype of `weights` (use float32 there even when q/k/v are bf16).
    """
    momentum = check_memory_args(q, k, v, gates, weights, momentum, chunk_size, rule)
    theta, eta, alpha, loss_gate = gates
    if checkpoint_chunks is not None and (not isinstance(checkpoint_chunks, int) or checkpoint_chunks < 1):
        raise ValueError(f"checkpoint_chunks must be a positive integer or None, got {checkpoint_chunks!r}")
    implementation = serving_implementation(implementation, q, theta, alpha, weights, chunk_size, rule)
    out_dtype = q.dtype
    state_dtype = weights[0].dtype
    if isinstance(theta, Tensor):
        theta = theta.to(state_dtype)
    eta = eta.to(state_dtype)
    alpha = alpha.to(state_dtype) if isinstance(alpha, Tensor) else tuple(a.to(state_dtype) for a in alpha)
    loss_gate = None if loss_gate is None else loss_gate.to(state_dtype)
    theta = bounded_theta(rule, theta, eta)  # κ, before any chunk path
    if implementation == "triton":  # the kernels read bf16 q, k, v as they are and compute in the state's dtype
        tokens = Tokens(q, k, v, theta, eta, alpha, loss_gate)
        y, W, S = _scan_memory(_triton_scan().TritonScan, tokens, weights, momentum, chunk_size, checkpoint_chunks,
                               rule)
        return y.to(out_dtype), W, S
    q, k, v = (t.to(state_dtype) for t in (q, k, v))
    tokens = Tokens(q, k, v, theta, eta, alpha, loss_gate)
    if implementation == "fused":
        y, W, S = _scan_memory(MemoryScan, tokens, weights, momentum, chunk_size, checkpoint_chunks, rule)
        return y.to(out_dtype), W, S
    WS = tuple(torch.cat([w, s], dim=-2) for w, s in zip(weights, momentum))  # state stacked [W; S]

    seq = k.shape[2]
    full = (seq // chunk_size) * chunk_size
    group = (checkpoint_chunks or 0) * chunk_size
    use_checkpoint = group > 0 and torch.is_grad_enabled() and full > group
    # (start, end) pieces: groups of whole chunks (checkpointed when training), then the ragged tail.
    step = group if use_checkpoint else max(full, 1)
    pieces = [(s, min(s + step, full)) for s in range(0, full, step)]
    if full < seq:
        pieces.append((full, seq))

    def run(start: int, end: int, WS: Weights) -> tuple[Tensor, Weights]:
        # The ragged last chunk runs uncompiled: its length is the sequence length modulo chunk_size, so compiling it
        # would build a graph for every remainder a caller's lengths produce (static shapes), for one chunk per call.
        step = _compiled_chunk_step() if implementation == "compile" and end - start >= chunk_size else _chunk_step
        return _run_chunks(step, WS, tokens.span(start, end), start, chunk_size, rule)

    outputs = []
    for start, end in pieces:
        if use_checkpoint and end - start == group:
            y, WS = checkpoint(run, start, end, WS, use_reentrant=False)
        else:
            y, WS = run(start, end, WS)
        outputs.append(y)
    W = tuple(ws[..., : ws.shape[-2] // 2, :] for ws in WS)
    S = tuple(ws[..., ws.shape[-2] // 2 :, :] for ws in WS)
    y = torch.cat(outputs, dim=2) if outputs else q.new_zeros(q.shape[:3] + (v.shape[3],))
    return y.to(out_dtype), W, S
