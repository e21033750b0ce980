"""The memory's inner loss ℓ(e), e = M(k) − v: its attentional bias (MIRAS, Behrouz et al., arXiv 2504.13173), defined
once for Python.

Titans' memory learns by gradient descent on ℓ_t(W) = Σ_j h(e_j), summed over the output's coordinates (paper eq. 12:
the squared loss, h(e) = e², no ½). MIRAS shows Titans as one point of a family whose other members change h; two of
them are here, Yaad's Huber loss and Moneta's ℓp. Every implementation of the update reads the loss through the four
functions each loss defines, elementwise on e `[..., d_out]` and a per-token gate `[...]` (or None):

    value(e, gate)            h(e), what ℓ_t sums: the surprise of the surprise-gated θ, and the token-by-token
                              reference, which differentiates it by autograd (an independent check of the rest)
    grad(e, gate)             g(e) = h'(e) = ∂ℓ_t/∂M(k_t): the last layer's δ, from which the chunk backpropagates
    grad_derivative(e, gate)  g'(e): the hand-written backward passes' ∂L/∂e = ∂L/∂δ_L ⊙ g'(e)
    gate_derivative(e, gate)  ∂g/∂gate: the gate's outer gradient, Σ_j ∂L/∂δ_L ⊙ ∂g/∂gate (gated losses only)

The C++ chunk loop has the same functions in `kernels/losses.h`; the Triton kernels have their own block (and
`triton_chunk.unsupported` refuses a loss they lack, naming an implementation that serves it). A loss is one class
here, registered in `LOSSES` under its `name`, with its config fields (validated like every config: a frozen pydantic
model) and its math side by side. docs/EXTENDING.md is the checklist for adding one; tests/memory/test_losses.py
fails where a registered loss lacks a counterpart or a reference test.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

import torch
from pydantic import BeforeValidator, ConfigDict, Field
from torch import Tensor

from ..config import Config

Gate = Optional[Tensor]  # the loss's per-token parameter [..., n] (Huber's δ_t), None for an ungated loss


class Loss(Config):
    """One inner loss: a frozen config (its name and parameters) whose methods are its math (module docstring).
    Losses with a gate (`has_gate`) take a per-token parameter from the data (`NeuralMemory` computes it from x, like
    θ, η, α)."""

    model_config = ConfigDict(frozen=True)

    @property
    def has_gate(self) -> bool:
        """Whether the loss takes a per-token parameter from the data (its `gate`)."""
        return False

    def native_params(self) -> tuple[float, float]:
        """The loss's two numbers as the C++ loop reads them (`kernels/losses.h`)."""
        return (0.0, 0.0)

    def gate_from_logit(self, logit: Tensor) -> Tensor:
        """A gated loss's per-token parameter from its logit (`NeuralMemory`'s gate projection)."""
        raise NotImplementedError(f"the {self.name} loss takes no gate")

    initial_gate_logit: ClassVar[float] = 0.0  # the gate's bias at initialisation

    def value(self, e: Tensor, gate: Gate = None) -> Tensor:
        raise NotImplementedError

    def grad(self, e: Tensor, gate: Gate = None) -> Tensor:
        raise NotImplementedError

    def grad_derivative(self, e: Tensor, gate: Gate = None) -> Union[Tensor, float]:
        raise NotImplementedError

    def gate_derivative(self, e: Tensor, gate: Tensor) -> Tensor:
        raise NotImplementedError(f"the {self.name} loss takes no gate")

    def backward(self, d: Tensor, e: Optional[Tensor], gate: Gate = None) -> tuple[Tensor, Gate]:
        """(∂L/∂e, ∂L/∂gate) from ∂L/∂g (d), the vector-Jacobian products of `grad`: what the hand-written backward
        passes take from the loss (∂L/∂gate summed over the output's coordinates; None without a gate)."""
        d_e = d * self.grad_derivative(e, gate)
        return d_e, (d * self.gate_derivative(e, gate)).sum(-1) if self.has_gate else None

    @property
    def needs_error(self) -> bool:
        """Whether `backward` reads e (the hand-written passes keep it for the backward pass only where it does)."""
        return True


class Squared(Loss):
    """ℓ = Σ_j e_j², the paper's (eq. 12). Its arithmetic is exactly the library's before losses were pluggable
    (2.0 · e forward, 2.0 · d backward), so every result of the default rule is unchanged to the bit."""

    name: Literal["squared"] = "squared"

    def value(self, e: Tensor, gate: Gate = None) -> Tensor:
        return e**2

    def grad(self, e: Tensor, gate: Gate = None) -> Tensor:
        return 2.0 * e

    def grad_derivative(self, e: Tensor, gate: Gate = None) -> float:
        return 2.0

    def backward(self, d: Tensor, e: Optional[Tensor], gate: Gate = None) -> tuple[Tensor, Gate]:
        return 2.0 * d, None

    @property
    def needs_error(self) -> bool:
        return False


