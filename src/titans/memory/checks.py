"""Argument checks shared by `parallel_memory` and `sequential_memory`.

Every failure is a ValueError that names the offending argument, so a shape slip in user code is
reported where it happens instead of as an opaque matmul error deep in the chunk loop.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, TypeVar, Union

import torch
from torch import Tensor

from .mlp import Weights

if TYPE_CHECKING:
    from .rule import MemoryRule

Theta = Union[Tensor, Callable[[Tensor, int, int], Tensor]]
# α_t: one gate per token `[batch, heads, seq]` (the paper), or per channel: one `[batch, heads, seq, d_out]` per layer
Alpha = Union[Tensor, tuple[Tensor, ...]]


class Gates(NamedTuple):
    """θ, η, α and the loss's gate of a run of tokens, as `NeuralMemory` computes them for the functional core."""

    theta: Theta
    eta: Tensor
    alpha: Alpha
    loss_gate: Optional[Tensor] = None

F = TypeVar("F", bound=Callable)


def without_autocast(fn: F) -> F:
    """Run a memory function (or a backward pass: autograd runs it under the caller's autocast) with autocast
    off, on the device of its first tensor argument: the state lives in the weights' dtype (float32 under mixed
    precision), and autocast would hand its matmuls' bf16/fp16 results to the in-place float32 state updates."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, Tensor)), "cpu")
        if not torch.amp.is_autocast_available(device):
            return fn(*args, **kwargs)
        with torch.autocast(device_type=device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def checks_values(t: Tensor) -> bool:
    """Whether the memory functions check the values of `t` (finite, in range), not only its shape and dtype.

    Reading a value back from a GPU waits for the device (one host sync per check, several per layer call), so
    there the value checks run only in debug mode, `TITANS_CHECKS=1`; on the CPU they cost one pass over a
    [batch, heads, seq] gate and always run. Shapes, dtypes and devices are checked on every device."""
    return t.device.type == "cpu" or os.environ.get("TITANS_CHECKS") == "1"


def _check_finite(name: str, t: Tensor) -> None:
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or infinite values")


def check_memory_args(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: Gates,
    weights: Weights,
    momentum: Optional[Weights],
    chunk_size: int,
    rule: MemoryRule,
) -> Weights:
    """Validate the memory call; return the momentum (zeros when None). The rule's own fields were checked when it was
    made (`MemoryRule`); here what depends on the tensors."""
    from .rule import MemoryRule

    if not isinstance(gates, Gates):  # the call before the gates were one argument: q, k, v, θ, η, α, weights
        raise TypeError(f"gates must be titans.memory.Gates(theta, eta, alpha, loss_gate=None), got "
                        f"{type(gates).__name__}")
    theta, eta, alpha, loss_gate = gates

    if not isinstance(rule, MemoryRule):
        raise ValueError(f"rule must be a MemoryRule (titans.memory.MemoryRule), got {type(rule).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seq, dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if q.shape != k.shape:
        raise ValueError(f"q has shape {tuple(q.shape)} but k has shape {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v has shape {tuple(v.shape)}, incompatible with k {tuple(k.shape)}")
    batch, heads, seq, dim = k.shape
    if not isinstance(weights, (tuple, list)) or len(weights) == 0:
        raise ValueError("weights must be a non-empty tuple of [batch, heads, d_in, d_out] tensors")
    expected_in = dim
    for i, w in enumerate(weights):
        if not isinstance(w, Tensor) or w.dim() != 4:
            raise ValueError(f"weights[{i}] must be a [batch, heads, d_in, d_out] tensor")
        if tuple(w.shape[:2]) != (batch, heads):
            raise ValueError(f"weights[{i}] has batch/heads {tuple(w.shape[:2])}, expected {(batch, heads)}")
        if w.shape[2] != expected_in:
            raise ValueError(f"weights[{i}] has d_in {w.shape[2]}, expected {expected_in}")
        if not w.is_floating_point():
            raise ValueError(f"weights[{i}] must be floating point, got {w.dtype}")
        if w.dtype != weights[0].dtype:
            raise ValueError(f"weights[{i}] has dtype {w.dtype} but weights[0] has {weights[0].dtype}: the state "
                             "has one dtype")
        expected_in = w.shape[3]
    gates = {"eta": (eta, (batch, heads, seq))}
    if isinstance(theta, Tensor):
        gates = {"theta": (theta, (batch, heads, seq)), **gates}
    elif not callable(theta):
        raise ValueError(f"theta must be a tensor [batch, heads, seq] or a callable, got {type(theta).__name__}")
    if isinstance(alpha, (tuple, list)):  # α per channel: one [batch, heads, seq, d_out] per layer
        if len(alpha) != len(weights):
            raise ValueError(f"alpha per channel needs one tensor per memory layer ({len(weights)}), got {len(alpha)}")
        for i, (a, w) in enumerate(zip(alpha, weights)):
            gates[f"alpha[{i}]"] = (a, (batch, heads, seq, w.shape[3]))
    else:
        gates["alpha"] = (alpha, (batch, heads, seq))
    if rule.loss.has_gate:
        if loss_gate is None:
            raise ValueError(f"loss_gate: the rule's loss ({rule.loss.name}, gated) needs its per-token parameter, a "
                             "tensor [batch, heads, seq]")
        gates["loss_gate"] = (loss_gate, (batch, heads, seq))
    elif loss_gate is not None:
        raise ValueError(f"loss_gate: the rule's loss ({rule.loss.name}) takes no gate; give None")
    for name, (g, shape) in gates.items():
        if not isinstance(g, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(g).__name__}")
        if tuple(g.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(g.shape)}")
        if not g.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {g.dtype}")
    if checks_values(k):
        for name, (g, _) in gates.items():
            _check_finite(name, g)
        # Ranges: θ ≥ 0 is a learning rate; η and 1 − α are decay factors in [0, 1]; the loss's gate (Huber's δ) ≥ 0.
        for name in ("theta", "loss_gate"):
            if name in gates and (gates[name][0] < 0).any():
                raise ValueError(f"{name} must be >= 0")
        for name, (g, _) in gates.items():
            if name not in ("theta", "loss_gate") and ((g < 0) | (g > 1)).any():
                raise ValueError(f"{name} must lie in [0, 1]")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    max_grad_norm = rule.max_grad_norm
    if max_grad_norm is not None:  # its square enters the bound: it must be a normal number of the state's dtype
        info = torch.finfo(weights[0].dtype)
        if not info.tiny**0.5 <= max_grad_norm <= info.max**0.5:
            raise ValueError(f"rule.max_grad_norm must lie in [{info.tiny**0.5:.1e}, {info.max**0.5:.1e}] for "
                             f"{weights[0].dtype} state (its square must be a normal number), got {max_grad_norm!r}")
    if expected_in != v.shape[3]:
        raise ValueError(f"the last of weights outputs {expected_in} features but v has dim {v.shape[3]}")
    if rule.residual and v.shape[3] != dim:
        raise ValueError(f"residual memory needs v dim == k dim, got {v.shape[3]} and {dim}")
    named = {"q": q, "v": v, **{name: g for name, (g, _) in gates.items()}}
    for name, t in {**named, **{f"weights[{i}]": w for i, w in enumerate(weights)}}.items():
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device} but k is on {k.device}")
    if momentum is None:
        return tuple(torch.zeros_like(w) for w in weights)
    if not isinstance(momentum, (tuple, list)) or len(momentum) != len(weights):
        raise ValueError("momentum must be a tuple with one tensor per weight (or None)")
    for i, (s, w) in enumerate(zip(momentum, weights)):
        if not isinstance(s, Tensor) or s.shape != w.shape:
            raise ValueError(f"momentum[{i}] must have the shape of weights[{i}] {tuple(w.shape)}")
        if s.dtype != w.dtype:
            raise ValueError(f"momentum[{i}] has dtype {s.dtype} but weights[{i}] has {w.dtype}: the state has "
                             "one dtype")
        if s.device != w.device:
            raise ValueError(f"momentum[{i}] is on {s.device} but weights[{i}] is on {w.device}")
    return tuple(momentum)
