"""Building blocks around the memory: norms, RoPE, SwiGLU, attention shapes, persistent tokens, conv."""

from .attention import Attention, KVCache, banded_attention, masked_attention, reference_attention, visibility
from .conv import CausalDepthwiseConv, causal_depthwise_conv
from .mlp import SwiGLU
from .norm import RMSNorm
from .persistent import PersistentMemory
from .rope import RotaryEmbedding

__all__ = [
    "Attention", "KVCache", "banded_attention", "masked_attention", "reference_attention", "visibility", "CausalDepthwiseConv",
    "causal_depthwise_conv", "SwiGLU", "RMSNorm", "PersistentMemory", "RotaryEmbedding",
]
