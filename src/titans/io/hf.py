"""Hugging Face `transformers` integration: `import titans.hf`, then `AutoModelForCausalLM.from_pretrained(dir)`.

Importing this module registers `TitansHFConfig` (model_type "titans") with `AutoConfig` and `TitansForCausalLM`
with `AutoModelForCausalLM`. Both read and write the directory layout of `TitansLM.save_pretrained` (config.json
as in `titans/io/pretrained.py`, weights under TitansLM's own parameter names), so a model moves between the
two classes, and `titans export` output loads in either.

`generate` runs through the recurrent state: the first step reads the prompt, every later step feeds only the new
token and carries the state in `past_key_values` (a `TitansCache`), exactly as `TitansLM.generate` does. The state
cannot be rewound or re-ordered, so beam search and assisted generation are refused; so is padding (the memory
would read the pad tokens).

`import titans` does not import transformers; only this module does (`pip install "titans[hf]"`).
"""

from __future__ import annotations

from typing import Any, Optional

try:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as err:
    raise ImportError('titans.hf needs Hugging Face transformers (>= 5.23): pip install "titans[hf]"') from err

import torch
import torch.nn.functional as F
from torch import Tensor

from ..memory import NeuralMemory
from ..models.config import FLAT_FIELDS, TitansConfig, flat_field_path, with_earlier_defaults
from ..models.lm import State, TitansLM, check_tokens
from .pretrained import FORMAT_VERSION, MODEL_TYPE, section_to_config

if int(transformers.__version__.split(".")[0]) < 5:  # 4.x: other generate cache handling and tied-weight keys
    raise ImportError(f"titans.hf needs transformers >= 5.23, found {transformers.__version__}: "
                      f'pip install "titans[hf]"')

__all__ = ["TitansCache", "TitansForCausalLM", "TitansHFConfig"]


class TitansHFConfig(PretrainedConfig):
    """A `TitansConfig` as a Hugging Face config: its fields live in the `titans` section (config.json's layout).

    `TitansHFConfig(variant="mac", dim=64)` takes TitansConfig fields as keywords too. `titans_config` is the
    TitansConfig itself; `vocab_size`, `hidden_size`, `num_hidden_layers`, `num_attention_heads` and
    `tie_word_embeddings` answer Hugging Face's generic code from it.
    """

    model_type = MODEL_TYPE

    # The arguments are config.json's keys (pretrained.SECTION and VERSION_KEY): transformers passes the file's keys.
    def __init__(self, titans: Optional[dict] = None, titans_format_version: int = FORMAT_VERSION, **kwargs: Any):
        fields = {name: kwargs.pop(name) for name in list(kwargs)
                  if name in TitansConfig.model_fields or flat_field_path(name)}
        for derived in ("tie_word_embeddings", "model_type"):  # answered from the section (a saved file has them)
            kwargs.pop(derived, None)
        # a saved section lacking a field whose default changed was written under the earlier one
        saved = with_earlier_defaults(titans) if isinstance(titans, dict) else {}
        for section in FLAT_FIELDS:  # a section given as a keyword (`memory={...}`) changes the saved one's fields
            if isinstance(fields.get(section), dict):
                fields[section] = {**saved.get(section, {}), **fields[section]}
        config = section_to_config({**saved, **fields}, titans_format_version, "titans config")
        super().__init__(**kwargs)
        # Read in any version this library knows, the section is complete now: it is written in the current one.
        self.titans = config.to_dict()
        self.titans_format_version = FORMAT_VERSION

    @classmethod
    def from_titans_config(cls, config: TitansConfig, **kwargs: Any) -> "TitansHFConfig":
        return cls(titans=config.to_dict(), **kwargs)

    @property
    def titans_config(self) -> TitansConfig:
        return TitansConfig.from_dict(self.titans)

    @property
    def vocab_size(self) -> int:
        return self.titans["vocab_size"]

    @property
    def hidden_size(self) -> int:
        return self.titans["dim"]

    @property
    def num_hidden_layers(self) -> int:
        return self.titans["depth"]

    @property
    def num_attention_heads(self) -> int:
        return self.titans["heads"]

    @property
    def tie_word_embeddings(self) -> bool:
        return self.titans["tie_embeddings"]


class TitansCache:
    """The recurrent state between `generate`'s steps (its `past_key_values`): one entry per block, plus the
    number of tokens read, which `generate` asks (`get_seq_length`) when it is handed a cache to continue."""

    is_compileable = False
    is_croppable = False  # a recurrent state cannot be rewound to an earlier token

    def __init__(self, state: State, seen_tokens: int):
        self.state, self.seen_tokens = state, seen_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: Tensor) -> None:
        # Without this method generate would silently keep the states in the old beam order.
        raise ValueError("beam search is not supported by titans models (their recurrent state is not re-ordered); "
                         "use greedy decoding or sampling (num_beams=1)")


class TitansForCausalLM(PreTrainedModel, GenerationMixin):
    """`TitansLM` as a Hugging Face causal LM: the same modules under the same names (embed, backbone, head)."""

    config_class = TitansHFConfig
    main_input_name = "input_ids"
    _is_stateful = True  # generate refuses assisted decoding, which would need to rewind the state
    _tied_weights_keys = {"head.weight": "embed.weight"}  # used only when config.tie_word_embeddings

    def __init__(self, config: TitansHFConfig):
        super().__init__(config)
        lm = TitansLM(config.titans_config)
        # TitansLM's modules as this model's own children, so the parameter names (and model.safetensors) are
        # TitansLM's: one file format for both classes.
        self.embed, self.backbone, self.head = lm.embed, lm.backbone, lm.head
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate must not make a key/value cache: the state arrives from forward as a TitansCache

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        # TitansLM's modules initialise themselves when built, and from_pretrained loads every parameter; what it
        # leaves empty is the non-persistent buffers, here the constant gates' logits (computed, not saved).
        if isinstance(module, NeuralMemory) and module.to_gates is None:
            module.constant_gate_logits.copy_(module.initial_gate_logits())

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.embed = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        self.head = value

    def forward(self, input_ids: Optional[Tensor] = None, past_key_values: Optional[TitansCache] = None,
                attention_mask: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                use_cache: Optional[bool] = None, inputs_embeds: Optional[Tensor] = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits of `input_ids` [batch, seq] continuing `past_key_values`; `labels` (the inputs, -100 to skip)
        give the mean next-token loss. Positions come from the state, so `position_ids` and the like are ignored."""
        if inputs_embeds is not None:
            raise ValueError("titans models take input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("input_ids is required")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("titans models do not support padding (attention_mask with zeros): the recurrent state "
                             "would read the pad tokens; give sequences of one length")
        if past_key_values is not None and not isinstance(past_key_values, TitansCache):
            raise ValueError(f"past_key_values must be a TitansCache (from an earlier call), got "
                             f"{type(past_key_values).__name__}")
        check_tokens(input_ids, self.config.vocab_size)
        state = past_key_values.state if past_key_values is not None else None
        hidden, state = self.backbone(self.embed(input_ids), state)
        logits = self.head(hidden)
        loss = None
        if labels is not None:  # Hugging Face's convention: labels are the inputs; position t predicts t + 1
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        cache = None
        if use_cache is not False:
            seen = (past_key_values.seen_tokens if past_key_values is not None else 0) + input_ids.shape[1]
            cache = TitansCache(state, seen)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)


AutoConfig.register(MODEL_TYPE, TitansHFConfig, exist_ok=True)
AutoModelForCausalLM.register(TitansHFConfig, TitansForCausalLM, exist_ok=True)
