"""`TitansConfig`: the one configuration of every model variant and baseline."""

from __future__ import annotations

from typing import Any, Literal, Optional, get_args

from pydantic import Field, model_validator

from ..config import Config

Variant = Literal["lmm", "mac", "mag", "mal", "transformer", "swa", "lstm", "gated_deltanet"]
VARIANTS: tuple[str, ...] = get_args(Variant)
TITANS_VARIANTS = ("lmm", "mac", "mag", "mal")  # the variants with a neural long-term memory; the rest are baselines
# Far above any real vocabulary (large LLM tokenizers have ~256k tokens); a typo past it would otherwise fail
# allocating the embedding table with an allocator traceback instead of an error naming the field.
MAX_VOCAB_SIZE = 2**24

# Defaults that changed, with the value every config saved before its field existed was trained with: a saved config
# (a checkpoint's config.yaml, a pretrained config.json, a results JSON's record) that lacks the field is read with
# that value, not today's default (`with_earlier_defaults`). Configs written since hold every field.
EARLIER_DEFAULTS: dict[str, Any] = {
    "memory_residual": True,  # the memory's k + MLP(k) until the ablations
    "memory_max_momentum_step": None,  # the paper's gates, unbounded, until lm's MAC spike (DESIGN.md §1)
}


def with_earlier_defaults(model: dict[str, Any]) -> dict[str, Any]:
    """A saved model config's fields, those it lacks whose default changed filled with their earlier value."""
    return {**EARLIER_DEFAULTS, **model}


# Fields a variant's model never reads: configs that differ only there build the same model (held in
# tests/models/test_models.py), so the experiment runner reads such a run back as one. Only fields known unread.
_NO_MEMORY = frozenset(  # the baselines without a neural memory read none of its fields
    {"memory_residual", "mal_residual", "memory_learned_init", "memory_max_momentum_step"})
UNREAD_FIELDS: dict[str, frozenset[str]] = {
    "transformer": _NO_MEMORY,
    "swa": _NO_MEMORY,
    "lstm": _NO_MEMORY,
    # its memory fixes its own residual and gates
    "gated_deltanet": frozenset({"memory_residual", "mal_residual", "memory_max_momentum_step"}),
    "lmm": frozenset({"mal_residual"}),
    "mac": frozenset({"mal_residual"}),
    "mag": frozenset({"mal_residual"}),
}


def unread_fields(cfg: TitansConfig) -> frozenset[str]:
    """The model fields `cfg`'s model never reads: its variant's (`UNREAD_FIELDS`), and the bound on the momentum's
    gain under constant gates, which are the numbers the config gives and are not bounded."""
    unread = UNREAD_FIELDS.get(cfg.variant, frozenset())
    return unread | {"memory_max_momentum_step"} if cfg.memory_gates == "constant" else unread


