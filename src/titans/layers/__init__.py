"""Building blocks around the memory: norms, RoPE, SwiGLU, attention shapes, persistent tokens, conv."""

from .attention import (
    Attention,
    HeadProjections,
    KVCache,
    SegmentAttention,
    SegmentCache,
    StaticKVCache,
    StaticSegmentCache,
    banded_attention,
    explicit_attention,
    reference_attention,
    reference_segment_attention,
    segment_attention,
    segment_visibility,
    visibility,
)
from .conv import CausalDepthwiseConv, causal_depthwise_conv
from .mlp import SwiGLU
from .norm import RMSNorm
from .persistent import PersistentMemory
from .rope import RotaryEmbedding
from .state import DecodeClock, check_state_shapes, check_state_type, states_trusted, trusted_states

__all__ = [
    "Attention", "HeadProjections", "KVCache", "SegmentAttention", "SegmentCache", "StaticKVCache",
    "StaticSegmentCache", "banded_attention", "explicit_attention", "reference_attention",
    "reference_segment_attention", "segment_attention", "segment_visibility", "visibility", "CausalDepthwiseConv",
    "causal_depthwise_conv", "SwiGLU", "RMSNorm", "PersistentMemory", "RotaryEmbedding", "DecodeClock",
    "check_state_shapes", "check_state_type", "states_trusted", "trusted_states",
]
