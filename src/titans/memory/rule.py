"""`MemoryRule`: everything that defines the memory's inner update, one frozen, validated value (DESIGN.md §1).

The paper fixes the update (eqs. 10-14): the loss ℓ_t(W) = Σ_j h(M(k_t; W)_j − v_t,j), its gradient taken at the
chunk's starting weights, the momentum S_t = η_t S_{t−1} − θ_t ∇ℓ_t and the forgetting W_t = (1 − α_t) W_{t−1} + S_t,
with θ, η, α computed from the input. What the paper leaves open, and what the library adds to keep the update stable
(DESIGN.md §1, "Stable by default"), is a field here too, each a switch. A rule is a value: it travels whole from the
config (`TitansConfig.memory`) through `NeuralMemory` to `parallel_memory`, `sequential_memory`,
`memory_token_step`, the fused scan, its C++ loop and the Triton kernels, and every one of them reads the same fields.

Two kinds of fields, both part of one rule:

* the update given the gates (what the functional core reads): `loss`, `activation`, `residual`, `max_grad_norm`,
  `max_state_norm`, `normalize_chunk`, `hidden_step`, and `max_momentum_step` (κ, applied to θ where `gates` is
  "data": `bounded_theta`, the one place it is written);
* how `NeuralMemory` makes the gates from x: `momentum`, `forgetting`, `forgetting_channels`, `gates`, `max_lr`,
  `init_theta`, `init_eta`, `init_alpha`, `normalize_inputs`, `surprise_gate`, `gate_pooling`, and where each token's
  gradient is taken (`gradients`).

The defaults are the library's stable rule; `MemoryRule.paper()` is the paper's (no bounds, the summed chunk step,
free gates, gates and values from x as it comes), for ablations and tests. Every default and every check of a rule is
written here, once; a bad value is a `ConfigError` (a ValueError) naming the field (`memory.max_lr: must be > 0`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional

from pydantic import ConfigDict, Field, model_validator
from torch import Tensor

from ..config import Config
from .losses import AnyLoss, Squared

if TYPE_CHECKING:  # an annotation only: checks.py imports this module
    from .checks import Theta


class MemoryRule(Config):
    """The memory's update rule (module docstring). Frozen: `rule.replace(loss="huber")` makes another."""

    model_config = ConfigDict(frozen=True)

    # The inner loss h (paper eq. 12: squared; MIRAS: huber, lp), `losses.py`. `loss: huber` names one with its
    # parameters at their defaults.
    loss: AnyLoss = Field(default_factory=Squared)
    activation: Literal["gelu", "silu"] = "gelu"  # σ between the memory MLP's layers (paper: GELU)
    # M(k) = k + MLP(k) instead of the paper's MLP(k) (not in the paper; it cost recall, DESIGN.md §1)
    residual: bool = False
    # c: token t steps with θ_t · min(1, c / ‖∇ℓ_t‖), all layers together (not in the paper); None: unbounded
    max_grad_norm: Optional[float] = Field(4.0, gt=0)
    # the bounded state: each W_i, S_i back on ‖·‖_F ≤ this · √d_out at every chunk end (not in the paper);
    # None: unbounded
    max_state_norm: Optional[float] = Field(10.0, gt=0)
    # the normalised chunk step: a chunk's overlapping gradients share one step (not in the paper); False: summed
    normalize_chunk: bool = True
    # ρ: every layer but the last steps ρ θ (1: the paper; 0: the hidden layers keep W_0 at test time)
    hidden_step: float = Field(1.0, ge=0, le=1)
    # κ: θ_t ≤ κ (1 − η_t), a bound on the learned gates' momentum gain (not in the paper); None: the paper's free gates
    max_momentum_step: Optional[float] = Field(1.0, gt=0)
    momentum: bool = True  # η (past surprise); False: η = 0
    forgetting: bool = True  # α; False: α = 0, the paper's "w/o weight decay"
    forgetting_channels: bool = False  # α per output channel of every memory layer (the paper's later version)
    gates: Literal["data", "constant"] = "data"  # constant: θ, η, α fixed at init_* for every token, not trained
    max_lr: float = Field(1.0, gt=0)  # θ_max (with unit keys, θ = 0.5 writes a value exactly)
    init_theta: Optional[float] = Field(None, gt=0)  # θ at initialisation, below max_lr; None: 0.2 max_lr
    init_eta: float = Field(0.1, gt=0, lt=1)  # η at initialisation
    init_alpha: float = Field(1e-5, gt=0, lt=1)  # α at initialisation: a write keeps ≈ (1 − α)^n after n tokens
    normalize_inputs: bool = True  # values l2-normalised, gates from the RMS-normalised x (not in the paper)
    surprise_gate: bool = False  # θ_t = θ_max sigmoid(x_t w_θ + b_θ + w_s log(1 + ℓ_t at the chunk's start))
    gate_pooling: Literal["token", "chunk"] = "token"  # chunk: each chunk takes its first token's gates
    # where each token's gradient is taken: at its chunk's start (the paper's mini-batch form) or at the previous
    # token's weights (the exact gated delta rule, `delta.py`: depth 1, no momentum, no bounds, the squared loss)
    gradients: Literal["chunk", "token"] = "chunk"

    @classmethod
    def paper(cls, **changes: Any) -> MemoryRule:
        """The paper's rule: the update of eqs. 10-14 with nothing of DESIGN.md §1 added (no bounds, a chunk's
        gradients summed, free gates, values and gates from x as it comes); `changes` on top."""
        return cls(**{**PAPER, **changes})

    @model_validator(mode="after")
    def check_rules(self) -> MemoryRule:
        if self.init_theta is not None and not self.init_theta < self.max_lr:
            raise ValueError(f"init_theta must be in (0, max_lr = {self.max_lr}), got {self.init_theta}")
        if self.gates == "constant" and self.surprise_gate:
            raise ValueError("gates='constant' fixes θ, so it cannot be combined with surprise_gate=True")
        if self.gradients == "token":
            clashes = {name: getattr(self, name) for name, allowed in TOKEN_GRADIENTS.items()
                       if getattr(self, name) != allowed}
            if self.loss.name != "squared":
                clashes["loss"] = self.loss.name
            if clashes:
                raise ValueError(
                    "gradients='token' (the exact delta rule, memory/delta.py) serves momentum=False, "
                    "surprise_gate=False, max_grad_norm=None, max_state_norm=None, normalize_chunk=False, "
                    "forgetting_channels=False and the squared loss; got "
                    + ", ".join(f"{name}={value!r}" for name, value in clashes.items())
                    + " (gradients='chunk' serves every rule and loss)")
        return self

    @property
    def initial_theta(self) -> float:
        """θ at initialisation: `init_theta`, or 0.2 θ_max."""
        return 0.2 * self.max_lr if self.init_theta is None else self.init_theta

    def layer_step(self, i: int, depth: int) -> float:
        """Layer i's inner step as a fraction of θ: ρ for a hidden layer, 1 for the last."""
        return self.hidden_step if i < depth - 1 else 1.0


