"""Where a trained MAC's memories get their gradient, block by block: a diagnostic that writes JSON.

    python -m titans.experiments.memory_grads RUN_DIR [--out FILE.json] [--batches 4] [--batch-size 16]

Issue 47: in a trained MAC the second block's memory receives gradients about 100x smaller than the first's. This
reads a run's latest checkpoint and, on batches of its own task at its training length (drawn from the evaluation
stream, as evaluation draws them: sequences training never saw), takes the gradient of the mean loss and reports per
block

- `grad_norm`: the norm of the gradient of each part of the block (the memory's q/k/v projection and conv, its gates,
  its initial weights W_0, its output norm, output gate and projection, and all of the memory together; the
  attention; the MLP; the persistent tokens and the norms), so that a small memory gradient is placed in the part
  that carries it;
- `read_grad_rms` (MAC): the RMS over tokens of the loss's gradient with respect to the memory's two reads, the
  context h (eq. 21) and the gate's read M*_t(y) (eq. 25): how much the loss cares about what each read returns;
- `read_rms` (MAC): the RMS of the reads themselves.

A memory whose reads the loss does not care about (a small `read_grad_rms`) trains little however it is wired;
one whose reads matter but whose parameters get little gradient is flat in them. `ratio_to_first` divides every
block's numbers by the first block's.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

# the memory's parameters by the part of eq. 11-16 they serve (NeuralMemory's attribute names)
MEMORY_PARTS = {"to_qkv": "projection", "conv": "projection", "to_gates": "gates", "surprise_weight": "gates",
                "initial_weights": "initial weights", "out_norm_weight": "output", "to_out_gate": "output",
                "to_out": "output"}


def parameter_groups(block: nn.Module) -> dict[str, list[nn.Parameter]]:
    """A block's parameters by what they are: the memory's parts (`MEMORY_PARTS`) and all of it together, the rest
    of the mixer by attribute (attention, persistent tokens, norms), the MLP and the block's norms."""
    groups: dict[str, list[nn.Parameter]] = defaultdict(list)
    for name, p in block.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["mixer", "memory"]:
            groups[f"memory {MEMORY_PARTS.get(parts[2], parts[2])}"].append(p)
            groups["memory (all)"].append(p)
        elif parts[0] == "mixer":
            groups[f"mixer {parts[1]}"].append(p)
        else:
            groups[parts[0]].append(p)
    return dict(groups)


def norm_of(parameters: list[nn.Parameter]) -> float:
    grads = [p.grad for p in parameters if p.grad is not None]
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads)) if grads else 0.0


class ReadTaps:
    """Hooks on every MAC block's reads: the RMS of each read and of the loss's gradient with respect to it."""

    def __init__(self, blocks: nn.ModuleList):
        self.sums: dict[tuple[int, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
        self.handles = []
        for i, block in enumerate(blocks):
            mixer = block.mixer
            if not hasattr(mixer, "attention") or not hasattr(mixer, "memory") or not hasattr(mixer, "segment_len"):
                continue  # not MAC: its parameters are still measured
            # SegmentAttention(x, h, persistent, cache): h, the context read of eq. 21
            self.handles.append(mixer.attention.register_forward_pre_hook(
                lambda module, args, i=i: self.tap(i, "context", args[1])))
            # NeuralMemory(input, state) -> (M*_t read, state): the gate's read of eq. 25
            self.handles.append(mixer.memory.register_forward_hook(
                lambda module, args, out, i=i: self.tap(i, "gate", out[0])))

    def tap(self, block: int, read: str, t: Tensor) -> None:
        self.add(block, read, "value", t.detach())
        if t.requires_grad:
            t.register_hook(lambda g: self.add(block, read, "grad", g))

    def add(self, block: int, read: str, what: str, t: Tensor) -> None:
        entry = self.sums[(block, read, what)]
        entry[0] += float(t.double().pow(2).sum())
        entry[1] += t.shape[0] * t.shape[1]  # tokens: the RMS is per token, over the width

    def rms(self, block: int, what: str) -> dict[str, float]:
        return {read: math.sqrt(self.sums[(block, read, what)][0] / max(self.sums[(block, read, what)][1], 1))
                for read in ("context", "gate") if (block, read, what) in self.sums}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def memory_gradients(model: nn.Module, batches: list[Any]) -> list[dict[str, Any]]:
    """Per block of `model` (a TitansLM): its gradient norms by part and, for MAC, its reads' RMS and the RMS of the
    loss's gradient with respect to them, for the mean loss over `batches` (TokenBatch), accumulated."""
    from ..train.loop import loss_terms, scored_positions

    blocks = model.backbone.blocks
    taps = ReadTaps(blocks)
    model.zero_grad(set_to_none=True)
    count = sum(scored_positions(batch) for batch in batches)
    try:
        with torch.enable_grad():
            for batch in batches:
                loss, _ = loss_terms(model, batch, torch.device("cpu"))
                (loss / count).backward()
    finally:
        taps.remove()
    result = []
    for i, block in enumerate(blocks):
        entry: dict[str, Any] = {"block": i, "grad_norm": {name: norm_of(ps) for name, ps in
                                                           sorted(parameter_groups(block).items())}}
        if taps.rms(i, "value"):
            entry["read_rms"], entry["read_grad_rms"] = taps.rms(i, "value"), taps.rms(i, "grad")
        result.append(entry)
    return result


def ratios_to_first(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every block's numbers over the first block's (None where the first's is 0)."""
    first = blocks[0]

    def divide(mine: dict[str, float], theirs: dict[str, float]) -> dict[str, float | None]:
        return {key: (value / theirs[key] if theirs.get(key) else None) for key, value in mine.items()}

    return [{"block": b["block"], **{key: divide(b[key], first[key]) for key in ("grad_norm", "read_rms",
                                                                                 "read_grad_rms") if key in b}}
            for b in blocks]


def diagnose(run_dir: Path, batches: int = 4, batch_size: int = 16) -> dict[str, Any]:
    """The JSON of one run: its config and step, the batches read, and every block's numbers."""
    from ..models import TitansLM
    from ..train.batches import EVAL_STREAM, sample_rows
    from ..train.checkpoint import load_trainer_state
    from ..train.loop import load_trained

    path, cfg, task, model = load_trained(run_dir)
    if not isinstance(model, TitansLM):
        raise ValueError(f"{run_dir}: memory_grads reads a TitansLM's blocks; this run trained a "
                         f"{type(model).__name__}")
    length = cfg.task.train_length
    data = [sample_rows(task, range(b * batch_size, (b + 1) * batch_size), length, EVAL_STREAM, 0, length)
            for b in range(batches)]
    blocks = memory_gradients(model, data)
    return {"run": str(run_dir), "checkpoint": str(path), "step": load_trainer_state(path)["step"],
            "variant": cfg.model.variant, "model": cfg.model.to_dict(), "task": cfg.task.to_dict(),
            "batches": batches, "batch_size": batch_size, "length": length, "blocks": blocks,
            "ratio_to_first": ratios_to_first(blocks)}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m titans.experiments.memory_grads", description=__doc__.split(
        "\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (its latest checkpoint) or a checkpoint")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write (default RUN_DIR/memory_grads.json)")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    out = args.out or args.run_dir / "memory_grads.json"
    out.write_text(json.dumps(diagnose(args.run_dir, args.batches, args.batch_size), indent=1))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
