"""MAL, memory as a layer (paper §4.3, eqs. 29-31).

    x̃ = [p_1 .. p_Np ‖ x]
    y = M(x̃)                      the long-term memory compresses the past
    h = x̃ + y                      (mal_residual) the memory as a residual layer of its own
    o = y + SW-Attn(norm(h))       sliding-window attention, prefix visible, as a second residual layer
With `mal_residual=False`, eq. 31 as written: o = SW-Attn(norm(y)), the attention reading the memory's output
only. The paper writes no residual or norm in any of its equations; its blocks are residual stacks, and MAL's two
layers are two of them (DESIGN.md §3 has the measurement that chose the default). The RMSNorm is ours.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from ..layers import PersistentMemory, RMSNorm, check_state_type
from .common import build_memory, build_window_attention, with_prefix
from .config import TitansConfig
from .mag import AttentionMemoryState


class MALMixer(nn.Module):
    def __init__(self, cfg: TitansConfig):
        super().__init__()
        self.persistent = PersistentMemory(cfg.attention.n_persistent, cfg.dim) if cfg.attention.n_persistent else None
        self.memory = build_memory(cfg)
        self.norm = RMSNorm(cfg.dim)
        self.attention = build_window_attention(cfg)
        self.residual = cfg.mal_residual

    def forward(self, x: Tensor, state: Optional[AttentionMemoryState] = None) -> tuple[Tensor, AttentionMemoryState]:
        if state is not None:
            check_state_type(type(self).__name__, state, AttentionMemoryState)
        x_tilde, prefix = with_prefix(x, self.persistent, state)
        y, memory_state = self.memory(x_tilde, state.memory if state else None)
        h = x_tilde + y if self.residual else y
        o, attention_cache = self.attention(self.norm(h), state.attention if state else None, prefix_len=prefix)
        if self.residual:
            o = y + o
        return o[:, prefix:], AttentionMemoryState(attention_cache, memory_state)


def build_mal_mixer(cfg: TitansConfig) -> MALMixer:
    return MALMixer(cfg)
