"""Rotary position embedding applied at explicit absolute positions (so cached decoding matches)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RotaryEmbedding(nn.Module):
    """Rotates pairs of channels of q/k by position-dependent angles (Su et al., RoFormer)."""

    def __init__(self, head_dim: int, base: float = 10_000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        self.head_dim, self.base = head_dim, base

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x `[batch, heads, seq, head_dim]`, positions `[seq]` (absolute, integer)."""
        # Angles in float64 from scratch each call (no buffer a dtype cast could degrade), so the
        # same position gets bit-identical rotations whatever the model's dtype history.
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=x.device) / self.head_dim
        angles = positions.to(torch.float64)[:, None] * self.base ** (-exponents)[None, :]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return rotated.flatten(-2)
