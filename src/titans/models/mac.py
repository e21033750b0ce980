"""MAC, memory as context (paper §4.1, eqs. 21-25): the paper's order of operations and our default's four switches.

For each segment S⁽ᵗ⁾ of length C:
    h  = M*_{t−1}(q)                 retrieve from the memory as it stood BEFORE the segment (no update)
    ỹ  = Attn([p ‖ h ‖ S⁽ᵗ⁾])        persistent tokens, retrieved memory, the segment itself
    y  = ỹ at the segment's positions
    M_t ← update the memory with y   (per token, chunk-parallel)
    o  = y ⊙ σ(M*_t(y))              gate with the updated memory, read per token (causal)

The memory reads RMSNorm(y), not y: attention outputs are unnormalised, and writing them raw made
the values (and with η → 1 the momentum) grow until the inner loop overflowed in our CPU runs;
every other variant's memory already sees a normalised input (pre-norm blocks).

(The best-known public implementation updates the memory before attention; we do not.) The gate σ
is our choice for the paper's ⊗: the memory's output is unbounded, and a sigmoid keeps o a damped copy
of y, as MAG's gate does. Causality inside a segment: h_j comes from x_j, so query i sees h_j only for
j ≤ i (see `SegmentAttention`). Streaming keeps the memory as of the segment start, the segment's K/V
so far (< C each) and the memory's current state: constant size, and a stream fed in any pieces
equals one call.

Switches (TitansConfig.mac_*), the ways titans-pytorch's MAC differs from the order above. All four are ON by
default: together they let MAC learn the byte passkey across segments in every seed (0.91 exact at 256 bytes over
three seeds, against 0.09 with all off; no single switch did) at no cost to language modelling (`mac_switches` and
`lm` in docs/RESULTS.md; DESIGN.md §3). All four off is the paper's order of operations as above.
    mac_write_input               M_t ← update with x, read M*_t(x) for the gate: the memory written from the
                                  stream its queries read (departs from eqs. 24-25, which write and read y)
    mac_residual_read             ỹ = Attn([p ‖ h ‖ S⁽ᵗ⁾ + h]) and o + h: the read also added to the residual stream
                                  before attention, beside h as context (departs from eqs. 21-22, context only)
    mac_position_free_persistent  p scored as q_i · k_p, without the query's rotation, as the window attention
                                  scores its prefix (the paper gives p no positions; off, they turn with i)
    mac_separate_norms            h (eq. 21) and M*_t(y) (eq. 25) through output norms of their own (off, one norm
                                  serves both, so every non-empty read comes out at unit scale)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn

from ..layers import (
    DecodeClock,
    PersistentMemory,
    RMSNorm,
    SegmentAttention,
    SegmentCache,
    StaticSegmentCache,
    check_state_type,
)
from ..memory import MemoryState, StaticMemoryState
from ..memory.mlp import Weights
from .common import build_memory
from .config import TitansConfig


@dataclasses.dataclass
class MACState:
    """None everywhere means the start of a stream (the memory at its learned initial weights)."""

    memory: Optional[MemoryState] = None  # after the last token
    segment_memory: Optional[MemoryState] = None  # as it stood when the current segment began
    query_cache: Optional[Tensor] = None  # conv cache of the retrieval queries (the x stream)
    attention: Optional[SegmentCache] = None  # the current segment's h and x keys/values


@dataclasses.dataclass
class StaticMACState:
    """`MACState` in buffers of fixed shape, for static decoding (`titans.models.StaticDecoder`). The segment's memory
    is a copy of the memory, taken in place at each segment end; beside it the weights retrieval reads from it
    (`current_weights`, taken once a segment instead of once a token: the same numbers)."""

    memory: StaticMemoryState
    segment_memory: StaticMemoryState  # until a segment ends, the one the decode began with (its own clock fields)
    segment_weights: Weights
    query_cache: Tensor
    attention: StaticSegmentCache
    segment_memory_unset: bool  # MACState.segment_memory was None (the learned initial memory) when the decode began

    def dynamic(self) -> MACState:
        ended = self.attention.clock.steps - self.attention.length  # steps into the decode of the last segment end
        if ended >= 1:  # the copy holds the memory as it stood then
            segment_memory = self.memory.with_buffers_of(self.segment_memory).dynamic(ended)
        else:
            segment_memory = None if self.segment_memory_unset else self.segment_memory.dynamic(0)
        return MACState(self.memory.dynamic(), segment_memory, self.query_cache.clone(), self.attention.dynamic())


class MACMixer(nn.Module):
    def __init__(self, cfg: TitansConfig):
        super().__init__()
        attention = cfg.attention
        self.segment_len = attention.segment_len
        self.write_input, self.residual_read = cfg.mac_write_input, cfg.mac_residual_read
        self.persistent = PersistentMemory(attention.n_persistent, cfg.dim) if attention.n_persistent else None
        self.attention = SegmentAttention(cfg.dim, cfg.heads, attention.segment_len, attention.rope_base, cfg.dropout,
                                          position_free_persistent=cfg.mac_position_free_persistent)
        # the attention output is normalised before the memory writes it (module docstring); written from the block's
        # input (already normalised), the memory needs no norm of its own
        self.memory_norm = None if cfg.mac_write_input else RMSNorm(cfg.dim)
        self.memory = build_memory(cfg)
        # mac_separate_norms: the context read's own output-norm gain (the gate's read keeps the memory's); shaped
        # and initialised as the memory's (`NeuralMemory.out_norm_weight`)
        self.context_norm = nn.Parameter(torch.ones_like(self.memory.out_norm_weight)) \
            if cfg.mac_separate_norms else None

    def _segment(self, x: Tensor, state: MACState) -> tuple[Tensor, MACState]:
        """x: the next tokens of the current segment (not crossing its end; already normalised: the block's)."""
        h, query_cache = self.memory.retrieve(x, state.segment_memory, state.query_cache,  # eq. 21
                                              norm_weight=self.context_norm)
        persistent = self.persistent.tokens if self.persistent is not None else None
        # eq. 22 attends over [p ‖ h ‖ S]; mac_residual_read also adds h to the stream it attends from (not eq. 22)
        y, attention = self.attention(x + h if self.residual_read else x, h, persistent, state.attention)
        # eqs. 23-24: write y, read M*_t(y); mac_write_input writes x and reads M*_t(x) (not eqs. 24-25)
        gate, memory = self.memory(x if self.write_input else self.memory_norm(y), state.memory)
        out = y * torch.sigmoid(gate)  # eq. 25
        if self.residual_read:  # the read stays in the residual stream after the block, as it entered attention
            out = out + h
        # At a segment boundary the next segment reads the memory as updated by this one.
        segment_memory = memory if attention.length == 0 else state.segment_memory
        return out, MACState(memory, segment_memory, query_cache, attention)

    def forward(self, x: Tensor, state: Optional[MACState] = None) -> tuple[Tensor, MACState]:
        if isinstance(state, StaticMACState):
            return self._static_step(x, state), state
        if state is None:
            state = MACState()
        check_state_type("MACMixer", state, MACState)
        outputs, start = [], 0
        while start < x.shape[1]:
            offset = state.attention.length if state.attention is not None else 0
            n = min(self.segment_len - offset, x.shape[1] - start)
            out, state = self._segment(x[:, start : start + n], state)
            outputs.append(out)
            start += n
        return torch.cat(outputs, 1) if outputs else x[:, :0], state

    # ------------------------------------------------------------------------------------ static decoding
    def static_state(self, state: MACState, clock: DecodeClock) -> StaticMACState:
        """A stream's `MACState` (after at least one token) in the buffers of a `StaticMACState` (copies)."""
        batch, device = state.memory.conv_cache.shape[0], state.memory.conv_cache.device
        unset = state.segment_memory is None
        segment_memory = self.memory.init_state(batch, device) if unset else state.segment_memory
        dtype = self.memory.to_qkv.weight.dtype  # the queries' conv cache is in the model's dtype
        query_cache = (state.query_cache.clone() if state.query_cache is not None else
                       torch.zeros(batch, self.memory.conv.kernel - 1, self.memory.dim, dtype=dtype, device=device))
        segment_weights = tuple(w.clone(memory_format=torch.contiguous_format)
                                for w in self.memory.current_weights(segment_memory))
        return StaticMACState(self.memory.static_state(state.memory, clock),
                              self.memory.static_state(segment_memory, clock), segment_weights, query_cache,
                              self.attention.static_cache(state.attention, clock, query_cache), unset)

    def _static_step(self, x: Tensor, state: StaticMACState) -> Tensor:
        """`_segment` for one token over a `StaticMACState`, written in place; at a segment end (the host knows it from
        the clock) the memory is copied into the segment's and its current weights taken for the next segment."""
        h, query_cache = self.memory.read(x, state.segment_weights, state.query_cache, self.context_norm)  # eq. 21
        state.query_cache.copy_(query_cache)
        persistent = self.persistent.tokens if self.persistent is not None else None
        y, _ = self.attention(x + h if self.residual_read else x, h, persistent, state.attention)  # eq. 22
        gate, _ = self.memory(x if self.write_input else self.memory_norm(y), state.memory)  # eqs. 23-24
        if state.attention.phase():  # this token ends the segment
            for copied, held in zip(state.segment_memory.buffers(), state.memory.buffers()):
                copied.copy_(held)
            current = self.memory.current_weights(state.memory.view(state.memory.clock.steps + 1))
            for buffer, new in zip(state.segment_weights, current):
                buffer.copy_(new)
        out = y * torch.sigmoid(gate)  # eq. 25
        return out + h if self.residual_read else out


def build_mac_mixer(cfg: TitansConfig) -> MACMixer:
    return MACMixer(cfg)
