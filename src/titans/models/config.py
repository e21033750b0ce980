"""`TitansConfig`: the one configuration of every model variant and baseline."""

from __future__ import annotations

import functools
from typing import Any, Literal, Optional, get_args

from pydantic import Field, model_validator

from ..config import Config
from ..memory.rule import MemoryRule

Variant = Literal["lmm", "mac", "mag", "mal", "transformer", "swa", "lstm", "gated_deltanet"]
VARIANTS: tuple[str, ...] = get_args(Variant)  # ours: every one builds a TitansLM, streams and saves
# Models of other implementations, rows beside ours in the experiments (`models/peer.py`): titans-pytorch's
# MemoryAsContextTransformer (the `compare` extra). They train and evaluate on token tasks; they do not stream.
PEER_VARIANTS: tuple[str, ...] = ("titans_pytorch_mac",)
ModelVariant = Literal[Variant, "titans_pytorch_mac"]
MODEL_VARIANTS: tuple[str, ...] = get_args(ModelVariant)  # every variant a config (an experiment's row) may name
TITANS_VARIANTS = ("lmm", "mac", "mag", "mal")  # the variants with a neural long-term memory; the rest are baselines
# Far above any real vocabulary (large LLM tokenizers have ~256k tokens); a typo past it would otherwise fail
# allocating the embedding table with an allocator traceback instead of an error naming the field.
MAX_VOCAB_SIZE = 2**24

class MemoryConfig(MemoryRule):
    """The `memory:` section of a `TitansConfig`: the memory's update rule (`MemoryRule`, every field of it) and its
    structure. `rule` is what `NeuralMemory` takes; the structure goes to its other arguments (`build_memory`)."""

    depth: int = Field(2, ge=1)  # L_M (paper: 2)
    expansion: int = Field(4, ge=1)  # hidden width of the memory MLP / head width (paper: 4)
    heads: Optional[int] = Field(None, ge=1)  # default: the model's heads
    chunk_size: int = Field(16, ge=1)  # memory chunk b (paper: 16)
    # the memory's initial weights W_0 trained by the outer loop (the paper is silent); False keeps them at their
    # initialisation (last layer 0, earlier layers random), so a read returns only what the memory wrote
    learned_init: bool = True
    conv_kernel: int = Field(4, ge=1)  # the causal depthwise convs on q, k, v

    @model_validator(mode="after")
    def check_structure(self) -> MemoryConfig:
        if self.gradients == "token" and self.depth != 1:
            raise ValueError(f"gradients='token' (the exact delta rule) is a matrix memory: it needs depth=1, got "
                             f"depth={self.depth}")
        return self

    @functools.cached_property
    def rule(self) -> MemoryRule:
        return MemoryRule(**{name: getattr(self, name) for name in MemoryRule.model_fields})


# The flat names of the memory's fields, as configs wrote them before the `memory:` section (format version 1): each
# still reads, into its place in the section (`nest_flat_fields`).
FLAT_MEMORY_FIELDS: dict[str, str] = {
    "memory_depth": "depth", "memory_expansion": "expansion", "memory_heads": "heads", "chunk_size": "chunk_size",
    "max_lr": "max_lr", "memory_init_theta": "init_theta", "memory_init_eta": "init_eta",
    "memory_init_alpha": "init_alpha", "memory_max_grad_norm": "max_grad_norm",
    "memory_max_state_norm": "max_state_norm", "memory_normalize_inputs": "normalize_inputs",
    "memory_normalize_chunk": "normalize_chunk", "memory_activation": "activation", "momentum": "momentum",
    "memory_forgetting": "forgetting", "memory_forgetting_channels": "forgetting_channels", "memory_gates": "gates",
    "memory_residual": "residual", "memory_hidden_step": "hidden_step",
    "memory_max_momentum_step": "max_momentum_step", "memory_learned_init": "learned_init",
    "gate_pooling": "gate_pooling", "surprise_gate": "surprise_gate", "conv_kernel": "conv_kernel",
}


class AttentionConfig(Config):
    """The `attention:` section of a `TitansConfig`: the attention's window, MAC's segment, the persistent tokens and
    the rotary embedding, as every variant with attention reads them."""

    window: int = Field(64, ge=1)  # sliding-window attention (swa, mag, mal)
    segment_len: int = Field(64, ge=1)  # MAC segment length C (paper: 512)
    n_persistent: int = Field(4, ge=0)  # persistent memory tokens per layer (mac, mag, mal; paper: 128 for MAC)
    # RoPE turns channel pair i by rope_base^(-2i/head_dim) radians per token, which falls from fast to slow
    # rotations only for a base above 1.
    rope_base: float = Field(10_000.0, gt=1)


# The flat names of the attention's fields, as configs wrote them before the `attention:` section (format version 3
# and earlier): each still reads, into its place in the section (`nest_flat_fields`).
FLAT_ATTENTION_FIELDS: dict[str, str] = {name: name for name in ("window", "segment_len", "n_persistent", "rope_base")}

