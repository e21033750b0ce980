"""Static decoding: generation's one-token step over a state whose tensors keep their shapes and addresses from token
to token, so that on a GPU the step is captured in CUDA graphs and replayed (`TitansLM.generate(decode="graph")`).

Each layer's state has a static form beside its own, defined in the layer's file (`StaticKVCache`,
`StaticSegmentCache`, `StaticMemoryState`, `StaticMACState`, `StaticLSTMState`), and the layer's `forward` steps it in
place when handed one. What varies from token to token without changing a shape (RoPE positions, ring-buffer slots,
attention masks) is computed on the device from the clock's device count; what changes the step's shapes or branches
(how many tokens the memory's chunk holds, whether a MAC segment ends) is read by the step's Python from the clock's
host count, which the host knows without asking the device. Those host values are the step's *phase*: one graph per
phase, captured the second time the phase comes (the first runs eagerly, which is also the warm-up a capture needs).
DESIGN.md §2, "Decoding on a GPU" has why the chunk's end is a phase and not a branch-free step.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

import torch
from torch import Tensor, nn

from ..layers import DecodeClock, KVCache, trusted_states
from ..memory import MemoryState
from .baselines import LSTMState, StaticLSTMState
from .mac import MACState
from .mag import AttentionMemoryState

DECODES = ("dynamic", "compiled", "static", "graph")


def static_state(mixer: nn.Module, state: Any, clock: DecodeClock, steps: int) -> Any:
    """A block's state (after at least one token) in its static form, for at most `steps` more tokens."""
    if isinstance(state, MemoryState):  # lmm, gated_deltanet
        return mixer.static_state(state, clock)
    if isinstance(state, KVCache):  # transformer, swa
        return mixer.static_cache(state, clock, steps)
    if isinstance(state, AttentionMemoryState):  # mag, mal
        return AttentionMemoryState(mixer.attention.static_cache(state.attention, clock, steps),
                                    mixer.memory.static_state(state.memory, clock))
    if isinstance(state, MACState):
        return mixer.static_state(state, clock)
    if isinstance(state, LSTMState):
        return StaticLSTMState(state.h.clone(), state.c.clone())
    raise ValueError(f"static decoding has no static form of a {type(state).__name__} state")


def dynamic_state(state: Any) -> Any:
    """A block's static state as the state the dynamic step would hold now (copies)."""
    if isinstance(state, AttentionMemoryState):
        return AttentionMemoryState(state.attention.dynamic(), state.memory.dynamic())
    return state.dynamic()


def phased(state: Any) -> list[Any]:
    """The parts of a block's static state whose host values a step reads (those with a `phase`)."""
    if hasattr(state, "phase"):
        return [state]
    return [part for part in vars(state).values() if hasattr(part, "phase")]


class StaticDecoder:
    """`model`'s one-token steps over a static copy of `state` (the model's state after at least one token), for at most
    `max_steps` tokens (full attention's key buffer is sized by it).

    `step(tokens [batch, 1])` returns the logits `[batch, vocab]` of the next token; `state()` the state the dynamic
    step would hold after the same tokens. With `graphs` (a CUDA model), each step replays the CUDA graph of its phase
    (module docstring); the graphs share one memory pool, and the logits a step returns live in it: read them (sample)
    before the next step. Without, the same step runs eagerly on any device (what the CPU tests hold to the dynamic
    step)."""

    @torch.no_grad()  # an inference step: its in-place writes must not join an autograd graph
    def __init__(self, model: nn.Module, state: list, max_steps: int, graphs: bool = False):
        device = model.embed.weight.device
        if graphs and (device.type != "cuda" or not torch.cuda.is_available()):
            raise ValueError(f"CUDA graphs need a model on a CUDA device, this one is on {device} "
                             "(decode='static' runs the same static step without graphs)")
        if graphs and model.training:
            raise ValueError("CUDA graphs replay an inference step: call model.eval() first (a graph would replay one "
                             "dropout mask, and the memory's training counters would not count)")
        if not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"max_steps must be an integer >= 0, got {max_steps!r}")
        blocks = model.backbone.blocks
        if not isinstance(state, list) or len(state) != len(blocks) or any(s is None for s in state):
            raise ValueError(f"state must be the model's state after at least one token (a list of {len(blocks)} "
                             "block states)")
        self.model, self.max_steps = model, max_steps
        self.clock = DecodeClock(device)
        self.blocks = [static_state(block.mixer, s, self.clock, max_steps) for block, s in zip(blocks, state)]
        self._phased = [part for s in self.blocks for part in phased(s)]
        self.tokens: Optional[Tensor] = None  # the step's input buffer, made by the first step
        self._graphs: Optional[dict[Hashable, tuple[torch.cuda.CUDAGraph, Tensor]]] = {} if graphs else None
        self._seen: set[Hashable] = set()
        self._pool = None

    def phase(self) -> tuple:
        return tuple(part.phase() for part in self._phased)

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        if self.clock.steps >= self.max_steps:
            raise ValueError(f"StaticDecoder: all {self.max_steps} steps it was built for are taken (its buffers are "
                             "sized for them); build one with a larger max_steps")
        if self.tokens is None:
            if tokens.dim() != 2 or tokens.shape[1] != 1 or tokens.dtype != torch.long:
                raise ValueError(f"tokens must be a [batch, 1] long tensor, got {tuple(tokens.shape)} {tokens.dtype}")
            self.tokens = tokens.clone()
        elif tokens.shape != self.tokens.shape:
            raise ValueError(f"tokens must keep the shape {tuple(self.tokens.shape)}, got {tuple(tokens.shape)}")
        else:
            self.tokens.copy_(tokens)
        phase = self.phase()
        if self._graphs is None or phase not in self._seen:
            self._seen.add(phase)
            logits = self._run()
        else:
            if phase not in self._graphs:
                self._graphs[phase] = self._capture()
            graph, logits = self._graphs[phase]
            graph.replay()
        self.clock.steps += 1
        return logits

    @torch.no_grad()
    def state(self) -> list:
        return [dynamic_state(s) for s in self.blocks]

    @property
    def captured(self) -> int:
        """How many CUDA graphs this decoder holds."""
        return len(self._graphs or ())

    def _run(self) -> Tensor:
        """One step: every buffer written in place, the clock's device count advanced (the host's by `step`)."""
        with trusted_states():
            logits, _ = self.model._logits(self.tokens, self.blocks)
        self.clock.device_steps.add_(1)
        return logits[:, -1]

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        if torch.is_autocast_enabled("cuda"):  # autocast's cast cache would hold casts made once, at the capture
            raise ValueError("decode through CUDA graphs runs without autocast: cast the model (model.to(dtype)) "
                             "instead")
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._run()
        except RuntimeError as err:  # an operation that cannot be captured (one that reads the device)
            raise RuntimeError(f"capturing the one-token step in a CUDA graph failed: {err} (decode='static' runs the "
                               "same step without graphs)") from err
        if self._pool is None:
            self._pool = graph.pool()
        return graph, logits
