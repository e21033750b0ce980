"""LMM: the neural long-term memory alone as the sequence mixer (paper §4.3, "Memory without attention").

    block: x + W_o(norm(M_t(q_t)) ⊙ SiLU(x W_g)), then the MLP — the output gate lives inside NeuralMemory.
"""

from __future__ import annotations

from ..memory import NeuralMemory
from .common import build_memory
from .config import TitansConfig


def build_lmm_mixer(cfg: TitansConfig) -> NeuralMemory:
    return build_memory(cfg)
