"""Baselines in the same block structure: Transformer++, sliding-window attention, LSTM, Gated DeltaNet.

Gated DeltaNet is a configuration of our memory layer (projections, short convs, l2-normalised q/k, gates,
output norm and gate): a matrix memory (depth 1, no residual, no momentum) whose every token takes its
gradient at the weights the previous token left, W_t = (1 − α_t) W_{t−1} − 2 θ_t k_tᵀ(k_t W_{t−1} − v_t): the
gated delta rule (Yang et al., 2024), computed exactly and chunk-parallel by `memory/delta.py`. (Titans'
own chunk-wise gradients would make it a mini-batch rule whose outputs depend on the chunk size.)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn

from ..layers import Attention, check_state_shapes, check_state_type
from ..layers.attention import one_token
from ..memory import NeuralMemory
from .common import build_memory, build_window_attention
from .config import TitansConfig


def build_transformer_mixer(cfg: TitansConfig) -> Attention:
    return Attention(cfg.dim, cfg.heads, window=None, rope_base=cfg.attention.rope_base, dropout=cfg.dropout)


def build_swa_mixer(cfg: TitansConfig) -> Attention:
    return build_window_attention(cfg)


# What Gated DeltaNet's memory fixes of the config's rule: the exact delta rule (per-token gradients, no momentum, the
# squared loss) with GDN's own gates, values and step. The rest (init_alpha, gate_pooling, the structure) is the
# config's.
GATED_DELTANET_RULE = dict(momentum=False, residual=False, gradients="token", normalize_inputs=False,
                           max_grad_norm=None, max_state_norm=None, normalize_chunk=False, max_lr=0.5,
                           init_theta=0.25, forgetting=True, forgetting_channels=False, gates="data",
                           max_momentum_step=None, loss="squared")


def build_gated_deltanet_mixer(cfg: TitansConfig) -> NeuralMemory:
    # GDN's own step: β_t = 2 θ_t ∈ (0, 1) (θ_max = 0.5), 0.5 at initialisation; its state and values as GDN has them
    # (no bounds, no normalised values: the delta rule with unit keys and β ≤ 1 never expands its state).
    # The Titans ablation switches (memory_forgetting, memory_gates) do not reach it: it keeps its own gates.
    return build_memory(cfg, cfg.memory.rule.replace(**GATED_DELTANET_RULE), depth=1)


@dataclasses.dataclass
class LSTMState:
    h: Tensor  # [1, batch, dim]
    c: Tensor


@dataclasses.dataclass
class StaticLSTMState:
    """The LSTM's state for static decoding (`titans.models.StaticDecoder`): the same tensors, written in place."""

    h: Tensor
    c: Tensor

    def dynamic(self) -> LSTMState:
        return LSTMState(self.h.clone(), self.c.clone())


class LSTMMixer(nn.Module):
    """One LSTM layer as the mixer of a pre-norm block (so it gets the same MLPs and norms)."""

    def __init__(self, cfg: TitansConfig):
        super().__init__()
        self.lstm = nn.LSTM(cfg.dim, cfg.dim, batch_first=True)
        self.register_state_dict_post_hook(_weights_of_their_own)

    def forward(self, x: Tensor, state: Optional[LSTMState] = None) -> tuple[Tensor, LSTMState]:
        if isinstance(state, StaticLSTMState):
            one_token("LSTMMixer", x)
            y, new = self(x, LSTMState(state.h, state.c))
            state.h.copy_(new.h)
            state.c.copy_(new.c)
            return y, state
        if state is not None:
            check_state_type("LSTMMixer", state, LSTMState)
            size = (self.lstm.num_layers, x.shape[0], self.lstm.hidden_size)
            check_state_shapes("LSTMMixer", {"h": (state.h, size), "c": (state.c, size)})
        if x.shape[1] == 0:  # torch's LSTM refuses an empty sequence: no step, the state carries over
            if state is None:
                zeros = x.new_zeros(self.lstm.num_layers, x.shape[0], self.lstm.hidden_size)
                state = LSTMState(zeros, zeros.clone())
            return x.new_zeros(x.shape[0], 0, self.lstm.hidden_size), state
        hc = (state.h, state.c) if state is not None else None
        if x.is_cpu and torch.is_autocast_enabled("cpu"):
            # oneDNN has no bf16 LSTM on CPUs without AVX-512 BF16 (it raises "could not create a primitive
            # descriptor"); on the CPU the recurrence runs in float32 under autocast, as cuDNN's would in its own dtype.
            with torch.autocast("cpu", enabled=False):
                y, (h, c) = self.lstm(x.float(), hc)
        else:
            y, (h, c) = self.lstm(x, hc)
        return y, LSTMState(h, c)


def _weights_of_their_own(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """On CUDA, cuDNN packs an LSTM's weights into one buffer and each parameter is a view of a part of it; safetensors
    refuses to save tensors that share a storage none of them covers, so a GPU model's checkpoint and save_pretrained
    would fail. The state dict gives such views a storage of their own (elsewhere it is unchanged: no copy)."""
    for name, tensor in state_dict.items():
        if name.startswith(prefix) and tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            state_dict[name] = tensor.clone()


def build_lstm_mixer(cfg: TitansConfig) -> LSTMMixer:
    return LSTMMixer(cfg)