# The paper's rule, as changes to the defaults (`MemoryRule.paper`).
PAPER: dict[str, Any] = dict(normalize_inputs=False, max_grad_norm=None, max_state_norm=None, normalize_chunk=False,
                             max_momentum_step=None)
# What gradients='token' (the exact delta rule) needs of the other fields, beside the squared loss and depth 1.
TOKEN_GRADIENTS: dict[str, Any] = dict(momentum=False, surprise_gate=False, max_grad_norm=None, max_state_norm=None,
                                       normalize_chunk=False, forgetting_channels=False)


def momentum_bound(rule: MemoryRule, eta: Tensor) -> Optional[Tensor]:
    """κ (1 − η_t), the most θ_t may be under the bound on the momentum's gain, or None where the rule has none.

    Eqs. 13-14 are a heavy ball: once the surprise has built up, a token's gradient moves the memory about
    θ_t / (1 − η_t), so gates that learn a large θ_t and an η_t near 1 together make a step many times θ_max
    (DESIGN.md §1 (5)). Constant gates are the numbers given and are not bounded."""
    if rule.max_momentum_step is None or rule.gates != "data":
        return None
    return rule.max_momentum_step * (1 - eta)


def bounded_theta(rule: MemoryRule, theta: Theta, eta: Tensor) -> Theta:
    """θ_t under the bound on the momentum's gain, min(θ_t, κ (1 − η_t)), for θ `[b, h, seq]` or the surprise-gated θ
    (a callable `(surprise, start, end) -> θ` of tokens start..end). What the functional core applies before any chunk
    path, so that every implementation, the token-by-token reference and the one-token step see the same θ."""
    bound = momentum_bound(rule, eta)
    if bound is None:
        return theta
    if isinstance(theta, Tensor):
        return theta.minimum(bound)

    def bounded(surprise: Tensor, start: int, end: int) -> Tensor:
        return theta(surprise, start, end).minimum(bound[:, :, start:end])

    return bounded
