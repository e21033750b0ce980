"""The checks every layer runs on a state handed back to it: is it one this layer could have returned?

A state from another variant, model size or batch size would otherwise fail deep inside a `cat` or a
matmul with a message about tensor numbers or, where the shapes happen to fit, run on silently.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, Mapping, Optional

import torch
from torch import Tensor

Sizes = tuple[Optional[int], ...]  # None: a size that may vary (a cache's length)

_trusted: ContextVar[bool] = ContextVar("titans_trusted_states", default=False)


@contextlib.contextmanager
def trusted_states() -> Iterator[None]:
    """Inside it, every state handed to a layer is one the model itself has just returned (generation's token loop,
    after the prompt's call checked the caller's state), so the layers skip checking it: per token, the checks cost
    more Python than the small models' arithmetic."""
    token = _trusted.set(True)
    try:
        yield
    finally:
        _trusted.reset(token)


def states_trusted() -> bool:
    """Whether the states are the model's own (inside `trusted_states`): the checks below then return at once.

    While torch.compile traces (generation's compiled step), the answer is no: dynamo cannot read a ContextVar (a
    graph break at every layer), and traced, the shape checks below cost nothing per call (they become the
    graph's guards)."""
    return not torch.compiler.is_compiling() and _trusted.get()


def check_state_type(owner: str, state: object, cls: type) -> None:
    if states_trusted():
        return
    if not isinstance(state, cls):
        raise ValueError(f"{owner} continues from a state of type {cls.__name__}, got {type(state).__name__} "
                         "(a state from another kind of model?)")


def check_state_shapes(owner: str, shapes: Mapping[str, tuple[Tensor, Sizes]]) -> None:
    """`shapes`: field name -> (tensor, expected sizes); a ValueError names the first field that differs."""
    if states_trusted():
        return
    for name, (tensor, expected) in shapes.items():
        if tensor.dim() != len(expected) or any(e is not None and s != e for s, e in zip(tensor.shape, expected)):
            want = ", ".join("*" if e is None else str(e) for e in expected)
            raise ValueError(f"{owner}: state.{name} has shape {list(tensor.shape)}, expected [{want}] "
                             "(a state from a model of another size, or from another batch size?)")


class DecodeClock:
    """The count of one-token steps a static decode state has taken, on both sides (`titans.models.StaticDecoder`).

    `steps` is the host's: a step's Python reads it where control flow depends on the position (how many tokens a
    memory's chunk holds, whether a MAC segment ends), so a captured CUDA graph is chosen by it and never reads the
    device. `device_steps` is the same count on the device, advanced inside the step: what a captured graph reads for
    everything that varies from token to token without changing shapes (RoPE positions, ring-buffer slots, masks)."""

    def __init__(self, device: torch.device):
        self.steps = 0
        self.device_steps = torch.zeros(1, dtype=torch.long, device=device)
