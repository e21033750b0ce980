"""Does the memory stay finite? `titans bench stability`: the inner loop's rule against the paper's, in one run.

Two sweeps, each run with the library's default rule ("ours": unit values, gates from the RMS-normalised input, the
per-token gradient bound, the bounded state and the normalised chunk step, DESIGN.md §1) and with the paper's
unbounded rule ("paper"):

* **streams**: `NeuralMemory` with its defaults but for the swept fields (depth, activation, momentum, chunk size),
  random inputs `randn · scale` streamed through one state, without gradients (test time) and, for the first
  `train_tokens`, with a backward pass (training), in float32 or under bf16 autocast. Gates at their initialisation
  ("init"), or at their worst ("worst": θ = θ_max, η = 1, α = 0 on every token, the regime a trained model that wants
  long memory drifts towards). A stream is finite when every output, state and gradient is.
* **training**: a memory layer and a linear read-out trained with AdamW to recall the input seen `delay` tokens
  earlier, for each input scale × memory depth × learning rate; a run is finite when its loss and parameters are
  after `steps` steps (the trainer's skip of non-finite steps is not used here: a skipped run counts as diverged).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ..memory import MemoryRule, NeuralMemory

RULES = {
    "ours": MemoryRule(),  # the layer's defaults
    "paper": MemoryRule.paper(),
}
STRUCTURE = ("depth", "expansion", "chunk_size")  # NeuralMemory's arguments beside the rule that the sweeps change
WORST_GATE_LOGITS = (20.0, 20.0, -20.0)  # θ → θ_max, η → 1, α → 0 (the sigmoids saturate)


@dataclass(frozen=True)
class StreamCase:
    rule: str
    depth: int
    activation: str
    momentum: bool
    chunk_size: int
    scale: float
    gates: str  # "init" | "worst"
    dtype: str  # "float32" | "bf16-autocast"


@dataclass
class StreamResult:
    case: StreamCase
    finite: bool  # outputs, states and the outer gradients of the training pieces
    tokens: int  # tokens streamed (fewer than asked where it stopped at the first non-finite value)
    max_state_norm: float  # largest ‖W_i‖_F / √d_out and ‖S_i‖_F / √d_out seen at a call's end (inf when not finite)
    seconds: float
    forward_finite: bool  # outputs and states alone (test time's view; `finite` adds the gradients)
    max_grad: float  # largest |entry| of the parameters' gradients over the training pieces (inf when not finite)


def build_memory(rule: str, dim: int, heads: int, **fields) -> NeuralMemory:
    """The memory under rule `rule` ("ours", "paper") with `fields` changed: its structure, or fields of the rule."""
    structure = {name: fields.pop(name) for name in STRUCTURE if name in fields}
    return NeuralMemory(dim, heads=heads, rule=RULES[rule].replace(**fields), **structure)


def _set_worst_gates(memory: NeuralMemory) -> None:
    with torch.no_grad():
        bias = memory.to_gates.bias.view(3, memory.heads)
        for row, value in zip(bias, WORST_GATE_LOGITS):
            row.fill_(value)


def _state_norm(state) -> float:
    worst = 0.0
    for t in (*state.weights, *state.momentum):
        norm = torch.linalg.vector_norm(t, dim=(-2, -1)).max().item() / math.sqrt(t.shape[-1])
        worst = max(worst, norm if math.isfinite(norm) else math.inf)
    return worst


def run_stream(case: StreamCase, tokens: int, train_tokens: int, dim: int = 32, heads: int = 2, piece: int = 4096,
               seed: int = 0) -> StreamResult:
    """Stream `tokens` random inputs through one memory; the first `train_tokens` with a backward pass (each piece
    of at most `piece` tokens its own backward pass, as a training loop over windows of a long stream would)."""
    torch.manual_seed(seed)
    memory = build_memory(case.rule, dim, heads, depth=case.depth, activation=case.activation,
                          momentum=case.momentum, chunk_size=case.chunk_size)
    if case.gates == "worst":
        _set_worst_gates(memory)
    generator = torch.Generator().manual_seed(seed + 1)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.dtype == "bf16-autocast")
    state, done, worst, max_grad, start = None, 0, 0.0, 0.0, time.perf_counter()
    forward_finite = grads_finite = True
    while done < tokens and forward_finite and grads_finite:
        training = done < train_tokens
        n = min(piece, tokens - done, train_tokens - done if training else tokens)
        x = torch.randn(1, n, dim, generator=generator) * case.scale
        with autocast, torch.set_grad_enabled(training):
            y, state = memory(x, state)
            forward_finite = bool(torch.isfinite(y).all())
            if training and forward_finite:
                memory.zero_grad()
                y.float().pow(2).mean().backward()
                largest = max(p.grad.abs().max().item() for p in memory.parameters() if p.grad is not None)
                grads_finite = math.isfinite(largest)
                max_grad = max(max_grad, largest) if grads_finite else math.inf
        state = _detached(state)
        norm = _state_norm(state)
        forward_finite = forward_finite and math.isfinite(norm)
        worst = max(worst, norm)
        done += n
    finite = forward_finite and grads_finite
    return StreamResult(case, finite, done, worst if forward_finite else math.inf, time.perf_counter() - start,
                        forward_finite, max_grad)


def _detached(state):
    """The state without its autograd history (a stream continues from values; training stops at each piece)."""
    return dataclasses.replace(
        state, weights=tuple(w.detach() for w in state.weights), momentum=tuple(s.detach() for s in state.momentum),
        conv_cache=state.conv_cache.detach(), pending_k=state.pending_k.detach(), pending_v=state.pending_v.detach(),
        pending_gates=state.pending_gates.detach())


@dataclass(frozen=True)
class TrainCase:
    rule: str
    depth: int
    scale: float
    lr: float


@dataclass
class TrainResult:
    case: TrainCase
    finite: bool
    final_loss: float  # inf where the run diverged
    steps: int  # steps run (it stops at the first non-finite loss or parameter)


def run_training(case: TrainCase, steps: int, dim: int = 32, heads: int = 2, seq: int = 256, batch: int = 4,
                 delay: int = 48, seed: int = 0) -> TrainResult:
    """Train memory + read-out to output the input of `delay` tokens ago (beyond the conv's reach: the memory must
    hold it), inputs `randn · scale`, target the unscaled input; AdamW at `case.lr`, gradient clipping at 1."""
    torch.manual_seed(seed)
    memory = build_memory(case.rule, dim, heads, depth=case.depth)
    readout = torch.nn.Linear(dim, dim)
    params = [*memory.parameters(), *readout.parameters()]
    optimizer = torch.optim.AdamW(params, lr=case.lr)
    generator = torch.Generator().manual_seed(seed + 1)
    loss = torch.tensor(math.inf)
    for step in range(steps):
        x = torch.randn(batch, seq, dim, generator=generator)
        y, _ = memory(x * case.scale)
        loss = F.mse_loss(readout(y)[:, delay:], x[:, :-delay])
        if not torch.isfinite(loss):
            return TrainResult(case, False, math.inf, step + 1)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if not all(bool(torch.isfinite(p).all()) for p in params):
            return TrainResult(case, False, math.inf, step + 1)
    return TrainResult(case, True, loss.item(), steps)


@dataclass
class StabilityGrid:
    depths: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    activations: list[str] = field(default_factory=lambda: ["gelu", "silu"])
    momenta: list[bool] = field(default_factory=lambda: [True, False])
    chunk_sizes: list[int] = field(default_factory=lambda: [1, 16, 64])
    scales: list[float] = field(default_factory=lambda: [1e-3, 1.0, 1e3])
    gates: list[str] = field(default_factory=lambda: ["init", "worst"])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bf16-autocast"])
    lrs: list[float] = field(default_factory=lambda: [1e-3, 1e-2, 1e-1])
    rules: list[str] = field(default_factory=lambda: list(RULES))

    def stream_cases(self) -> list[StreamCase]:
        return [StreamCase(*values) for values in itertools.product(
            self.rules, self.depths, self.activations, self.momenta, self.chunk_sizes, self.scales, self.gates,
            self.dtypes)]

    def train_cases(self) -> list[TrainCase]:
        return [TrainCase(*values) for values in itertools.product(self.rules, self.depths, self.scales, self.lrs)]


def summarize(results: list, axes: list[str]) -> dict[str, dict[str, str]]:
    """Per rule, the fraction of finite runs overall and along each axis: {"ours": {"all": "96/96", ...}}."""
    table: dict[str, dict[str, list[int]]] = {}
    for r in results:
        row = table.setdefault(r.case.rule, {})
        keys = ["all"] + [f"{axis}={getattr(r.case, axis)}" for axis in axes]
        for key in keys:
            counts = row.setdefault(key, [0, 0])
            counts[0] += r.finite
            counts[1] += 1
    def order(key: str) -> int:  # "all", then the axes in the order given, each axis's values as first met
        return 0 if key == "all" else 1 + axes.index(key.split("=")[0])

    return {rule: {key: f"{row[key][0]}/{row[key][1]}" for key in sorted(row, key=order)}
            for rule, row in table.items()}


def as_json(results: list) -> list[dict]:
    out = []
    for r in results:
        record = asdict(r)
        record.update(record.pop("case"))
        for key, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                record[key] = None  # JSON has no inf: null where the run diverged
        out.append(record)
    return out


def format_summary(title: str, summary: dict[str, dict[str, str]]) -> str:
    keys = list(next(iter(summary.values())))
    lines = [f"{title}", "| " + " | ".join(["finite runs"] + list(summary)) + " |",
             "|---|" + "---:|" * len(summary)]
    for key in keys:
        lines.append("| " + " | ".join([key] + [summary[rule].get(key, "-") for rule in summary]) + " |")
    return "\n".join(lines)


def largest_state(results: list[StreamResult], rule: str) -> Optional[float]:
    """The largest state norm (relative to √d_out) any finite stream of `rule` reached."""
    norms = [r.max_state_norm for r in results if r.case.rule == rule and r.finite]
    return max(norms) if norms else None


def describe_streams(results: list[StreamResult], rule: str) -> str:
    """One line: the streams of `rule` whose outputs and states stayed finite, the largest outer-gradient entry of a
    finite stream, and the streams that failed, by case."""
    mine = [r for r in results if r.case.rule == rule]
    forward = sum(r.forward_finite for r in mine)
    grads = [r.max_grad for r in mine if r.finite]
    failed = [r for r in mine if not r.finite]
    line = (f"{rule}: outputs and states finite in {forward}/{len(mine)} streams; largest state norm "
            f"(‖·‖_F / √d_out) of a finite stream {largest_state(results, rule)}; largest outer-gradient entry of a "
            f"finite stream {max(grads) if grads else None}")
    shown = 12
    if failed:
        line += "; not finite: " + "; ".join(
            f"depth {r.case.depth} {r.case.activation} momentum {'on' if r.case.momentum else 'off'} chunk "
            f"{r.case.chunk_size} scale {r.case.scale:g} {r.case.gates} {r.case.dtype}"
            + (" (gradients)" if r.forward_finite else " (outputs or states)") for r in failed[:shown])
        if len(failed) > shown:
            line += f"; and {len(failed) - shown} more"
    return line
