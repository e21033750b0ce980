"""`NeuralMemory`: the long-term memory as a sequence layer (paper §3.1, with the §4.4 projections).

    q_t = l2norm(SiLU(conv(x W_Q)))   k_t = l2norm(SiLU(conv(x W_K)))   v_t = l2norm(SiLU(conv(x W_V)))
    θ_t = max_lr · sigmoid(x̂_t w_θ + b_θ)   η_t = sigmoid(x̂_t w_η + b_η)   α_t = sigmoid(x̂_t w_α + b_α),  x̂ = x / rms(x)
    memory update and per-token retrieval: `parallel_memory` (DESIGN.md §2), each token's step bounded and the
        state kept in its ball at every chunk end
    output = W_o (RMSNorm(y) ⊙ SiLU(x W_g))

The update is the layer's `MemoryRule` (`rule.py`): the normalised v and x̂, the two bounds, the normalised chunk step
and the bounded momentum gain are the library's default rule, not the paper's (DESIGN.md §1, "Stable by default";
`MemoryRule.paper()` is the paper's). All projections, gates, convs and the initial memory weights W_0 are ordinary
parameters trained by the outer loop through the inner updates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers.attention import one_token
from ..layers.conv import CausalDepthwiseConv, causal_depthwise_conv
from ..layers.state import DecodeClock, check_state_shapes, check_state_type, states_trusted
from .checks import Gates
from .delta import delta_rule_memory
from .mlp import Weights, memory_apply
from .parallel import DEFAULT_RULE, IMPLEMENTATIONS, parallel_memory
from .rule import MemoryRule, momentum_bound
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


@dataclasses.dataclass
class StaticMemoryState:
    """A `MemoryState` in buffers of fixed shape, for static decoding (`titans.models.StaticDecoder`): the pending
    tokens in `chunk_size` slots, every write in place (the weights and momentum at chunk ends only). How many slots
    hold the current chunk is the host's (from the clock's step count): a step reads it to slice the chunk so far,
    so a CUDA graph is captured per chunk position (DESIGN.md §2, "Decoding on a GPU")."""

    weights: Weights  # contiguous copies, [batch, heads, d_in, d_out] per layer
    momentum: Weights
    conv_cache: Tensor
    pending_k: Tensor  # [batch, heads, chunk_size, head_dim]; slots 0..num_pending − 1 hold the chunk so far
    pending_v: Tensor
    pending_gates: Tensor  # [batch, heads, chunk_size, gates_per_head]
    clock: DecodeClock
    start_pending: int  # MemoryState.num_pending and seq_pos when the decode began
    start_seq_pos: int

    def buffers(self) -> list[Tensor]:
        return [*self.weights, *self.momentum, self.conv_cache, self.pending_k, self.pending_v, self.pending_gates]

    def with_buffers_of(self, other: StaticMemoryState) -> StaticMemoryState:
        """This state's clock fields over `other`'s buffers."""
        return dataclasses.replace(self, **{name: getattr(other, name) for name in (
            "weights", "momentum", "conv_cache", "pending_k", "pending_v", "pending_gates")})

    def pending_after(self, steps: int) -> int:
        return (self.start_pending + steps) % self.pending_k.shape[2]

    @property
    def num_pending(self) -> int:
        return self.pending_after(self.clock.steps)

    def phase(self) -> int:
        """What of the position a step's Python reads: the chunk position (the shapes of its slices)."""
        return self.num_pending

    def view(self, steps: Optional[int] = None) -> MemoryState:
        """The `MemoryState` after `steps` steps (default: now) as views of the buffers (valid until they change)."""
        steps = self.clock.steps if steps is None else steps
        p = self.pending_after(steps)
        return MemoryState(self.weights, self.momentum, self.conv_cache, self.pending_k[:, :, :p],
                           self.pending_v[:, :, :p], self.pending_gates[:, :, :p], self.start_seq_pos + steps)

    def dynamic(self, steps: Optional[int] = None) -> MemoryState:
        """The `MemoryState` the dynamic step would hold after `steps` steps (default: now), as copies."""
        v = self.view(steps)
        return MemoryState(tuple(w.clone() for w in v.weights), tuple(s.clone() for s in v.momentum),
                           v.conv_cache.clone(), v.pending_k.clone(), v.pending_v.clone(), v.pending_gates.clone(),
                           v.seq_pos)


