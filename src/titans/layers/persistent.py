"""Persistent memory (paper §3.3): N_p learned, input-independent tokens prepended to a sequence."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class PersistentMemory(nn.Module):
    def __init__(self, num_tokens: int, dim: int):
        super().__init__()
        self.tokens = nn.Parameter(torch.randn(num_tokens, dim) * 0.02)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def prepend(self, x: Tensor) -> Tensor:
        """[p_1 .. p_Np ‖ x] for x `[batch, seq, dim]`."""
        return torch.cat([self.tokens.to(x.dtype).expand(x.shape[0], -1, -1), x], dim=1)
