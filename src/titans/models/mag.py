"""MAG, memory as a gate (paper §4.2, eqs. 26-28).

    x̃ = [p_1 .. p_Np ‖ x]
    y = SW-Attn*(x̃)            sliding window; the persistent prefix stays visible to every query
    m = M(x̃)                    the long-term memory, updated and read per token
    o = norm_y(y) ⊙ σ(norm_m(m))  learnable vector-valued norms, then the gate
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn

from ..layers import KVCache, PersistentMemory, RMSNorm, check_state_type
from ..memory import MemoryState
from .common import build_memory, build_window_attention, with_prefix
from .config import TitansConfig


@dataclasses.dataclass
class AttentionMemoryState:
    """State of a mixer holding a sliding-window attention and a memory (MAG, MAL)."""

    attention: KVCache
    memory: MemoryState


class MAGMixer(nn.Module):
    def __init__(self, cfg: TitansConfig):
        super().__init__()
        self.persistent = PersistentMemory(cfg.attention.n_persistent, cfg.dim) if cfg.attention.n_persistent else None
        self.attention = build_window_attention(cfg)
        self.memory = build_memory(cfg)
        self.norm_attention = RMSNorm(cfg.dim)
        self.norm_memory = RMSNorm(cfg.dim)

    def forward(self, x: Tensor, state: Optional[AttentionMemoryState] = None) -> tuple[Tensor, AttentionMemoryState]:
        if state is not None:
            check_state_type(type(self).__name__, state, AttentionMemoryState)
        x_tilde, prefix = with_prefix(x, self.persistent, state)
        y, attention_cache = self.attention(x_tilde, state.attention if state else None, prefix_len=prefix)
        m, memory_state = self.memory(x_tilde, state.memory if state else None)
        o = self.norm_attention(y) * torch.sigmoid(self.norm_memory(m))
        return o[:, prefix:], AttentionMemoryState(attention_cache, memory_state)


def build_mag_mixer(cfg: TitansConfig) -> MAGMixer:
    return MAGMixer(cfg)