class TitansConfig(Config):
    """Model configuration. CPU-scale defaults; the paper's at-scale values are noted beside them."""

    variant: Variant = "mac"
    vocab_size: int = Field(256, ge=1, le=MAX_VOCAB_SIZE)  # byte-level by default
    dim: int = Field(128, ge=1)
    depth: int = Field(2, ge=1)  # number of blocks
    heads: int = Field(4, ge=1)
    window: int = Field(64, ge=1)  # sliding-window attention (swa, mag, mal)
    segment_len: int = Field(64, ge=1)  # MAC segment length C (paper: 512)
    n_persistent: int = Field(4, ge=0)  # persistent memory tokens per layer (mac, mag, mal; paper: 128 for MAC)
    memory_depth: int = Field(2, ge=1)  # L_M (paper: 2)
    memory_expansion: int = Field(4, ge=1)  # hidden width of the memory MLP / head width (paper: 4)
    memory_heads: Optional[int] = Field(None, ge=1)  # default: heads
    chunk_size: int = Field(16, ge=1)  # memory chunk b (paper: 16)
    # θ_max (the bound on the inner step; with unit keys, θ = 0.5 writes a value exactly)
    max_lr: float = Field(1.0, gt=0)
    memory_init_theta: Optional[float] = Field(None, gt=0)  # θ at init, below max_lr; None: 0.2 max_lr
    # momentum η at init (0.5 kept the memory models from learning recall)
    memory_init_eta: float = Field(0.1, gt=0, lt=1)
    # α at init: the memory keeps ≈ (1 − α)^n of a write after n tokens (99% at 1024)
    memory_init_alpha: float = Field(1e-5, gt=0, lt=1)
    # bound on each token's inner gradient norm (not in the paper); None: unbounded
    memory_max_grad_norm: Optional[float] = Field(4.0, gt=0)
    # the bounded state: ‖W_i‖, ‖S_i‖ ≤ this · √d_out (not in the paper); None: unbounded
    memory_max_state_norm: Optional[float] = Field(10.0, gt=0)
    memory_normalize_inputs: bool = True  # unit values, gates from RMS-normalised x (not in the paper)
    memory_normalize_chunk: bool = True  # a chunk's overlapping gradients share one step (not in the paper)
    memory_activation: Literal["gelu", "silu"] = "gelu"  # paper: GELU
    momentum: bool = True  # η (past surprise); gated_deltanet always runs without
    memory_forgetting: bool = True  # α (the forgetting gate); False: α = 0, the paper's "w/o weight decay"
    # α per output channel of every memory layer (the paper's later version) instead of one per token and head
    memory_forgetting_channels: bool = False
    memory_gates: Literal["data", "constant"] = "data"  # constant: θ, η, α fixed at memory_init_* (not trained)
    # M(k) = MLP(k), the paper's memory (depth 1: its linear memory k W); True adds the residual k + MLP(k), our former
    # default, which cost recall (docs/RESULTS.md, ablations; DESIGN.md §1)
    memory_residual: bool = False
    # MAL: the attention reads u + M(u) and the mixer returns M(u) + SW-Attn(norm(u + M(u))), a residual around each
    # of its two layers (DESIGN.md §3); False: eq. 31 as written, the attention reads M(u) alone
    mal_residual: bool = True
    # ρ: the hidden memory layers' inner step as a fraction of θ (1: the paper)
    memory_hidden_step: float = Field(1.0, ge=0, le=1)
    # κ: θ_t ≤ κ (1 − η_t), a bound on the learned gates' momentum gain θ_t / (1 − η_t), which rang in training where
    # θ_t and η_t rose together (not in the paper; DESIGN.md §1); None: the paper's gates. Constant gates are the
    # config's numbers and are not bounded.
    memory_max_momentum_step: Optional[float] = Field(1.0, gt=0)
    # the memory's initial weights W_0 trained by the outer loop (the paper is silent); False keeps them at their
    # initialisation (last layer 0, earlier layers random), so a read returns only what the memory wrote
    memory_learned_init: bool = True
    gate_pooling: Literal["token", "chunk"] = "token"
    surprise_gate: bool = False  # θ_t = θ_max sigmoid(x_t w_θ + b_θ + w_s log(1 + surprise_t))
    conv_kernel: int = Field(4, ge=1)
    mlp_ratio: float = Field(4.0, gt=0)  # SwiGLU hidden = mlp_ratio · dim · 2/3 before parameter matching
    match_params: bool = True  # size each variant's MLP so all variants have about the same parameters
    dropout: float = Field(0.0, ge=0, lt=1)
    tie_embeddings: bool = True
    # RoPE turns channel pair i by rope_base^(-2i/head_dim) radians per token, which falls from fast to slow
    # rotations only for a base above 1.
    rope_base: float = Field(10_000.0, gt=1)

    @model_validator(mode="after")
    def check_rules(self) -> TitansConfig:
        """The rules between fields (each field's own range is its `Field`)."""
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if (self.dim // self.heads) % 2:
            raise ValueError(f"dim / heads must be even for rotary embeddings, got {self.dim // self.heads}")
        if self.memory_heads is not None and self.dim % self.memory_heads:
            raise ValueError(f"memory_heads ({self.memory_heads}) must divide dim ({self.dim})")
        if self.memory_gates == "constant" and self.surprise_gate:
            raise ValueError("memory_gates='constant' fixes θ, so it cannot be combined with surprise_gate=True")
        if self.memory_init_theta is not None and not self.memory_init_theta < self.max_lr:
            raise ValueError(f"memory_init_theta must be in (0, max_lr = {self.max_lr}), got {self.memory_init_theta}")
        return self
