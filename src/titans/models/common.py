"""Pieces every variant shares: the pre-norm block, the memory built from a config, MLP sizing.

A *mixer* is the sequence-mixing part of a block (attention, memory, both, an LSTM):
`mixer(x [B, T, D], state) -> (y [B, T, D], state)`, where `state=None` starts a stream.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from ..layers import Attention, RMSNorm, SwiGLU
from ..memory import MemoryRule, NeuralMemory
from .config import TitansConfig


def build_memory(cfg: TitansConfig, rule: Optional[MemoryRule] = None, **structure: Any) -> NeuralMemory:
    """The memory of `cfg.memory`: its rule (or `rule`, for a variant that fixes its own) and its structure (`structure`
    overriding it, e.g. depth=1)."""
    memory = cfg.memory
    options = dict(heads=memory.heads or cfg.heads, depth=memory.depth, expansion=memory.expansion,
                   chunk_size=memory.chunk_size, conv_kernel=memory.conv_kernel, learned_init=memory.learned_init)
    options.update(structure)
    return NeuralMemory(cfg.dim, rule=memory.rule if rule is None else rule, **options)


def build_window_attention(cfg: TitansConfig) -> Attention:
    attention = cfg.attention
    return Attention(cfg.dim, cfg.heads, window=attention.window, rope_base=attention.rope_base, dropout=cfg.dropout)


def with_prefix(x: Tensor, persistent: Optional[nn.Module], state: Any) -> tuple[Tensor, int]:
    """x̃ = [p ‖ x] at the start of a stream (state None), else x; returns (x̃, prefix length).

    A continued stream's state (MAG, MAL) must hold as many prefix keys as this model has persistent tokens: a
    state from a model with another `n_persistent` has the right shapes everywhere else."""
    if state is not None:
        held = getattr(state.attention, "prefix_k", None)  # not a KVCache: the attention layer says so
        expected = len(persistent) if persistent is not None else 0
        if isinstance(held, Tensor) and held.dim() == 4 and held.shape[2] != expected:
            raise ValueError(f"state.attention holds {held.shape[2]} persistent-token keys, this model has "
                             f"{expected} (a state from a model with another n_persistent?)")
        return x, 0
    if persistent is None:
        return x, 0
    return persistent.prepend(x), len(persistent)


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + SwiGLU(norm(x))."""

    def __init__(self, mixer: nn.Module, dim: int, mlp_hidden: int, dropout: float):
        super().__init__()
        self.mixer_norm = RMSNorm(dim)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, mlp_hidden, dropout)

    def forward(self, x: Tensor, state: Any = None) -> tuple[Tensor, Any]:
        y, state = self.mixer(self.mixer_norm(x), state)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() counts a tied weight once


def mlp_hidden_size(cfg: TitansConfig, build_mixer: Callable[[TitansConfig], nn.Module],
                    reference_mixer: Callable[[TitansConfig], nn.Module]) -> int:
    """SwiGLU width for a block whose mixer is `build_mixer(cfg)`.

    Without `match_params`: mlp_ratio · dim · 2/3. With it, every variant's block gets the parameter
    budget of the reference (MAG: attention + memory) block at that default width, its MLP absorbing
    the difference, so variants compared at one config have about the same parameter count.
    """
    default = max(8, int(cfg.mlp_ratio * cfg.dim * 2 / 3))
    if not cfg.match_params:
        return default
    with torch.device("meta"):
        own = count_parameters(build_mixer(cfg))
        budget = count_parameters(reference_mixer(cfg)) + 3 * cfg.dim * default
    return max(8, round((budget - own) / (3 * cfg.dim)))
