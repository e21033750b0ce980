"""`TitansEncoder` for continuous inputs (sensor data, time series) and its task heads.

    x [batch, seq, embed_dim] → Linear → Titans blocks (any variant) → hidden states [batch, seq, hidden_size]

Options follow the common Titans encoder API and map onto `TitansConfig`:
    embed_dim    input features (the input projection's width)
    hidden_size  model width (`dim`)
    memory_size  hidden width of each memory head's MLP: `memory_expansion = memory_size // (hidden_size //
                 memory_heads)`, memory_heads defaulting to heads; None keeps the default 4 × head width
    num_layers   blocks (`depth`)
    dropout      `dropout`
    momentum     η on/off in the memory (`momentum`)
    window_size  sliding-window length for SWA/MAG/MAL and segment length for MAC (`window`, `segment_len`)
Anything else in TitansConfig can be passed as a keyword override, or pass a full `config`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn.functional as F
from torch import Tensor, nn

from .config import TitansConfig, nest_flat_fields
from .lm import Backbone, State


class TitansEncoder(nn.Module):
    """`forward(x [B, T, embed_dim], state=None) -> (last hidden state [B, hidden_size], state)`."""

    def __init__(self, embed_dim: int, config: Optional[TitansConfig] = None, **options: Any):
        """`embed_dim` features per step in; the model either as a whole `config`, or as the encoder's options by
        name (`config_from_options`: hidden_size, memory_size, num_layers, dropout, momentum, window_size, variant,
        heads, chunk_size, with their defaults there) and any TitansConfig field as an override."""
        super().__init__()
        if embed_dim < 1:
            raise ValueError(f"embed_dim must be >= 1, got {embed_dim}")
        if config is None:
            config = self.config_from_options(**options)
        elif options:
            raise ValueError(f"pass either a config or option overrides, not both (got {sorted(options)})")
        self.config = config
        self.embed_dim, self.hidden_size = embed_dim, config.dim
        self.input_proj = nn.Linear(embed_dim, config.dim)
        self.backbone = Backbone(config)

    @staticmethod
    def config_from_options(hidden_size: int = 64, memory_size: Optional[int] = None, num_layers: int = 2,
                            dropout: float = 0.0, momentum: bool = True, window_size: int = 32, variant: str = "mag",
                            heads: int = 4, chunk_size: int = 8, **config_overrides: Any) -> TitansConfig:
        """The TitansConfig the encoder options stand for (errors name the encoder's option)."""
        for name, value in (("hidden_size", hidden_size), ("num_layers", num_layers), ("window_size", window_size),
                            ("heads", heads)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        overrides = nest_flat_fields(config_overrides)
        memory = dict(overrides.pop("memory", None) or {})
        attention = {"window": window_size, "segment_len": window_size, **dict(overrides.pop("attention", None) or {})}
        memory_heads = memory.pop("heads", None) or heads
        if hidden_size % heads or hidden_size % memory_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by heads ({heads}, memory {memory_heads})")
        head_width = hidden_size // memory_heads
        if memory_size is not None and memory_size < head_width:
            raise ValueError(f"memory_size ({memory_size}) must be >= the memory head width ({head_width})")
        expansion = memory_size // head_width if memory_size is not None else 4
        memory = {"expansion": expansion, "heads": memory_heads, "momentum": momentum, "chunk_size": chunk_size,
                  **memory}
        return TitansConfig(
            variant=variant, vocab_size=1, dim=hidden_size, depth=num_layers, heads=heads,
            attention=attention, memory=memory, dropout=dropout, tie_embeddings=False, **overrides,
        )

    def hidden_states(self, x: Tensor, state: Optional[State] = None) -> tuple[Tensor, State]:
        """Every position's hidden state [batch, seq, hidden_size] (causal), and the state."""
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be [batch, seq, {self.embed_dim}], got {tuple(x.shape)}")
        return self.backbone(self.input_proj(x), state)

    def forward(self, x: Tensor, state: Optional[State] = None) -> tuple[Tensor, State]:
        h, state = self.hidden_states(x, state)
        return h[:, -1], state


class LastStateHead(nn.Module):
    """A linear map of the encoder's last hidden state: classification logits or regression outputs."""

    def __init__(self, encoder: TitansEncoder, out_dim: int):
        super().__init__()
        if out_dim < 1:
            raise ValueError(f"out_dim must be >= 1, got {out_dim}")
        self.encoder, self.proj = encoder, nn.Linear(encoder.hidden_size, out_dim)

    def forward(self, x: Tensor, state: Optional[State] = None) -> tuple[Tensor, State]:
        h, state = self.encoder(x, state)
        return self.proj(h), state


class ClassificationHead(LastStateHead):
    """Class logits [batch, num_classes] from the sequence; `loss` is cross-entropy."""

    def __init__(self, encoder: TitansEncoder, num_classes: int):
        super().__init__(encoder, num_classes)

    def loss(self, x: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self(x)[0], labels)


class RegressionHead(LastStateHead):
    """Real outputs [batch, out_dim] from the sequence; `loss` is mean squared error."""

    def __init__(self, encoder: TitansEncoder, out_dim: int = 1):
        super().__init__(encoder, out_dim)

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        return mse_same_shape(self(x)[0], targets)


def mse_same_shape(outputs: Tensor, targets: Tensor) -> Tensor:
    """Mean squared error that refuses to broadcast: [B] targets against [B, 1] outputs would silently average
    over a [B, B] grid of differences."""
    if targets.shape != outputs.shape:
        raise ValueError(f"targets must have the outputs' shape {tuple(outputs.shape)}, got {tuple(targets.shape)}")
    return F.mse_loss(outputs, targets)


class ForecastHead(nn.Module):
    """One-step-ahead forecasts at every position: [batch, seq, F] → [batch, seq, F] (output t predicts x_{t+1})."""

    def __init__(self, encoder: TitansEncoder, num_features: Optional[int] = None):
        super().__init__()
        self.encoder = encoder
        self.proj = nn.Linear(encoder.hidden_size, num_features or encoder.embed_dim)

    def forward(self, x: Tensor, state: Optional[State] = None) -> tuple[Tensor, State]:
        h, state = self.encoder.hidden_states(x, state)
        return self.proj(h), state

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        return mse_same_shape(self(x)[0], targets)