class NeuralMemory(nn.Module):
    """Neural long-term memory layer: `forward(x [B, T, dim], state=None) -> (y [B, T, dim], state)`.

    Args:
        dim: model width; split into `heads` memories of width dim // heads.
        heads: memories side by side, each its own recurrence.
        depth: layers of the memory MLP (1 = matrix memory).
        expansion: hidden width of the memory MLP as a multiple of the head width.
        chunk_size: tokens whose gradients share the chunk's starting weights (paper §3.2).
        rule: the update (`MemoryRule`, DESIGN.md §1): the inner loss, activation, residual, the bounds, the normalised
            chunk step, the hidden layers' step, κ, and how the gates are made (momentum, forgetting, per-channel α,
            data or constant gates, θ_max and the gates' initial values, normalised inputs, the surprise gate, chunk
            pooling, per-token gradients: the exact delta rule, which needs depth 1). Default: the library's stable
            rule; `MemoryRule.paper()` is the paper's. Where the rule's loss takes a gate (Huber with `gated`), its
            per-token parameter is one more gate per head, computed from x like θ, η and α.
        conv_kernel: width of the causal depthwise convs on q, k, v.
        checkpoint_chunks: chunks per recomputation group in training. None (default) chooses: every
            chunk's state is kept up to 64 chunks, beyond that groups of ⌈√chunks⌉ chunks are recomputed in the
            backward pass, so training holds O(√T) states instead of one per chunk; 0 disables it.
        learned_init: the memory's initial weights W_0 are parameters of the outer loop (default; the paper is
            silent); False leaves them as initialised (last layer 0), so a read returns only what was written.
        implementation: which `parallel_memory` implementation runs the chunk loop ("fused", "triton", "autograd",
            "compile"); None (default): `parallel.serving_implementation` decides ("triton" on CUDA where it serves
            the call, else "fused"; "compile" only when asked for). Numbers only, not the model: every
            implementation computes the same rule.

    The gates (DESIGN.md §1): θ_t = max_lr · sigmoid(x̂_t w_θ + b_θ) (+ w_s log(1 + ℓ_t) with the surprise gate),
    η_t = sigmoid(x̂_t w_η + b_η) (0 without momentum), α_t = sigmoid(x̂_t w_α + b_α) (0 without forgetting; one per
    output column of every layer with `forgetting_channels`), each bias starting at its `init_*` value; with
    `gate_pooling="chunk"` each chunk uses its first token's gates (constant within the chunk and known when it starts,
    so still causal); with `gates="constant"` they are the `init_*` values for every token, not trained.
    """

    def __init__(
        self,
        dim: int,
        heads: int = 1,
        depth: int = 2,
        expansion: int = 4,
        chunk_size: int = 16,
        rule: MemoryRule = DEFAULT_RULE,
        conv_kernel: int = 4,
        checkpoint_chunks: Optional[int] = None,
        learned_init: bool = True,
        implementation: Optional[str] = None,
    ):
        super().__init__()
        if not isinstance(rule, MemoryRule):
            raise ValueError(f"rule must be a MemoryRule (titans.memory.MemoryRule), got {type(rule).__name__}")
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
        if rule.gradients == "token" and depth != 1:
            raise ValueError(f"rule.gradients='token' (the exact delta rule) is a matrix memory: it needs depth=1, "
                             f"got depth={depth}")
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.depth, self.chunk_size, self.rule = depth, chunk_size, rule
        self.checkpoint_chunks, self.implementation = checkpoint_chunks, implementation
        # κ's record over training forwards: how many learned θ_t it lowered, of how many (`momentum_bound_record`)
        self.bound_lowered: Union[Tensor, int] = 0
        self.bound_gates = 0

        hidden = self.head_dim * expansion
        widths = [self.head_dim] + [hidden] * (depth - 1) + [self.head_dim]
        # α per channel: one gate per output column of every layer, after θ and η; then the loss's gate, if it has one
        self.alpha_widths = tuple(widths[1:]) if rule.forgetting_channels else (1,)
        self.gates_per_head = 2 + sum(self.alpha_widths) + int(rule.loss.has_gate)  # θ, η, α, loss gate

        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)  # W_Q, W_K, W_V
        self.conv = CausalDepthwiseConv(3 * dim, conv_kernel)
        init_logits = self.initial_gate_logits()
        if rule.gates == "data":  # the outer loop tunes the bias and the weights from x
            self.to_gates = nn.Linear(dim, self.gates_per_head * heads)
            with torch.no_grad():
                self.to_gates.weight.mul_(0.1)
                self.to_gates.bias.copy_(init_logits)  # rounded to the bias's dtype
        else:  # constant: the same logits for every token, not parameters (float64, so θ, η, α are the constants)
            self.to_gates = None
            self.register_buffer("constant_gate_logits", init_logits, persistent=False)
        self.surprise_weight = nn.Parameter(torch.zeros(heads)) if rule.surprise_gate else None

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
        """Logits of θ, η, α (and the loss's gate) per head at init (float64): every gate starts at its init_* value,
        the bias being its logit; constant gates keep them. Also what a loader that leaves buffers empty (Hugging
        Face) refills."""
        rule = self.rule
        alphas = [logit(rule.init_alpha)] * sum(self.alpha_widths)
        loss_gate = [rule.loss.initial_gate_logit] if rule.loss.has_gate else []
        return torch.tensor([logit(rule.initial_theta / rule.max_lr), logit(rule.init_eta), *alphas, *loss_gate],
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
        return self.to_gates(F.rms_norm(x, (self.dim,)) if self.rule.normalize_inputs else x)

    def _gate_values(self, logits: Tensor) -> Gates:
        """θ, η, α and the loss's gate from logits [B, H, n, gates_per_head] that start at a chunk boundary (α per
        channel: one [B, H, n, d_out] per memory layer). θ as the gates give it: the functional core bounds it by κ
        (`rule.bounded_theta`); here the θ_t the bound lowers are counted in training."""
        rule = self.rule
        if rule.gate_pooling == "chunk":
            n = logits.shape[2]
            first = torch.arange(n, device=logits.device) // self.chunk_size * self.chunk_size
            logits = logits[:, :, first]
        theta_logit, eta_logit = logits[..., 0], logits[..., 1]
        eta = torch.sigmoid(eta_logit) if rule.momentum else torch.zeros_like(eta_logit)
        alpha_logits = logits[..., 2 : 2 + sum(self.alpha_widths)]
        alpha = torch.sigmoid(alpha_logits) if rule.forgetting else torch.zeros_like(alpha_logits)
        alpha = alpha.split(self.alpha_widths, dim=-1) if rule.forgetting_channels else alpha[..., 0]
        loss_gate = rule.loss.gate_from_logit(logits[..., -1]) if rule.loss.has_gate else None
        bound = momentum_bound(rule, eta)
        if self.surprise_weight is None:
            theta = rule.max_lr * torch.sigmoid(theta_logit)
            self._count_bound(theta, bound)
            return Gates(theta, eta, alpha, loss_gate)
        weight = self.surprise_weight.view(1, -1, 1)

        def theta(surprise: Tensor, start: int, end: int) -> Tensor:
            value = rule.max_lr * torch.sigmoid(theta_logit[:, :, start:end] + weight * torch.log1p(surprise))
            self._count_bound(value, None if bound is None else bound[:, :, start:end])
            return value

        return Gates(theta, eta, alpha, loss_gate)

    def _count_bound(self, theta: Tensor, bound: Optional[Tensor]) -> None:
        """Count, in training, the θ_t the bound on the momentum's gain lowers (`rule.momentum_bound`, the bound the
        core applies), so that a run shows where it acted (read on the device, no host sync here)."""
        if bound is not None and self.training:
            lowered = theta.detach() > bound.detach()
            self.bound_lowered = self.bound_lowered + lowered.sum()
            self.bound_gates += lowered.numel()

    def momentum_bound_record(self) -> tuple[int, int]:
        """(the learned θ_t that κ lowered, the learned θ_t it bounded) over this memory's training forwards."""
        return int(self.bound_lowered), self.bound_gates

    def _output(self, y: Tensor, x: Tensor, norm_weight: Optional[Tensor] = None) -> Tensor:
        """W_o (RMSNorm(y) ⊙ SiLU(x W_g)), y per head [B, H, T, d]; the norm's gain `norm_weight` [H, 1, d] where
        given (a read with a norm of its own, MAC's `mac_separate_norms`), else the layer's."""
        gain = self.out_norm_weight if norm_weight is None else norm_weight
        y = F.rms_norm(y.to(x.dtype), (self.head_dim,)) * gain
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
        values = self._gate_values(gates)
        if self.rule.gradients == "token":  # no momentum: η is unused and the momentum state stays zero
            y, weights = delta_rule_memory(q, k, v, values.theta, values.alpha, weights, self.chunk_size, self.rule)
            return y, weights, momentum
        return parallel_memory(
            q, k, v, values, weights, momentum, rule=self.rule, chunk_size=self.chunk_size,
            checkpoint_chunks=self._checkpoint_group(k.shape[2]), implementation=self.implementation,
        )

    # -------------------------------------------------------------------------------------- forward
    def forward(self, x: Tensor, state: Optional[MemoryState] = None) -> tuple[Tensor, MemoryState]:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be [batch, seq, {self.dim}], got shape {tuple(x.shape)}")
        batch, seq, _ = x.shape
        if isinstance(state, StaticMemoryState):
            return self._static_step(x, state), state
        if state is None:
            state = self.init_state(batch, x.device)
        self._check_state(state, batch)
        q, k, v, gates, conv_cache = self._inputs(x, state.conv_cache)

        # generation: one token a step (the one-token step takes the scalar α; a channel-wise α takes the chunk path)
        if seq == 1 and self._steps_tokens and not torch.is_grad_enabled():
            y, new_state = self._token_step(q, k, v, gates, state, conv_cache)
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
            conv_cache=conv_cache,
            # copies of fewer than chunk_size tokens, so the state does not keep this call's projections alive
            pending_k=k[:, :, full:].clone(),
            pending_v=v[:, :, full:].clone(),
            pending_gates=gates[:, :, full:].clone(),
            seq_pos=state.seq_pos + seq,
        )
        return self._output(y, x), new_state

    def _inputs(self, x: Tensor, conv_cache: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """q, k, v `[B, H, T, d]` and the gates' logits `[B, H, T, gates_per_head]` of x, in the state's dtype, and the
        conv's new cache."""
        dtype = self._state_dtype()
        proj, conv_cache = self.conv(self.to_qkv(x), conv_cache)
        proj_q, proj_k, proj_v = proj.to(dtype).chunk(3, dim=-1)
        q = self._queries(proj_q)
        k = F.normalize(self._split_heads(F.silu(proj_k)), dim=-1)
        v = self._split_heads(F.silu(proj_v))
        if self.rule.normalize_inputs:  # the inner loop sees no scale: unit values like the keys, gates from unit-RMS x
            v = F.normalize(v, dim=-1)
        gates = self._gate_logits(x).to(dtype).unflatten(-1, (self.gates_per_head, self.heads)).permute(0, 3, 1, 2)
        return q, k, v, gates, conv_cache.to(dtype)

    @property
    def _steps_tokens(self) -> bool:
        """Whether `memory_token_step` serves this rule (it takes the scalar α and gradients at the chunk's start)."""
        return self.rule.gradients == "chunk" and not self.rule.forgetting_channels

    def _token_step(self, q: Tensor, k: Tensor, v: Tensor, gates: Tensor, state: MemoryState, conv_cache: Tensor
                    ) -> tuple[Tensor, MemoryState]:
        """One token through `memory_token_step` (no autograd): the same outputs and state as `_memory` over the
        pending tokens and this one (tests/memory/test_step.py), without the chunk path's machinery."""
        if state.num_pending:
            k, v, gates = (torch.cat([held, new], dim=2) for held, new in
                           ((state.pending_k, k), (state.pending_v, v), (state.pending_gates, gates)))
        y, W, S = self._chunk_so_far(q, k, v, gates, state.weights, state.momentum)
        keep = 0 if k.shape[2] == self.chunk_size else k.shape[2]  # a completed chunk leaves nothing pending
        return y, MemoryState(W, S, conv_cache, k[:, :, :keep], v[:, :, :keep], gates[:, :, :keep], state.seq_pos + 1)

    def _chunk_so_far(self, q: Tensor, k: Tensor, v: Tensor, gates: Tensor, weights: Weights, momentum: Weights
                      ) -> tuple[Tensor, Weights, Weights]:
        """The output of a chunk's newest token (q its query; k, v, gates the chunk's tokens so far, the newest last),
        and the state after the chunk if that token completes it (else `weights`, `momentum` unchanged).
        `memory_token_step` where it serves the rule; else the chunk path over the chunk so far, the earlier tokens'
        queries zero (their outputs discarded), as `forward` runs it."""
        chunk_end = k.shape[2] == self.chunk_size
        if self._steps_tokens:
            return memory_token_step(q, k, v, self._gate_values(gates), weights, momentum, chunk_end, self.rule)
        q = torch.cat([q.new_zeros(*q.shape[:2], k.shape[2] - 1, q.shape[3]), q], dim=2)
        y, W, S = self._memory(q, k, v, gates, weights, momentum)
        return (y[:, :, -1:], W, S) if chunk_end else (y[:, :, -1:], weights, momentum)

    # ------------------------------------------------------------------------------------ static decoding
    def static_state(self, state: MemoryState, clock: DecodeClock) -> StaticMemoryState:
        """`state` in the buffers of a `StaticMemoryState` (copies: the decode writes them in place)."""
        p, batch = state.num_pending, state.conv_cache.shape[0]
        pending = []
        for held, width in ((state.pending_k, self.head_dim), (state.pending_v, self.head_dim),
                            (state.pending_gates, self.gates_per_head)):
            buffer = held.new_zeros(batch, self.heads, self.chunk_size, width)
            buffer[:, :, :p] = held
            pending.append(buffer)
        weights, momentum = (tuple(w.clone(memory_format=torch.contiguous_format) for w in ws)
                             for ws in (state.weights, state.momentum))
        return StaticMemoryState(weights, momentum, state.conv_cache.clone(), *pending, clock, p, state.seq_pos)

    def _static_step(self, x: Tensor, state: StaticMemoryState) -> Tensor:
        """`forward` for one token over a `StaticMemoryState`: the token's k, v, gates written into slot
        `num_pending`, the chunk so far sliced from the buffers (a shape the host knows), the weights and momentum
        overwritten when the token ends the chunk. The same `_chunk_so_far` as the dynamic step."""
        one_token("NeuralMemory", x)
        q, k, v, gates, conv_cache = self._inputs(x, state.conv_cache)
        state.conv_cache.copy_(conv_cache)
        n = state.num_pending
        chunk = []
        for buffer, new in ((state.pending_k, k), (state.pending_v, v), (state.pending_gates, gates)):
            buffer[:, :, n : n + 1] = new
            chunk.append(buffer[:, :, : n + 1])
        y, W, S = self._chunk_so_far(q, *chunk, state.weights, state.momentum)
        if n + 1 == self.chunk_size:
            for buffer, new in zip(state.weights + state.momentum, W + S):
                buffer.copy_(new)
        return self._output(y, x)

    def current_weights(self, state: MemoryState) -> Weights:
        """The memory as it stands after the last consumed token (pending tokens applied)."""
        if state.num_pending == 0:
            return state.weights
        q = torch.zeros_like(state.pending_k)
        _, W, _ = self._memory(q, state.pending_k, state.pending_v, state.pending_gates, state.weights, state.momentum)
        return W

    def retrieve(
        self, x: Tensor, state: Optional[MemoryState] = None, query_cache: Optional[Tensor] = None,
        norm_weight: Optional[Tensor] = None,
    ) -> tuple[Tensor, Tensor]:
        """Read-only retrieval h_t = M(q_t) from the memory as it stands in `state` (paper eq. 15).

        q comes from x through this memory's W_Q and causal conv; `query_cache` is that conv's cache for
        the x stream (separate from the update stream's cache in `state`). `norm_weight`: the output norm's gain
        for this read (`_output`; None: the layer's). Returns (h [B, T, dim], cache).
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be [batch, seq, {self.dim}], got shape {tuple(x.shape)}")
        if state is None:
            state = self.init_state(x.shape[0], x.device)
        self._check_state(state, x.shape[0])
        if query_cache is not None:
            check_state_shapes("NeuralMemory.retrieve", {
                "query_cache": (query_cache, (x.shape[0], self.conv.kernel - 1, self.dim))})
        return self.read(x, self.current_weights(state), query_cache, norm_weight)

    def read(self, x: Tensor, weights: Weights, query_cache: Optional[Tensor],
             norm_weight: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """`retrieve` from given current weights (what MAC's static step keeps, `current_weights` taken once a
        segment)."""
        dim = self.dim
        proj_q = F.linear(x, self.to_qkv.weight[:dim])
        proj_q, query_cache = causal_depthwise_conv(proj_q, self.conv.weight[:dim], self.conv.bias[:dim], query_cache)
        q = self._queries(proj_q.to(self._state_dtype()))
        h = memory_apply(q, weights, self.rule)
        return self._output(h, x, norm_weight), query_cache
