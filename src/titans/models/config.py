"""`TitansConfig`: the one configuration of every model variant and baseline."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from ..config import Config

Variant = Literal["lmm", "mac", "mag", "mal", "transformer", "swa", "lstm", "gated_deltanet"]
VARIANTS: tuple[str, ...] = ("lmm", "mac", "mag", "mal", "transformer", "swa", "lstm", "gated_deltanet")
# Far above any real vocabulary (large LLM tokenizers have ~256k tokens); a typo past it would otherwise fail
# allocating the embedding table with an allocator traceback instead of an error naming the field.
MAX_VOCAB_SIZE = 2**24


@dataclasses.dataclass
class TitansConfig(Config):
    """Model configuration. CPU-scale defaults; the paper's at-scale values are noted beside them."""

    variant: Variant = "mac"
    vocab_size: int = 256  # byte-level by default
    dim: int = 128
    depth: int = 2  # number of blocks
    heads: int = 4
    window: int = 64  # sliding-window attention (swa, mag, mal)
    segment_len: int = 64  # MAC segment length C (paper: 512)
    n_persistent: int = 4  # persistent memory tokens per layer (mac, mag, mal; paper: 128 for MAC)
    memory_depth: int = 2  # L_M (paper: 2)
    memory_expansion: int = 4  # hidden width of the memory MLP / head width (paper: 4)
    memory_heads: Optional[int] = None  # default: heads
    chunk_size: int = 16  # memory chunk b (paper: 16)
    max_lr: float = 1.0  # θ_max (the bound on the inner step; with unit keys, θ = 0.5 writes a value exactly)
    memory_init_theta: Optional[float] = None  # θ at init; None: 0.2 max_lr
    memory_init_eta: float = 0.1  # momentum η at init (0.5 kept the memory models from learning recall)
    memory_init_alpha: float = 1e-5  # α at init: the memory keeps ≈ (1 − α)^n of a write after n tokens (99% at 1024)
    memory_max_grad_norm: Optional[float] = 4.0  # bound on each token's inner gradient norm (not in the paper)
    memory_max_state_norm: Optional[float] = 10.0  # the bounded state: ‖W_i‖, ‖S_i‖ ≤ this · √d_out (not in the paper)
    memory_normalize_inputs: bool = True  # unit values, gates from RMS-normalised x (not in the paper)
    memory_normalize_chunk: bool = True  # a chunk's overlapping gradients share one step (not in the paper)
    memory_activation: Literal["gelu", "silu"] = "gelu"  # paper: GELU
    momentum: bool = True  # η (past surprise); gated_deltanet always runs without
    memory_forgetting: bool = True  # α (the forgetting gate); False: α = 0, the paper's "w/o weight decay"
    memory_gates: Literal["data", "constant"] = "data"  # constant: θ, η, α fixed at memory_init_* (not trained)
    memory_residual: bool = True  # M(k) = k + MLP(k); False with memory_depth 1 is the paper's linear memory k W
    memory_hidden_step: float = 1.0  # ρ: the hidden memory layers' inner step as a fraction of θ (1: the paper)
    gate_pooling: Literal["token", "chunk"] = "token"
    surprise_gate: bool = False  # θ_t = θ_max sigmoid(x_t w_θ + b_θ + w_s log(1 + surprise_t))
    conv_kernel: int = 4
    mlp_ratio: float = 4.0  # SwiGLU hidden = mlp_ratio · dim · 2/3 before parameter matching
    match_params: bool = True  # size each variant's MLP so all variants have about the same parameters
    dropout: float = 0.0
    tie_embeddings: bool = True
    rope_base: float = 10_000.0

    def validate(self) -> None:
        positive = ("vocab_size", "dim", "depth", "heads", "window", "segment_len", "memory_depth",
                    "memory_expansion", "chunk_size", "conv_kernel")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size > MAX_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be <= {MAX_VOCAB_SIZE} (2**24), got {self.vocab_size}")
        choices = {"variant": VARIANTS, "memory_activation": ("gelu", "silu"), "gate_pooling": ("token", "chunk"),
                   "memory_gates": ("data", "constant")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if (self.dim // self.heads) % 2:
            raise ValueError(f"dim / heads must be even for rotary embeddings, got {self.dim // self.heads}")
        if self.memory_heads is not None and (self.memory_heads < 1 or self.dim % self.memory_heads):
            raise ValueError(f"memory_heads ({self.memory_heads}) must divide dim ({self.dim})")
        if self.n_persistent < 0:
            raise ValueError(f"n_persistent must be >= 0, got {self.n_persistent}")
        if not 0 < self.max_lr:
            raise ValueError(f"max_lr must be > 0, got {self.max_lr}")
        if not 0 <= self.memory_hidden_step <= 1:
            raise ValueError(f"memory_hidden_step must be in [0, 1], got {self.memory_hidden_step}")
        if self.memory_gates == "constant" and self.surprise_gate:
            raise ValueError("memory_gates='constant' fixes θ, so it cannot be combined with surprise_gate=True")
        if self.memory_init_theta is not None and not 0 < self.memory_init_theta < self.max_lr:
            raise ValueError(f"memory_init_theta must be in (0, max_lr = {self.max_lr}), got {self.memory_init_theta}")
        if not 0 < self.memory_init_eta < 1:
            raise ValueError(f"memory_init_eta must be in (0, 1), got {self.memory_init_eta}")
        if not 0 < self.memory_init_alpha < 1:
            raise ValueError(f"memory_init_alpha must be in (0, 1), got {self.memory_init_alpha}")
        if self.memory_max_grad_norm is not None and not 0 < self.memory_max_grad_norm < float("inf"):
            raise ValueError(f"memory_max_grad_norm must be > 0 and finite, got {self.memory_max_grad_norm}")
        if self.memory_max_state_norm is not None and not 0 < self.memory_max_state_norm < float("inf"):
            raise ValueError(f"memory_max_state_norm must be > 0 and finite, got {self.memory_max_state_norm}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        if self.rope_base <= 1:
            raise ValueError(f"rope_base must be > 1, got {self.rope_base}: RoPE turns channel pair i by "
                             f"rope_base^(-2i/head_dim) radians per token, which falls from fast to slow rotations "
                             f"only for a base above 1")
