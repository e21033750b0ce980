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
        # base^(-2i/head_dim) per device, float64: a plain attribute, not a buffer, so no dtype cast of the module
        # can degrade it; the same numbers every call would compute from scratch.
        self._frequencies: dict[torch.device, Tensor] = {}

    def angles(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin `[seq, head_dim / 2]` in `dtype` of the angles at `positions` `[seq]` (absolute, integer),
        computed in float64, so the same position gets bit-identical rotations whatever the model's dtype history.
        One pair serves every tensor rotated at those positions (q and k)."""
        frequencies = self._frequencies.get(positions.device)
        if frequencies is None:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=positions.device) / self.head_dim
            frequencies = self._frequencies.setdefault(positions.device, self.base ** (-exponents))
        angles = positions.to(torch.float64)[:, None] * frequencies[None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x `[batch, heads, seq, head_dim]` with channel pairs (2i, 2i + 1) turned by the angles of `angles`."""
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return rotated.flatten(-2)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x `[batch, heads, seq, head_dim]`, positions `[seq]` (absolute, integer)."""
        return self.rotate(x, *self.angles(positions, x.dtype))