# Every section's flat names: section -> {flat name: the field's name in the section}.
FLAT_FIELDS: dict[str, dict[str, str]] = {"memory": FLAT_MEMORY_FIELDS, "attention": FLAT_ATTENTION_FIELDS}


def flat_field_path(name: str) -> str | None:
    """The nested path (`memory.depth`, `attention.window`) of a flat field's name (`memory_depth`, `window`); None
    for a name that is not one."""
    for section, fields in FLAT_FIELDS.items():
        if name in fields:
            return f"{section}.{fields[name]}"
    return None


def nest_flat_fields(model: Any) -> Any:
    """A model config's mapping with its flat fields (`memory_depth: 1`, `chunk_size: 8`, `window: 32`) moved into
    their sections (`memory`, `attention`). Where a field is given both ways in one mapping, the flat one wins: it is
    the more specific change (`cfg.replace(memory_depth=1)` lays it over a complete section). Mappings that are merged
    (a YAML file and its overrides, an experiment's base and its rows) are nested first, so the later one wins however
    it is spelled."""
    if not isinstance(model, dict):
        return model
    for section, fields in FLAT_FIELDS.items():
        model = _nest_section(model, section, fields)
    return model


def _nest_section(model: dict[str, Any], section: str, fields: dict[str, str]) -> dict[str, Any]:
    nested = model.get(section, {})
    flat = {fields[key]: value for key, value in model.items() if key in fields}
    # the memory section may be given as a rule alone (the structure at its defaults), as an object
    as_object = isinstance(nested, MemoryRule) and not isinstance(nested, MemoryConfig)
    if not flat and not as_object:
        return model
    if isinstance(nested, Config):
        nested = nested.to_dict()
    rest = {key: value for key, value in model.items() if key not in fields and key != section}
    return {**rest, section: {**nested, **flat} if isinstance(nested, dict) else nested}


# MAC's switches (TitansConfig.mac_*, models/mac.py), and MAC in the paper's order of operations: every switch off
MAC_SWITCHES = frozenset({"mac_write_input", "mac_residual_read", "mac_position_free_persistent",
                          "mac_separate_norms"})
MAC_PAPER_ORDER: dict[str, bool] = dict.fromkeys(sorted(MAC_SWITCHES), False)

# Defaults that changed, with the value every config saved before its field existed was trained with: a saved config
# (a checkpoint's config.yaml, a pretrained config.json, a results JSON's record) that lacks the field, in either
# spelling, is read with that value, not today's default (`with_earlier_defaults`). Configs written since hold every
# field, so nothing is filled into them. Paths in the nested config (`section.field`, or a top-level field).
EARLIER_DEFAULTS: dict[str, Any] = {
    "memory.residual": True,  # the memory's k + MLP(k) until the ablations
    "memory.max_momentum_step": None,  # the paper's gates, unbounded, until lm's MAC spike (DESIGN.md §1)
    **MAC_PAPER_ORDER,  # MAC in the paper's order of operations until issue 47's mac_switches grid (DESIGN.md §3)
}


def with_earlier_defaults(model: dict[str, Any]) -> dict[str, Any]:
    """A saved model config's fields (flat or nested), nested, those it lacks whose default changed filled with their
    earlier value."""
    filled = dict(nest_flat_fields(model))
    for section in FLAT_FIELDS:
        if isinstance(filled.get(section), dict):
            filled[section] = dict(filled[section])
    for path, value in EARLIER_DEFAULTS.items():
        if "." not in path:
            filled.setdefault(path, value)
            continue
        section, field = path.split(".")
        node = filled.setdefault(section, {})
        if isinstance(node, dict):
            node.setdefault(field, value)
    return filled


# Fields a variant's model never reads (paths in the nested config): configs that differ only there build the same
# model (held in tests/models/test_models.py), so the experiment runner reads such a run back as one. Only fields
# known unread.
_NOT_MAC = MAC_SWITCHES | {"titans_pytorch"}  # what every variant of ours but MAC leaves unread
_NO_MEMORY = frozenset(  # the baselines without a neural memory read none of these
    {"memory.residual", "mal_residual", "memory.learned_init", "memory.max_momentum_step"}) | _NOT_MAC
UNREAD_FIELDS: dict[str, frozenset[str]] = {
    "transformer": _NO_MEMORY,
    "swa": _NO_MEMORY,
    "lstm": _NO_MEMORY,
    # its memory fixes its own residual and gates
    "gated_deltanet": frozenset({"memory.residual", "mal_residual", "memory.max_momentum_step"}) | _NOT_MAC,
    "lmm": frozenset({"mal_residual"}) | _NOT_MAC,
    "mac": frozenset({"mal_residual", "titans_pytorch"}),
    "mag": frozenset({"mal_residual"}) | _NOT_MAC,
    "mal": _NOT_MAC,
    # titans-pytorch's MAC (models/peer.py) builds from the width, depth, heads, segment, persistent tokens and the
    # memory's depth and expansion, and its own options: not from our MAC's switches or MAL's residual
    "titans_pytorch_mac": MAC_SWITCHES | {"mal_residual"},
}