class Huber(Loss):
    """Yaad's attentional bias (MIRAS): the coordinate-wise Huber loss, in our convention (no ½, so that δ → ∞ is the
    squared loss): h(e) = e² for |e| ≤ δ, 2δ|e| − δ² beyond; g(e) = 2e inside, 2δ sign(e) beyond (a token's error
    pulls the memory at most 2δ per coordinate: an outlier value cannot drag it far). |e| = δ counts as inside.

    `delta` is δ, or with `gated` its value at initialisation: δ_t = 2 δ · sigmoid(x_t w + b) per token and head
    (δ_max = 2 δ, the bias starting at 0; `NeuralMemory` computes it like θ, η, α and passes it as the loss's gate), the
    data-dependent δ of MIRAS. Where MIRAS's exact parametrisation of δ_t differs, this is ours (DESIGN.md §1).
    The default δ = 0.1 is about one coordinate of a unit value of width 32 to 128 (1/√d: 0.18 to 0.09): the library's
    values are l2-normalised (`normalize_inputs`), so no coordinate of an error exceeds 1 while the memory is near its
    start, and δ ≥ 1 would be the squared loss there."""

    name: Literal["huber"] = "huber"
    delta: float = Field(0.1, gt=0)
    gated: bool = False

    @property
    def has_gate(self) -> bool:
        return self.gated

    def native_params(self) -> tuple[float, float]:
        return (self.delta, 0.0)

    def gate_from_logit(self, logit: Tensor) -> Tensor:
        return 2.0 * self.delta * torch.sigmoid(logit)

    def _delta(self, gate: Gate) -> Union[Tensor, float]:
        return gate.unsqueeze(-1) if self.gated else self.delta

    def value(self, e: Tensor, gate: Gate = None) -> Tensor:
        delta = self._delta(gate)
        return torch.where(e.abs() <= delta, e * e, 2.0 * delta * e.abs() - delta * delta)

    def grad(self, e: Tensor, gate: Gate = None) -> Tensor:
        delta = self._delta(gate)
        return torch.where(e.abs() <= delta, 2.0 * e, 2.0 * delta * torch.sign(e))

    def grad_derivative(self, e: Tensor, gate: Gate = None) -> Tensor:
        return 2.0 * (e.abs() <= self._delta(gate)).to(e.dtype)

    def gate_derivative(self, e: Tensor, gate: Tensor) -> Tensor:
        return torch.where(e.abs() <= gate.unsqueeze(-1), 0.0, 2.0 * torch.sign(e))


class Lp(Loss):
    """Moneta's attentional bias (MIRAS): ℓ = Σ_j |e_j|^p, p > 1, with |e| smoothed to √(e² + ε) so that the gradient
    is continuous at e = 0 for every p (MIRAS smooths it too; this smoothing is ours): h(e) = (e² + ε)^{p/2},
    g(e) = p e (e² + ε)^{p/2 − 1}, g'(e) = p (e² + ε)^{p/2 − 1} (1 + (p − 2) e² / (e² + ε)). At p = 2 the gradient is
    exactly the squared loss's (2.0 · e · 1.0, tested). p < 2 weighs large errors less than the squared loss (robust,
    towards ℓ1); p > 2 more."""

    name: Literal["lp"] = "lp"
    p: float = Field(3.0, gt=1)
    eps: float = Field(1e-6, gt=0)

    def native_params(self) -> tuple[float, float]:
        return (self.p, self.eps)

    def value(self, e: Tensor, gate: Gate = None) -> Tensor:
        return (e * e + self.eps) ** (self.p / 2)

    def grad(self, e: Tensor, gate: Gate = None) -> Tensor:
        return self.p * e * (e * e + self.eps) ** (self.p / 2 - 1)

    def grad_derivative(self, e: Tensor, gate: Gate = None) -> Tensor:
        e2 = e * e
        s = e2 + self.eps
        return self.p * s ** (self.p / 2 - 1) * (1.0 + (self.p - 2) * e2 / s)


# name -> loss: the registry every implementation is held to (tests/memory/test_losses.py)
LOSSES: dict[str, type[Loss]] = {"squared": Squared, "huber": Huber, "lp": Lp}


def _by_name(value: Any) -> Any:
    """`loss: huber` is short for `loss: {name: huber}` (its parameters at their defaults)."""
    return {"name": value} if isinstance(value, str) else value


# A loss in a config: a mapping with its `name` and parameters, or the bare name.
AnyLoss = Annotated[Union[tuple(LOSSES.values())], Field(discriminator="name"), BeforeValidator(_by_name)]
