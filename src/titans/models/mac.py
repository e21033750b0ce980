"""MAC, memory as context (paper §4.1, eqs. 21-25), in the paper's order of operations.

For each segment S⁽ᵗ⁾ of length C:
    h  = M*_{t−1}(q)                 retrieve from the memory as it stood BEFORE the segment (no update)
    ỹ  = Attn([p ‖ h ‖ S⁽ᵗ⁾])        persistent tokens, retrieved memory, the segment itself
    y  = ỹ at the segment's positions
    M_t ← update the memory with y   (per token, chunk-parallel)
    o  = y ⊙ σ(M*_t(y))              gate with the updated memory, read per token (causal)

Causality inside a segment: h_j comes from x_j, so query i sees h_j only for j ≤ i (and the
segment causally); the persistent tokens are visible to all. RoPE puts h_j and x_j at position j of
the segment; persistent keys carry no rotation. σ is our choice for the paper's ⊗ (as in MAG).
Streaming keeps the memory as of the segment start, the segment's K/V so far (≤ C each) and the
memory's current state: constant size, and a stream fed in any pieces equals one call.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn

from ..layers import Attention, PersistentMemory, masked_attention
from ..memory import MemoryState
from .common import build_memory
from .config import TitansConfig


@dataclasses.dataclass
class MACState:
    memory: MemoryState  # after the last token
    segment_memory: MemoryState  # as it stood when the current segment began (retrieval reads this)
    query_cache: Tensor  # conv cache of the retrieval queries (the x stream)
    k_h: Tensor  # keys/values of the current segment's retrieved tokens h and inputs x so far
    v_h: Tensor
    k_x: Tensor
    v_x: Tensor
    pos: int = 0


class MACMixer(nn.Module):
    def __init__(self, cfg: TitansConfig):
        super().__init__()
        self.segment_len = cfg.segment_len
        self.persistent = PersistentMemory(cfg.n_persistent, cfg.dim) if cfg.n_persistent else None
        self.attention = Attention(cfg.dim, cfg.heads, window=None, rope_base=cfg.rope_base, dropout=cfg.dropout)
        self.memory = build_memory(cfg)

    def initial_state(self, x: Tensor) -> MACState:
        memory = self.memory.init_state(x.shape[0], x.device)
        heads, head_dim = self.attention.heads, self.attention.head_dim
        empty = x.new_zeros(x.shape[0], heads, 0, head_dim)
        query_cache = x.new_zeros(x.shape[0], self.memory.conv.kernel - 1, x.shape[2])
        return MACState(memory, memory, query_cache, empty, empty, empty, empty, 0)

    def _segment(self, xs: Tensor, state: MACState) -> tuple[Tensor, MACState]:
        """Tokens xs all belong to the current segment (starting at offset state.pos % C)."""
        batch, n, _ = xs.shape
        offset = state.pos % self.segment_len
        h, query_cache = self.memory.retrieve(xs, state.segment_memory, state.query_cache)  # eq. 21
        positions = torch.arange(offset, offset + n, device=xs.device)
        q, k_x, v_x = self.attention.project(xs, positions)
        _, k_h, v_h = self.attention.project(h, positions)
        k_h, v_h = torch.cat([state.k_h, k_h], 2), torch.cat([state.v_h, v_h], 2)
        k_x, v_x = torch.cat([state.k_x, k_x], 2), torch.cat([state.v_x, v_x], 2)
        seen = torch.arange(offset + n, device=xs.device)
        causal = seen[None, :] <= positions[:, None]  # [n, offset + n]
        keys, values, visible = [k_h, k_x], [v_h, v_x], [causal, causal]
        if self.persistent is not None:
            _, k_p, v_p = self.attention.project(self.persistent.tokens.to(xs.dtype)[None], None)
            keys.insert(0, k_p.expand(batch, -1, -1, -1))
            values.insert(0, v_p.expand(batch, -1, -1, -1))
            visible.insert(0, causal.new_ones(n, len(self.persistent)))
        y = masked_attention(q, torch.cat(keys, 2), torch.cat(values, 2), torch.cat(visible, 1))  # eq. 22
        y = self.attention.merge(y)
        gate, memory = self.memory(y, state.memory)  # eqs. 23-24: write y, read M*_t(y) per token
        out = y * torch.sigmoid(gate)  # eq. 25
        pos = state.pos + n
        if pos % self.segment_len == 0:  # segment complete: the next one reads the updated memory
            empty = k_h[:, :, :0]
            return out, MACState(memory, memory, query_cache, empty, empty, empty, empty, pos)
        return out, MACState(memory, state.segment_memory, query_cache, k_h, v_h, k_x, v_x, pos)

    def forward(self, x: Tensor, state: Optional[MACState] = None) -> tuple[Tensor, MACState]:
        state = state if state is not None else self.initial_state(x)
        outputs, start = [], 0
        while start < x.shape[1]:
            n = min(self.segment_len - state.pos % self.segment_len, x.shape[1] - start)
            out, state = self._segment(x[:, start : start + n], state)
            outputs.append(out)
            start += n
        return torch.cat(outputs, 1) if outputs else x[:, :0], state


def build_mac_mixer(cfg: TitansConfig) -> MACMixer:
    return MACMixer(cfg)
