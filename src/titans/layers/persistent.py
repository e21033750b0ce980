"""Persistent memory (paper §3.3, eq. 19): N_p learned, input-independent tokens prepended to a sequence."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class PersistentMemory(nn.Module):
    """`num_tokens` learned vectors of width `dim`: task knowledge that does not depend on the input."""

    def __init__(self, num_tokens: int, dim: int):
        super().__init__()
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self.tokens = nn.Parameter(torch.randn(num_tokens, dim) * 0.02)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def prepend(self, x: Tensor) -> Tensor:
        """[p_1 .. p_Np ‖ x] for x `[batch, seq, dim]`."""
        return torch.cat([self.tokens.to(x.dtype).expand(x.shape[0], -1, -1), x], dim=1)
