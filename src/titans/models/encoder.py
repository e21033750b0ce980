"""`TitansEncoder` for continuous inputs (sensor data, time series) and its task heads.

    x [batch, seq, embed_dim] → Linear → Titans blocks → hidden states [batch, seq, hidden_size]

Option names follow the common Titans encoder API: `embed_dim` (input features), `hidden_size`
(model width), `memory_size` (hidden width of each memory MLP head), `num_layers`, `dropout`,
`momentum` (η on/off), `window_size` (attention window; MAC segment length).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .config import TitansConfig
from .lm import Backbone, State


class TitansEncoder(nn.Module):
    def __init__(self, embed_dim: int, hidden_size: int = 64, memory_size: Optional[int] = None, num_layers: int = 2,
                 dropout: float = 0.0, momentum: bool = True, window_size: int = 32, variant: str = "mag",
                 heads: int = 4, chunk_size: int = 8, config: Optional[TitansConfig] = None, **config_overrides):
        """Either the encoder options above, or a full `config` (then hidden_size = config.dim)."""
        super().__init__()
        if embed_dim < 1:
            raise ValueError(f"embed_dim must be >= 1, got {embed_dim}")
        if config is not None:
            self.config = config
            hidden_size = config.dim
        else:
            self.config = self._config_from_options(hidden_size, memory_size, num_layers, dropout, momentum,
                                                    window_size, variant, heads, chunk_size, config_overrides)
        self.embed_dim, self.hidden_size = embed_dim, hidden_size
        self.input_proj = nn.Linear(embed_dim, hidden_size)
        self.backbone = Backbone(self.config)

    @staticmethod
    def _config_from_options(hidden_size, memory_size, num_layers, dropout, momentum, window_size, variant, heads,
                             chunk_size, config_overrides) -> TitansConfig:
        config_overrides = dict(config_overrides)
        memory_heads = config_overrides.pop("memory_heads", None) or heads
        head_width = hidden_size // memory_heads if hidden_size % memory_heads == 0 else hidden_size
        expansion = max(1, (memory_size or 4 * head_width) // max(head_width, 1))
        return TitansConfig(
            variant=variant, vocab_size=1, dim=hidden_size, depth=num_layers, heads=heads, window=window_size,
            segment_len=window_size, memory_expansion=expansion, memory_heads=memory_heads, momentum=momentum,
            dropout=dropout, chunk_size=chunk_size, tie_embeddings=False, **config_overrides,
        )

    def hidden_states(self, x: Tensor, state: Optional[State] = None) -> tuple[Tensor, State]:
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be [batch, seq, {self.embed_dim}], got {tuple(x.shape)}")
        return self.backbone(self.input_proj(x), state)

    def forward(self, x: Tensor, state: Optional[State] = None) -> tuple[Tensor, State]:
        """The last hidden state [batch, hidden_size] (and the state to continue the stream)."""
        h, state = self.hidden_states(x, state)
        return h[:, -1], state


class ClassificationHead(nn.Module):
    def __init__(self, encoder: TitansEncoder, num_classes: int):
        super().__init__()
        self.encoder, self.proj = encoder, nn.Linear(encoder.hidden_size, num_classes)

    def forward(self, x: Tensor, state: Optional[State] = None) -> tuple[Tensor, State]:
        h, state = self.encoder(x, state)
        return self.proj(h), state


class RegressionHead(ClassificationHead):
    def __init__(self, encoder: TitansEncoder, out_dim: int = 1):
        super().__init__(encoder, out_dim)


class ForecastHead(nn.Module):
    """One-step-ahead forecasts at every position: [batch, seq, F] → [batch, seq, F]."""

    def __init__(self, encoder: TitansEncoder, num_features: Optional[int] = None):
        super().__init__()
        self.encoder = encoder
        self.proj = nn.Linear(encoder.hidden_size, num_features or encoder.embed_dim)

    def forward(self, x: Tensor, state: Optional[State] = None) -> tuple[Tensor, State]:
        h, state = self.encoder.hidden_states(x, state)
        return self.proj(h), state

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        return torch.nn.functional.mse_loss(self(x)[0], targets)
