"""Evaluation: a model's loss and accuracies on the sequences of an `EvalPlan`, per length (`evaluate`), with the
loss against position in the context where asked (`PositionLosses`). The training loop calls it at its evaluation
steps and at the end; `titans eval`, the experiments and the harness call it on trained models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..tasks import IGNORE_INDEX, LabelBatch, Task, TokenBatch, bits_per_byte, exact_match, tokens_right
from ..tasks.base import Batch
from .batches import EVAL_STREAM, loss_terms, sample_rows, scored_positions


def position_ends(length: int, buckets: int) -> list[int]:
    """The (exclusive) last position of each of `buckets` contiguous spans that split positions 0 .. length - 1 as
    evenly as whole positions allow."""
    if not 1 <= buckets <= length:
        raise ValueError(f"position buckets must be between 1 and the length ({length}), got {buckets}")
    return [(i + 1) * length // buckets for i in range(buckets)]


class PositionLosses:
    """The summed loss and the count of scored positions at every position of sequences of one length, over the
    batches added, and their mean per bucket of positions (`position_ends`)."""

    def __init__(self, length: int, buckets: int):
        self.ends = position_ends(length, buckets)
        self.loss = torch.zeros(length, dtype=torch.float64)
        self.count = torch.zeros(length, dtype=torch.float64)

    def add(self, logits: Tensor, targets: Tensor) -> None:
        scored = targets != IGNORE_INDEX
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="none").view(targets.shape)
        self.loss += losses.double().sum(0).cpu()
        self.count += scored.sum(0).double().cpu()

    def metrics(self, bytes_per_token: float | None) -> dict[str, list]:
        """{"position_ends", "loss_by_position"} (the mean loss per bucket in nats; None for a bucket with nothing
        scored), and for a task with `bytes_per_token` (language modelling) also "bits_per_byte_by_position"."""
        starts = [0, *self.ends[:-1]]
        means = [None if self.count[a:b].sum() == 0 else (self.loss[a:b].sum() / self.count[a:b].sum()).item()
                 for a, b in zip(starts, self.ends)]
        out: dict[str, list] = {"position_ends": list(self.ends), "loss_by_position": means}
        if bytes_per_token is not None:
            out["bits_per_byte_by_position"] = [None if m is None else bits_per_byte(m) / bytes_per_token
                                                for m in means]
        return out


@dataclass(frozen=True)
class EvalPlan:
    """What an evaluation reads and how. Per length, `batches` x `batch_size` sequences drawn from (seed, length, row);
    a task that is a finite set (`Task.full_set`, a labelled split) is read whole instead, each example once,
    `batch_size` at a time (`batches` and `seed` unused). The model reads them on `device`, `piece` tokens at a time
    through its state (None: in one call), under the autocast of `precision`, the `dtype` it trained in
    (`loss_terms`). `position_buckets` (token tasks): also the mean loss over each of that many equal spans of
    positions (`loss_by_position`, and `bits_per_byte_by_position` for language modelling), each span ending at
    `position_ends`: the loss against position in the context."""

    batches: int
    batch_size: int
    seed: int = 0
    device: torch.device | str = "cpu"
    piece: int | None = None
    precision: str = "float32"
    position_buckets: int = 0


def evaluation_batches(task: Task, length: int, plan: EvalPlan) -> Iterator[Batch]:
    """The batches `plan` reads at `length`: drawn, or the task's whole finite set in slices."""
    whole = task.full_set(length)
    if whole is None:
        for b in range(plan.batches):
            rows = range(b * plan.batch_size, (b + 1) * plan.batch_size)
            yield sample_rows(task, rows, length, EVAL_STREAM, plan.seed, length)
        return
    for i in range(0, len(whole.targets), plan.batch_size):
        yield type(whole)(*(t[i:i + plan.batch_size] for t in whole))


class EvalTally:
    """The sums an evaluation keeps at one length, batch by batch, and the metrics they give."""

    def __init__(self, task: Task, length: int, position_buckets: int):
        self.task = task
        self.loss, self.count, self.matches, self.right, self.persistence = 0.0, 0, 0.0, 0.0, 0.0
        self.by_position = PositionLosses(length, position_buckets) if position_buckets else None

    def add(self, batch: Batch, batch_loss: Tensor, outputs: Tensor) -> None:
        n = scored_positions(batch)
        self.loss, self.count = self.loss + batch_loss.item(), self.count + n
        if isinstance(batch, TokenBatch):
            targets = batch.targets.to(outputs.device)
            self.matches += exact_match(outputs, targets).sum().item()
            self.right += tokens_right(outputs, targets).item()  # a count: the same sum for any batching
            if self.by_position is not None:
                self.by_position.add(outputs, targets)
        elif isinstance(batch, LabelBatch):
            self.matches += (outputs.argmax(-1) == batch.targets.to(outputs.device)).sum().item()
        else:  # the forecast that the next step equals the last one seen: targets[t] = inputs[t]
            self.persistence += F.mse_loss(batch.inputs.double(), batch.targets.double(), reduction="sum").item()

    def metrics(self, rows: int) -> dict[str, Any]:
        """`rows`: the sequences drawn (exact-match accuracy of token tasks is over them)."""
        task, count = self.task, max(self.count, 1)
        metrics: dict[str, Any] = {"loss": self.loss / count}
        if task.vocab_size is None and task.num_classes is None:
            metrics["persistence_loss"] = self.persistence / count
        if task.num_classes is not None:
            metrics["accuracy"] = self.matches / count
            metrics["examples"] = self.count
        if task.vocab_size is not None:
            metrics["accuracy"] = self.matches / rows
            metrics["token_accuracy"] = self.right / count
            metrics.update(task.text_metrics(metrics["loss"]))
        if self.by_position is not None:
            metrics.update(self.by_position.metrics(task.bytes_per_token()))
        return metrics


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, lengths: list[int], plan: EvalPlan) -> dict[int, dict[str, Any]]:
    """Per length, on the sequences of `plan`: mean loss per scored position, and for token tasks exact-match accuracy
    (rows with every scored token right) and token accuracy, and bits per byte for the byte-level LM; classification
    reports the accuracy over its series and their number (`examples`). Forecasting (series tasks) also reports
    `persistence_loss`, the mean squared error on the same sequences of the forecast that the next step equals the
    last one seen: what a forecaster must beat to have learnt more than to repeat."""
    if plan.position_buckets and task.vocab_size is None:
        raise ValueError(f"position_buckets is for token tasks; {task.name} is not one")
    was_training = model.training
    model.eval()
    device = torch.device(plan.device)
    results = {}
    for length in lengths:
        tally = EvalTally(task, length, plan.position_buckets)
        for batch in evaluation_batches(task, length, plan):
            tally.add(batch, *loss_terms(model, batch, device, plan.piece, plan.precision))
        results[length] = tally.metrics(rows=plan.batches * plan.batch_size)
    model.train(was_training)
    return results
