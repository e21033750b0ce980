"""MAL, memory as a layer (paper §4.3, eqs. 29-31).

    x̃ = [p_1 .. p_Np ‖ x]
    y = M(x̃)                    the long-term memory compresses the past
    o = SW-Attn(norm(y))         sliding-window attention over the memory's output, prefix visible
The RMSNorm between the two layers is ours (each sub-layer sees a normalised input, as pre-norm blocks do).
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
        self.persistent = PersistentMemory(cfg.n_persistent, cfg.dim) if cfg.n_persistent else None
        self.memory = build_memory(cfg)
        self.norm = RMSNorm(cfg.dim)
        self.attention = build_window_attention(cfg)

    def forward(self, x: Tensor, state: Optional[AttentionMemoryState] = None) -> tuple[Tensor, AttentionMemoryState]:
        if state is not None:
            check_state_type(type(self).__name__, state, AttentionMemoryState)
        x_tilde, prefix = with_prefix(x, self.persistent, state)
        y, memory_state = self.memory(x_tilde, state.memory if state else None)
        o, attention_cache = self.attention(self.norm(y), state.attention if state else None, prefix_len=prefix)
        return o[:, prefix:], AttentionMemoryState(attention_cache, memory_state)


def build_mal_mixer(cfg: TitansConfig) -> MALMixer:
    return MALMixer(cfg)
