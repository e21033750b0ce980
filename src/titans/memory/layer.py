"""`NeuralMemory`: the long-term memory as a sequence layer (paper §3.1, with the §4.4 projections).

    q_t = l2norm(SiLU(conv(x W_Q)))   k_t = l2norm(SiLU(conv(x W_K)))   v_t = l2norm(SiLU(conv(x W_V)))
    θ_t = max_lr · sigmoid(x̂_t w_θ + b_θ)   η_t = sigmoid(x̂_t w_η + b_η)   α_t = sigmoid(x̂_t w_α + b_α),  x̂ = x / rms(x)
    memory update and per-token retrieval: `parallel_memory` (DESIGN.md §2), each token's step bounded and the
        state kept in its ball at every chunk end
    output = W_o (RMSNorm(y) ⊙ SiLU(x W_g))

The normalised v and x̂, the two bounds, the normalised chunk step and the bounded momentum gain are the library's
default rule, not the paper's (DESIGN.md §1, "Stable by default"; `normalize_inputs=False, max_grad_norm=None,
max_state_norm=None, normalize_chunk=False, max_momentum_step=None` is the paper's). All projections, gates, convs
and the initial memory weights W_0 are ordinary parameters trained by the outer loop through the inner updates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Literal, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers.conv import CausalDepthwiseConv, causal_depthwise_conv
from ..layers.state import check_state_shapes, check_state_type, states_trusted
from .checks import Alpha
from .delta import delta_rule_memory
from .mlp import ACTIVATIONS, Weights, memory_apply
from .parallel import IMPLEMENTATIONS, parallel_memory
from .step import memory_token_step


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


@dataclasses.dataclass
class MemoryState:
    """Everything needed to continue a stream; constant size in the sequence length.

    `weights`/`momentum` are the memory at the start of the current chunk; the tokens of that chunk
    seen so far (fewer than `chunk_size`) wait in the `pending_*` tensors so the next call takes their
    gradients at the same weights the one-call path would (their outputs were already returned).
    """

    weights: Weights  # [batch, heads, d_in, d_out] per memory layer, float32 (or float64)
    momentum: Weights  # S, same shapes
    conv_cache: Tensor  # last conv_kernel − 1 projected inputs [batch, kernel − 1, 3 · dim]
    pending_k: Tensor  # [batch, heads, p, head_dim], p < chunk_size
    pending_v: Tensor  # [batch, heads, p, head_dim]
    pending_gates: Tensor  # θ, η, α logits of the pending tokens [batch, heads, p, 3]
    seq_pos: int = 0  # tokens consumed so far

    @property
    def num_pending(self) -> int:
        return self.pending_k.shape[2]


class NeuralMemory(nn.Module):
    """Neural long-term memory layer: `forward(x [B, T, dim], state=None) -> (y [B, T, dim], state)`.

    Args:
        dim: model width; split into `heads` memories of width dim // heads.
        depth: layers of the memory MLP (1 = matrix memory).
        expansion: hidden width of the memory MLP as a multiple of the head width.
        chunk_size: tokens whose gradients share the chunk's starting weights (paper §3.2).
        max_lr: θ_max, the bound on the inner learning rate.
        activation: σ inside the memory MLP ("gelu" or "silu").
        momentum: False sets η = 0 (no past surprise); with depth=1, residual=False, gradients="token" this is
            Gated DeltaNet.
        forgetting: False sets α = 0 (no forgetting: the paper's "w/o weight decay" ablation).
        forgetting_channels: α per channel (the paper's later version): every memory layer's output columns forget
            at their own data-dependent rate, W_i ← W_i diag(1 − α_t,i) + S_i, instead of one α_t per token and head.
            Served by the autograd chunk path (the fused kernels take the scalar gate).
        gates: "data" (θ_t, η_t, α_t from x_t, the paper's data-dependent gates) or "constant" (θ, η, α fixed at
            init_theta, init_eta, init_alpha and not trained, the proof-of-concept's ablation).
        residual: M(x) = x + MLP(x) (not in the paper; it cost recall, DESIGN.md §1); False (default): the paper's
            M(x) = MLP(x), with depth=1 its linear memory M(x) = x W.
        conv_kernel: width of the causal depthwise convs on q, k, v.
        gate_pooling: "token" (per-token θ, η, α) or "chunk" (each chunk uses its first token's gates,
            constant within the chunk and known when the chunk starts, so still causal).
        surprise_gate: θ_t = max_lr · sigmoid(x_t w_θ + b_θ + w_s log(1 + surprise_t)), surprise_t being the
            memory's reconstruction error ‖M(k_t) − v_t‖² at the chunk's starting weights.
        init_theta: θ at initialisation (default 0.2 max_lr).
        init_eta: momentum η at initialisation.
        init_alpha: forgetting α at initialisation (the gate's bias is logit(init_alpha)); the memory keeps
            about (1 − α)^n of what it wrote n tokens ago, so long contexts want a small value.
        normalize_inputs: the inner loop's inputs carry no scale: values l2-normalised like the queries and keys,
            gates read from the RMS-normalised x (not in the paper, whose values and gates take x as it comes).
        max_state_norm: the bounded state: W_i and S_i back on ‖·‖_F ≤ max_state_norm · √d_out at every chunk end
            (see `parallel_memory`); None: unbounded, as in the paper.
        max_grad_norm: bound on each token's inner gradient norm (θ_t scaled by min(1, c / ‖∇ℓ_t‖), see
            `parallel_memory`); None: the paper's unbounded step.
        normalize_chunk: the normalised chunk step: tokens of a chunk whose gradients overlap share one step instead
            of each taking its own (see `parallel_memory`); False: the paper's sum of the chunk's gradients.
        hidden_step: ρ, the inner step of every memory layer but the last as a fraction of θ (see
            `parallel_memory`); 1 is the paper's rule, 0 keeps the hidden layers at their learned W_0 at test time.
        max_momentum_step: κ, a bound on the momentum's gain: θ_t ≤ κ (1 − η_t). Eqs. 13-14 are a heavy ball, and
            once the surprise has built up a token's gradient moves the memory about θ_t / (1 − η_t); a memory whose
            gates learn a large θ and an η near 1 together overshoots and rings, bounded forward by the state's
            ball but expansive backward (DESIGN.md §1, the backward's open item). It binds only where both gates
            are high, and acts on θ before any chunk path, so every implementation and the token-by-token
            reference see the same θ. Default κ = 1 (it cost nothing measured and removed `lm`'s one spike); None:
            the paper's free gates. Constant gates (`gates="constant"`) are the numbers given and are not bounded.
        learned_init: the memory's initial weights W_0 are parameters of the outer loop (default; the paper is
            silent); False leaves them as initialised (last layer 0), so a read returns only what was written.
        gradients: where each token's inner gradient is taken: "chunk" (at its chunk's starting weights, the
            paper's parallelisable mini-batch form) or "token" (at the weights the previous token left: exact
            online gradient descent, the gated delta rule; needs depth=1, momentum=False, no surprise gate
            and none of max_grad_norm, max_state_norm, normalize_chunk; chunk_size then sets only the cost, see
            `delta.py`).
        checkpoint_chunks: chunks per recomputation group in training. None (default) chooses: every
            chunk's state is kept up to 64 chunks, beyond that groups of ⌈√chunks⌉ chunks are recomputed in the
            backward pass, so training holds O(√T) states instead of one per chunk; 0 disables it.
        implementation: which `parallel_memory` implementation runs the chunk loop ("fused", "triton", "autograd",
            "compile"); None (default): `parallel.serving_implementation` decides ("triton" on CUDA where it serves
            the call, else "fused"; "compile" only when asked for). Numbers only, not the model: every
            implementation computes the same rule.
    """

    def __init__(
        self,
        dim: int,
        heads: int = 1,
        depth: int = 2,
        expansion: int = 4,
        chunk_size: int = 16,
        max_lr: float = 1.0,
        activation: str = "gelu",
        momentum: bool = True,
        forgetting: bool = True,
        forgetting_channels: bool = False,
        gates: Literal["data", "constant"] = "data",
        residual: bool = False,
        conv_kernel: int = 4,
        gate_pooling: Literal["token", "chunk"] = "token",
        surprise_gate: bool = False,
        checkpoint_chunks: Optional[int] = None,
        init_theta: Optional[float] = None,
        init_eta: float = 0.1,
        init_alpha: float = 1e-5,
        max_grad_norm: Optional[float] = 4.0,
        gradients: Literal["chunk", "token"] = "chunk",
        normalize_inputs: bool = True,
        max_state_norm: Optional[float] = 10.0,
        normalize_chunk: bool = True,
        hidden_step: float = 1.0,
        max_momentum_step: Optional[float] = 1.0,
        learned_init: bool = True,
        implementation: Optional[str] = None,
    ):
        super().__init__()
        if implementation is not None and implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
        if dim < 1 or heads < 1 or dim % heads:
            raise ValueError(f"dim ({dim}) must be a positive multiple of heads ({heads})")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if expansion < 1:
            raise ValueError(f"expansion must be >= 1, got {expansion}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if not max_lr > 0:
            raise ValueError(f"max_lr must be > 0, got {max_lr}")
        if not 0 < init_alpha < 1:
            raise ValueError(f"init_alpha must be in (0, 1), got {init_alpha}")
        if not 0 < init_eta < 1:
            raise ValueError(f"init_eta must be in (0, 1), got {init_eta}")
        init_theta = 0.2 * max_lr if init_theta is None else init_theta
        if not 0 < init_theta < max_lr:
            raise ValueError(f"init_theta must be in (0, max_lr = {max_lr}), got {init_theta}")
        if max_grad_norm is not None and not 0 < max_grad_norm < float("inf"):
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if gate_pooling not in ("token", "chunk"):
            raise ValueError(f"gate_pooling must be 'token' or 'chunk', got {gate_pooling!r}")
        if not 0 <= hidden_step <= 1:
            raise ValueError(f"hidden_step must be in [0, 1], got {hidden_step}")
        if max_momentum_step is not None and not 0 < max_momentum_step < float("inf"):
            raise ValueError(f"max_momentum_step must be a positive finite number or None, got {max_momentum_step}")
        if gates not in ("data", "constant"):
            raise ValueError(f"gates must be 'data' or 'constant', got {gates!r}")
        if gates == "constant" and surprise_gate:
            raise ValueError("gates='constant' fixes θ, so it cannot be combined with surprise_gate=True")
        if gradients not in ("chunk", "token"):
            raise ValueError(f"gradients must be 'chunk' or 'token', got {gradients!r}")
        if max_state_norm is not None and not 0 < max_state_norm < float("inf"):
            raise ValueError(f"max_state_norm must be a positive finite number or None, got {max_state_norm}")
        if gradients == "token" and (depth != 1 or momentum or surprise_gate or max_grad_norm is not None
                                     or max_state_norm is not None or normalize_chunk or forgetting_channels):
            raise ValueError("gradients='token' (the exact delta rule) needs depth=1, momentum=False, "
                             "surprise_gate=False, max_grad_norm=None, max_state_norm=None, normalize_chunk=False and "
                             f"forgetting_channels=False, got depth={depth}, momentum={momentum}, "
                             f"surprise_gate={surprise_gate}, max_grad_norm={max_grad_norm}, "
                             f"max_state_norm={max_state_norm}, normalize_chunk={normalize_chunk}, "
                             f"forgetting_channels={forgetting_channels}")
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.depth, self.chunk_size, self.max_lr = depth, chunk_size, max_lr
        self.activation, self.use_momentum, self.residual = activation, momentum, residual
        self.forgetting, self.gates, self.hidden_step = forgetting, gates, hidden_step
        self.max_momentum_step = max_momentum_step if gates == "data" else None
        # κ's record over training forwards: how many learned θ_t it lowered, of how many (`momentum_bound_record`)
        self.bound_lowered: Union[Tensor, int] = 0
        self.bound_gates = 0
        self.forgetting_channels = forgetting_channels
        self.gate_pooling, self.surprise_gate, self.checkpoint_chunks = gate_pooling, surprise_gate, checkpoint_chunks
        self.implementation = implementation
        self.max_grad_norm, self.max_state_norm = max_grad_norm, max_state_norm
        self.gradients, self.normalize_inputs, self.normalize_chunk = gradients, normalize_inputs, normalize_chunk

        hidden = self.head_dim * expansion
        widths = [self.head_dim] + [hidden] * (depth - 1) + [self.head_dim]
        # α per channel: one gate per output column of every layer, after θ and η
        self.alpha_widths = tuple(widths[1:]) if forgetting_channels else (1,)
        self.gates_per_head = 2 + sum(self.alpha_widths)  # θ, η, then α

        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)  # W_Q, W_K, W_V
        self.conv = CausalDepthwiseConv(3 * dim, conv_kernel)
        self.init_gates = (init_theta, init_eta, init_alpha)
        init_logits = self.initial_gate_logits()
        if gates == "data":  # the outer loop tunes the bias and the weights from x
            self.to_gates = nn.Linear(dim, self.gates_per_head * heads)
            with torch.no_grad():
                self.to_gates.weight.mul_(0.1)
                self.to_gates.bias.copy_(init_logits)  # rounded to the bias's dtype
        else:  # constant: the same logits for every token, not parameters (float64, so θ, η, α are the constants)
            self.to_gates = None
            self.register_buffer("constant_gate_logits", init_logits, persistent=False)
        self.surprise_weight = nn.Parameter(torch.zeros(heads)) if surprise_gate else None

        # W_0: the last layer starts at zero, so the memory starts as M(x) = 0 (x with the residual) and reads back only
        # what it has written. With a random last layer a deep memory adds a fixed random function to every read, and at
        # our scale it did not learn recall at all (DESIGN.md §1, "Initialisation"); the earlier layers are random, or
        # the last layer would receive no inner gradient (∂ℓ/∂W_L = σ(a W)ᵀ δ).
        self.initial_weights = nn.ParameterList(
            nn.Parameter(torch.randn(heads, d_in, d_out) / math.sqrt(d_in) if i < depth - 1
                         else torch.zeros(heads, d_in, d_out))
            for i, (d_in, d_out) in enumerate(zip(widths, widths[1:]))
        )
        # learned_init=False: W_0 stays as initialised. Trained, W_0 can turn a read of the memory into a learned
        # function of the query alone, a shortcut that MAC took instead of recalling across segments (DESIGN.md §1).
        self.initial_weights.requires_grad_(learned_init)
        self.out_norm_weight = nn.Parameter(torch.ones(heads, 1, self.head_dim))
        self.to_out_gate = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def initial_gate_logits(self) -> Tensor:
        """Logits of θ, η, α per head at init (float64): every gate starts at its init_* value, the bias being its
        logit; constant gates keep them. Also what a loader that leaves buffers empty (Hugging Face) refills."""
        theta, eta, alpha = self.init_gates
        alphas = [logit(alpha)] * sum(self.alpha_widths)
        return torch.tensor([logit(theta / self.max_lr), logit(eta), *alphas],
                            dtype=torch.float64).repeat_interleave(self.heads)

    # ----------------------------------------------------------------------------------------- state
    def _state_dtype(self) -> torch.dtype:
        dtype = self.initial_weights[0].dtype
        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype  # states stay float32

    def init_state(self, batch_size: int, device: Optional[torch.device] = None) -> MemoryState:
        device = device or self.initial_weights[0].device
        dtype = self._state_dtype()
        weights = tuple(w.to(device, dtype).unsqueeze(0).expand(batch_size, -1, -1, -1) for w in self.initial_weights)
        empty = torch.zeros(batch_size, self.heads, 0, self.head_dim, device=device, dtype=dtype)
        return MemoryState(
            weights=weights,
            momentum=tuple(torch.zeros_like(w) for w in weights),
            conv_cache=torch.zeros(batch_size, self.conv.kernel - 1, 3 * self.dim, device=device, dtype=dtype),
            pending_k=empty,
            pending_v=empty,
            pending_gates=torch.zeros(batch_size, self.heads, 0, self.gates_per_head, device=device, dtype=dtype),
        )

    def _check_state(self, state: MemoryState, batch: int) -> None:
        """A state this memory could have returned for a batch of `batch` streams (see layers/state.py)."""
        if states_trusted():
            return
        check_state_type("NeuralMemory", state, MemoryState)
        if len(state.weights) != len(self.initial_weights) or len(state.momentum) != len(self.initial_weights):
            raise ValueError(f"NeuralMemory: state holds {len(state.weights)} weight and {len(state.momentum)} "
                             f"momentum layers, this memory has {len(self.initial_weights)} (a state from another "
                             "memory depth?)")
        shapes = {}
        for i, w in enumerate(self.initial_weights):
            shapes[f"weights[{i}]"] = (state.weights[i], (batch, *w.shape))
            shapes[f"momentum[{i}]"] = (state.momentum[i], (batch, *w.shape))
        p = state.pending_k.shape[2] if state.pending_k.dim() == 4 else None
        shapes.update(
            conv_cache=(state.conv_cache, (batch, self.conv.kernel - 1, 3 * self.dim)),
            pending_k=(state.pending_k, (batch, self.heads, None, self.head_dim)),
            pending_v=(state.pending_v, (batch, self.heads, p, self.head_dim)),
            pending_gates=(state.pending_gates, (batch, self.heads, p, self.gates_per_head)),
        )
        check_state_shapes("NeuralMemory", shapes)
        if state.num_pending >= self.chunk_size:
            raise ValueError(f"NeuralMemory: state holds {state.num_pending} pending tokens, but a chunk of "
                             f"{self.chunk_size} completes at {self.chunk_size} (a state from another chunk size?)")
        dtype = self._state_dtype()
        if state.weights[0].dtype != dtype:
            raise ValueError(f"NeuralMemory: state holds {state.weights[0].dtype} weights but this memory keeps its "
                             f"state in {dtype} (a state from a model of another dtype?)")

    # ---------------------------------------------------------------------------------- projections
    def _split_heads(self, t: Tensor) -> Tensor:
        return t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)  # [B, T, D] -> [B, H, T, d]

    def _queries(self, proj_q: Tensor) -> Tensor:
        return F.normalize(self._split_heads(F.silu(proj_q)), dim=-1)

    def _gate_logits(self, x: Tensor) -> Tensor:
        """Logits of θ, η, α for every token, [B, T, gates_per_head · heads] (3 per head with a scalar α)."""
        if self.to_gates is None:
            return self.constant_gate_logits.expand(*x.shape[:2], -1)
        return self.to_gates(F.rms_norm(x, (self.dim,)) if self.normalize_inputs else x)

    def _gate_values(self, logits: Tensor) -> tuple[Union[Tensor, Callable], Tensor, Alpha]:
        """θ, η, α from logits [B, H, n, gates_per_head] that start at a chunk boundary (α per channel: one
        [B, H, n, d_out] per memory layer)."""
        if self.gate_pooling == "chunk":
            n = logits.shape[2]
            first = torch.arange(n, device=logits.device) // self.chunk_size * self.chunk_size
            logits = logits[:, :, first]
        theta_logit, eta_logit = logits[..., 0], logits[..., 1]
        eta = torch.sigmoid(eta_logit) if self.use_momentum else torch.zeros_like(eta_logit)
        alpha = torch.sigmoid(logits[..., 2:]) if self.forgetting else torch.zeros_like(logits[..., 2:])
        alpha = alpha.split(self.alpha_widths, dim=-1) if self.forgetting_channels else alpha[..., 0]
        bound = None if self.max_momentum_step is None else self.max_momentum_step * (1 - eta)
        if self.surprise_weight is None:
            return self._bounded_theta(self.max_lr * torch.sigmoid(theta_logit), bound), eta, alpha
        weight = self.surprise_weight.view(1, -1, 1)

        def theta(surprise: Tensor, start: int, end: int) -> Tensor:
            value = self.max_lr * torch.sigmoid(theta_logit[:, :, start:end] + weight * torch.log1p(surprise))
            return self._bounded_theta(value, None if bound is None else bound[:, :, start:end])

        return theta, eta, alpha

    def _bounded_theta(self, theta: Tensor, bound: Optional[Tensor]) -> Tensor:
        """θ_t under the bound on the momentum's gain, min(θ_t, κ (1 − η_t)) (`max_momentum_step`), counted in
        training so that a run shows where the bound acted (read on the device, no host sync here)."""
        if bound is None:
            return theta
        if self.training:
            lowered = theta.detach() > bound.detach()
            self.bound_lowered = self.bound_lowered + lowered.sum()
            self.bound_gates += lowered.numel()
        return torch.minimum(theta, bound)

    def momentum_bound_record(self) -> tuple[int, int]:
        """(the learned θ_t that κ lowered, the learned θ_t it bounded) over this memory's training forwards."""
        return int(self.bound_lowered), self.bound_gates

    def _output(self, y: Tensor, x: Tensor) -> Tensor:
        """W_o (RMSNorm(y) ⊙ SiLU(x W_g)), y per head [B, H, T, d]."""
        y = F.rms_norm(y.to(x.dtype), (self.head_dim,)) * self.out_norm_weight
        y = y.transpose(1, 2).flatten(2)
        return self.to_out(y * F.silu(self.to_out_gate(x)))

    def _checkpoint_group(self, seq: int) -> Optional[int]:
        if self.checkpoint_chunks is not None:
            return self.checkpoint_chunks or None
        chunks = seq // self.chunk_size
        return math.isqrt(chunks - 1) + 1 if chunks > 64 else None

    # torch.compile of a model leaves the memory's update to eager: its fused path calls the C++ chunk kernels (not
    # traceable) from a custom autograd Function, and its checks and state bound read values on the host. The graph
    # breaks here, once per call, on purpose (the projections, gates and output around it are compiled).
    @torch.compiler.disable
    def _memory(self, q, k, v, gates, weights, momentum) -> tuple[Tensor, Weights, Weights]:
        theta, eta, alpha = self._gate_values(gates)
        if self.gradients == "token":  # no momentum: η is unused and the momentum state stays zero
            y, weights = delta_rule_memory(q, k, v, theta, alpha, weights, self.chunk_size, self.residual)
            return y, weights, momentum
        return parallel_memory(
            q, k, v, theta, eta, alpha, weights, momentum,
            chunk_size=self.chunk_size, activation=self.activation, residual=self.residual,
            checkpoint_chunks=self._checkpoint_group(k.shape[2]), max_grad_norm=self.max_grad_norm,
            max_state_norm=self.max_state_norm, normalize_chunk=self.normalize_chunk, hidden_step=self.hidden_step,
            implementation=self.implementation,
        )

    # -------------------------------------------------------------------------------------- forward
    def forward(self, x: Tensor, state: Optional[MemoryState] = None) -> tuple[Tensor, MemoryState]:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be [batch, seq, {self.dim}], got shape {tuple(x.shape)}")
        batch, seq, _ = x.shape
        if state is None:
            state = self.init_state(batch, x.device)
        self._check_state(state, batch)
        dtype = self._state_dtype()
        proj, conv_cache = self.conv(self.to_qkv(x), state.conv_cache)
        proj_q, proj_k, proj_v = proj.to(dtype).chunk(3, dim=-1)
        q = self._queries(proj_q)
        k = F.normalize(self._split_heads(F.silu(proj_k)), dim=-1)
        v = self._split_heads(F.silu(proj_v))
        if self.normalize_inputs:  # the inner loop sees no scale: unit values like the keys, gates from unit-RMS x
            v = F.normalize(v, dim=-1)
        gates = self._gate_logits(x).to(dtype).unflatten(-1, (self.gates_per_head, self.heads)).permute(0, 3, 1, 2)

        # generation: one token a step (the one-token step takes the scalar α; a channel-wise α takes the chunk path)
        if seq == 1 and self.gradients == "chunk" and not self.forgetting_channels and not torch.is_grad_enabled():
            y, new_state = self._token_step(q, k, v, gates, state, conv_cache.to(dtype))
            return self._output(y, x), new_state

        # Continue the unfinished chunk: its pending tokens go first (their outputs are discarded),
        # so every chunk's gradients are taken at the weights it started with, as in one call.
        p = state.num_pending
        if p:  # (without pending tokens the concatenations would only copy: ~1% of a training step)
            k = torch.cat([state.pending_k, k], dim=2)
            v = torch.cat([state.pending_v, v], dim=2)
            gates = torch.cat([state.pending_gates, gates], dim=2)
            q = torch.cat([q.new_zeros(batch, self.heads, p, self.head_dim), q], dim=2)
        total = p + seq
        full = total // self.chunk_size * self.chunk_size
        W, S = state.weights, state.momentum
        outputs = []
        if full:
            y, W, S = self._memory(q[:, :, :full], k[:, :, :full], v[:, :, :full], gates[:, :, :full], W, S)
            outputs.append(y)
        if full < total:  # the new unfinished chunk: outputs now, gradients again when it completes
            tail = slice(full, total)
            y, _, _ = self._memory(q[:, :, tail], k[:, :, tail], v[:, :, tail], gates[:, :, tail], W, S)
            outputs.append(y)
        if not outputs:  # nothing pending, nothing new
            y = v[:, :, :0]
        else:
            y = (torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0])[:, :, p:]
        new_state = MemoryState(
            weights=W,
            momentum=S,
            conv_cache=conv_cache.to(dtype),
            # copies of fewer than chunk_size tokens, so the state does not keep this call's projections alive
            pending_k=k[:, :, full:].clone(),
            pending_v=v[:, :, full:].clone(),
            pending_gates=gates[:, :, full:].clone(),
            seq_pos=state.seq_pos + seq,
        )
        return self._output(y, x), new_state

    def _token_step(self, q: Tensor, k: Tensor, v: Tensor, gates: Tensor, state: MemoryState, conv_cache: Tensor
                    ) -> tuple[Tensor, MemoryState]:
        """One token through `memory_token_step` (no autograd): the same outputs and state as `_memory` over the
        pending tokens and this one (tests/memory/test_step.py), without the chunk path's machinery."""
        if state.num_pending:
            k, v, gates = (torch.cat([held, new], dim=2) for held, new in
                           ((state.pending_k, k), (state.pending_v, v), (state.pending_gates, gates)))
        theta, eta, alpha = self._gate_values(gates)
        chunk_end = k.shape[2] == self.chunk_size
        y, W, S = memory_token_step(
            q, k, v, theta, eta, alpha, state.weights, state.momentum, chunk_end, activation=self.activation,
            residual=self.residual, max_grad_norm=self.max_grad_norm, max_state_norm=self.max_state_norm,
            normalize_chunk=self.normalize_chunk, hidden_step=self.hidden_step,
        )
        keep = 0 if chunk_end else k.shape[2]  # a completed chunk leaves nothing pending
        return y, MemoryState(W, S, conv_cache, k[:, :, :keep], v[:, :, :keep], gates[:, :, :keep], state.seq_pos + 1)

    def current_weights(self, state: MemoryState) -> Weights:
        """The memory as it stands after the last consumed token (pending tokens applied)."""
        if state.num_pending == 0:
            return state.weights
        q = torch.zeros_like(state.pending_k)
        _, W, _ = self._memory(q, state.pending_k, state.pending_v, state.pending_gates, state.weights, state.momentum)
        return W

    def retrieve(
        self, x: Tensor, state: Optional[MemoryState] = None, query_cache: Optional[Tensor] = None
    ) -> tuple[Tensor, Tensor]:
        """Read-only retrieval h_t = M(q_t) from the memory as it stands in `state` (paper eq. 15).

        q comes from x through this memory's W_Q and causal conv; `query_cache` is that conv's cache for
        the x stream (separate from the update stream's cache in `state`). Returns (h [B, T, dim], cache).
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be [batch, seq, {self.dim}], got shape {tuple(x.shape)}")
        if state is None:
            state = self.init_state(x.shape[0], x.device)
        self._check_state(state, x.shape[0])
        if query_cache is not None:
            check_state_shapes("NeuralMemory.retrieve", {
                "query_cache": (query_cache, (x.shape[0], self.conv.kernel - 1, self.dim))})
        dim = self.dim
        proj_q = F.linear(x, self.to_qkv.weight[:dim])
        proj_q, query_cache = causal_depthwise_conv(proj_q, self.conv.weight[:dim], self.conv.bias[:dim], query_cache)
        q = self._queries(proj_q.to(self._state_dtype()))
        h = memory_apply(q, self.current_weights(state), self.activation, self.residual)
        return self._output(h, x), query_cache