def unread_fields(cfg: TitansConfig) -> frozenset[str]:
    """The model fields (paths, `memory.residual`) `cfg`'s model never reads: its variant's (`UNREAD_FIELDS`), and the
    bound on the momentum's gain under constant gates, which are the numbers the config gives and are not bounded."""
    unread = UNREAD_FIELDS.get(cfg.variant, frozenset())
    return unread | {"memory.max_momentum_step"} if cfg.memory.gates == "constant" else unread


def without_fields(model: dict[str, Any], paths: frozenset[str]) -> dict[str, Any]:
    """A model config's mapping (nested) without the fields at `paths`."""
    top = {path for path in paths if "." not in path}
    nested = {tuple(path.split(".")) for path in paths if "." in path}
    kept = {key: value for key, value in model.items() if key not in top}
    for section, field in nested:
        if isinstance(kept.get(section), dict):
            kept[section] = {key: value for key, value in kept[section].items() if key != field}
    return kept


class TitansConfig(Config):
    """Model configuration. CPU-scale defaults; the paper's at-scale values are noted beside them."""

    variant: ModelVariant = "mac"
    vocab_size: int = Field(256, ge=1, le=MAX_VOCAB_SIZE)  # byte-level by default
    dim: int = Field(128, ge=1)
    depth: int = Field(2, ge=1)  # number of blocks
    heads: int = Field(4, ge=1)
    # the attention: its window, MAC's segment, the persistent tokens, RoPE's base; the flat names of configs written
    # before it (window, segment_len, n_persistent, rope_base) still read
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    # the neural memory: its update rule and structure (lmm, mac, mag, mal; gated_deltanet takes its structure and
    # fixes its own rule); the flat names of configs written before it (memory_depth, chunk_size, ...) still read
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    # MAL: the attention reads u + M(u) and the mixer returns M(u) + SW-Attn(norm(u + M(u))), a residual around each
    # of its two layers (DESIGN.md §3); False: eq. 31 as written, the attention reads M(u) alone
    mal_residual: bool = True
    # MAC's switches (models/mac.py): all four on by default since issue 47 (together they learn the byte passkey
    # across segments at no cost to lm: `mac_switches`, `lm`; DESIGN.md §3); all four off is the paper's order.
    # Write the memory from the block's input x, the stream its queries read, instead of the attention output y:
    # departs from eqs. 24-25, which write y and gate with M*(y) (titans-pytorch writes its input)
    mac_write_input: bool = True
    # also add the retrieved memory h to the residual stream before attention, beside h as attention context:
    # departs from eqs. 21-22, which give h as context only (titans-pytorch adds it to the stream)
    mac_residual_read: bool = True
    # score the persistent tokens position-free (q_i · k_p, unrotated queries), as the window attention scores its
    # prefix (the paper gives them no positions); False: rotated queries against unrotated persistent keys
    mac_position_free_persistent: bool = True
    # the read used as attention context (eq. 21) and the read used for the output gate (eq. 25) each with its own
    # output norm; False: the memory's one norm serves both
    mac_separate_norms: bool = True
    # variant titans_pytorch_mac: keyword options of titans-pytorch's MemoryAsContextTransformer laid over those
    # this config gives it (models/peer.py: its README's options, the width, depth, heads, segment and memory here)
    titans_pytorch: dict[str, Any] = Field(default_factory=dict)
    mlp_ratio: float = Field(4.0, gt=0)  # SwiGLU hidden = mlp_ratio · dim · 2/3 before parameter matching
    match_params: bool = True  # size each variant's MLP so all variants have about the same parameters
    dropout: float = Field(0.0, ge=0, lt=1)
    tie_embeddings: bool = True

    @model_validator(mode="before")
    @classmethod
    def nest_sections(cls, data: Any) -> Any:
        """The flat fields of configs written before the `memory:` and `attention:` sections, in their places."""
        return nest_flat_fields(data)

    @model_validator(mode="after")
    def check_rules(self) -> TitansConfig:
        """The rules between fields (each field's own range is its `Field`, the memory's rules are its section's)."""
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if (self.dim // self.heads) % 2:
            raise ValueError(f"dim / heads must be even for rotary embeddings, got {self.dim // self.heads}")
        if self.memory.heads is not None and self.dim % self.memory.heads:
            raise ValueError(f"memory.heads ({self.memory.heads}) must divide dim ({self.dim})")
        return self

    def replace(self, **changes: Any) -> TitansConfig:
        """A copy with `changes`, flat fields (`memory_depth=1`, `window=8`) or a section's mapping merged into the
        section (`memory={"depth": 1}` changes the depth alone)."""
        data = self.to_dict()
        for section in FLAT_FIELDS:
            if isinstance(changes.get(section), dict):
                changes = {**changes, section: {**data[section], **changes[section]}}
        return type(self).from_dict({**data, **changes})
