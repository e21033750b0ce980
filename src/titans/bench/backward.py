"""Where does the outer gradient grow? `titans bench backward`: a checkpoint replayed on the batches it trained on.

The memory's forward pass is bounded by construction (DESIGN.md §1, the bounded state), its backward pass is not: the
chunk-to-chunk map of a deep memory can expand some directions, and the gradient of the training loss then grows with
every segment it is carried back through. This replay makes that visible for one trained model. It loads a
checkpoint, draws the training batch of a step exactly as the trainer does (row i from (TRAIN_STREAM, seed, step, i)),
reads it `piece` positions per call through the recurrent state (the same outputs as one call, tested for every
variant), and after one backward pass reports, per block, the norm of the loss's gradient with respect to that block's
memory state (every layer's W and S) at each piece boundary, with the loss and the parameters' gradient norm before
clipping (the figure the trainer logs). Read from the last boundary back to the first, the norms say how much each
segment multiplies the gradient on its way back.

`--float64` replays in double precision: where the map expands, the backward pass amplifies float32's rounding as
well as the gradient, so the float32 figure (what training saw) can be far from the exact one.

`--set model.FIELD=VALUE` replays the same weights under another rule (say `model.memory.max_grad_norm=1` or
`model.memory.hidden_step=0.1`): the fields that do not change the parameters' shapes, so that a remedy is tried on
the very weights that showed the growth.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..config import apply_overrides
from ..io.state import detached, state_nodes
from ..memory.layer import MemoryState, NeuralMemory
from ..models.config import TITANS_VARIANTS
from ..tasks import Task
from ..train.batches import DROPOUT_STREAM, TRAIN_STREAM, derive_seed, position_loss, sample_rows, scored_positions
from ..train.checkpoint import checkpoint_step, load_checkpoint_config, load_weights, resolve_checkpoint
from ..train.config import TrainConfig
from ..train.loop import build_model, build_task


@dataclass
class Replay:
    step: int  # the training step whose batch was replayed (the checkpoint's own step: the batch it trained on next)
    loss: float  # mean training loss per scored position, as the trainer logs it
    grad_norm: float  # the parameters' gradient norm before clipping
    state_grad_norms: list[list[float | None]]  # [block][boundary]: ‖∂loss/∂(W, S)‖ of the memory state after piece i
    # [block][boundary]: the last boundary's gradient carried back through the block's memory update alone, its write
    # inputs held as the model produced them (no path through the rest of the model)
    update_grad_norms: list[list[float | None]]

    def growth(self) -> list[float | None]:
        """Per block, the largest factor by which one segment multiplied the gradient on its way back (the norm at a
        boundary over the norm at the next); None for a block without memory or with fewer than two boundaries."""
        return [largest_factor(norms) for norms in self.state_grad_norms]

    def update_growth(self) -> list[float | None]:
        """`growth` of the memory's update alone (`update_grad_norms`)."""
        return [largest_factor(norms) for norms in self.update_grad_norms]


def largest_factor(norms: list[float | None]) -> float | None:
    pairs = [(a, b) for a, b in zip(norms, norms[1:]) if a is not None and b]
    return max(a / b for a, b in pairs) if pairs else None


def replay_config(checkpoint: Path, overrides: list[str]) -> TrainConfig:
    """The checkpoint's config with `overrides` applied; only `model.` fields may change (the data and the seed are
    what make it a replay)."""
    outside = [item for item in overrides if not item.strip().startswith("model.")]
    if outside:
        raise ValueError(f"a replay changes model fields only (model.FIELD=VALUE); got {', '.join(outside)}")
    cfg = load_checkpoint_config(checkpoint)
    if cfg.model.variant not in TITANS_VARIANTS:
        raise ValueError(f"{cfg.model.variant} has no neural memory; the replay measures the memory's backward pass")
    if cfg.carry_windows != 1:
        raise ValueError(f"the run reads windows on through its state (carry_windows={cfg.carry_windows}); a replay "
                         "draws single windows only")
    return TrainConfig.from_dict(apply_overrides(cfg.to_dict(), overrides))


def load_replay(checkpoint: Path, overrides: list[str],
                dtype: torch.dtype = torch.float32) -> tuple[Path, TrainConfig, Task, torch.nn.Module]:
    """(checkpoint file, config, task, model in training mode with the checkpoint's weights), as `load_trained` but
    under `overrides`; a `--set` that changes a parameter's shape is refused, naming it."""
    path = resolve_checkpoint(checkpoint)
    cfg = replay_config(path, overrides)
    if cfg.dtype != "float32" or cfg.device != "cpu":
        cfg = TrainConfig.from_dict({**cfg.to_dict(), "dtype": "float32", "device": "cpu"})
    task = build_task(cfg)
    model = build_model(cfg, task)
    try:
        load_weights(path, model)
    except ValueError as err:
        if not overrides:
            raise
        raise ValueError(f"{', '.join(overrides)}: the checkpoint's weights do not fit the changed model; a replay "
                         f"may change only fields that keep the parameters' shapes ({err})") from None
    return path, cfg, task, model.to(dtype).train()


def memory_states(state: Any) -> list[MemoryState]:
    """Every MemoryState inside one block's state, each once (MAC holds the memory twice at a boundary)."""
    return list({id(node): node for node in state_nodes(state) if isinstance(node, MemoryState)}.values())


def state_tensors(block_state: Any) -> list[Tensor]:
    """The weights and momenta of a block's memory state(s), each tensor once, kept for their gradients."""
    tensors: dict[int, Tensor] = {}
    for memory in memory_states(block_state):
        for t in (*memory.weights, *memory.momentum):
            if t.requires_grad:
                tensors.setdefault(id(t), t)
    for t in tensors.values():
        t.retain_grad()
    return list(tensors.values())


def grad_norm_of(tensors: list[Tensor]) -> float | None:
    grads = [t.grad for t in tensors if t.grad is not None]
    if not grads:
        return None
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads))


def replay_step(model: torch.nn.Module, cfg: TrainConfig, task: Task, step: int, piece: int) -> Replay:
    """One backward pass over step `step`'s training batch, read `piece` positions per call, in the model's dtype;
    then, per block, the last boundary's gradient carried back through the memory's update alone."""
    batch = sample_rows(task, range(cfg.batch_size), cfg.task.train_length, TRAIN_STREAM, cfg.seed, step)
    torch.manual_seed(derive_seed(DROPOUT_STREAM, cfg.seed, step, 0))  # the trainer's dropout masks (rank 0)
    model.zero_grad(set_to_none=True)
    memories, outputs, boundaries, writes = read_in_pieces(model, batch.inputs, piece)
    count = scored_positions(batch)
    dtype = next(model.parameters()).dtype
    loss = position_loss(torch.cat(outputs, 1), batch, torch.device("cpu"), dtype) / count
    loss.backward()
    grad_norm = grad_norm_of(list(model.parameters()))
    blocks = len(boundaries[0])
    norms = [[grad_norm_of(boundary[b][1]) for boundary in boundaries[:-1]] for b in range(blocks)]
    one_per_block = len(memories) == blocks and all(len(w) == len(boundaries) for w in writes)
    update = [update_grad_norms(memories[b], writes[b], [boundary[b][0] for boundary in boundaries[:-1]])
              if one_per_block else [None] * (len(boundaries) - 1) for b in range(blocks)]
    return Replay(step, loss.item(), grad_norm, norms, update)


def read_in_pieces(model: torch.nn.Module, inputs: Tensor, piece: int) -> tuple[
        list[NeuralMemory], list[Tensor], list[list[tuple[list[MemoryState], list[Tensor]]]], list[list[Tensor]]]:
    """Read `inputs` `piece` positions per call through the recurrent state: (the model's memories, one per block in
    block order; the outputs of each call; per boundary and block, the memory states and their tensors, kept for
    their gradients; per block, the input of each write call, detached)."""
    memories = [m for m in model.modules() if isinstance(m, NeuralMemory)]
    writes: list[list[Tensor]] = [[] for _ in memories]
    hooks = [m.register_forward_pre_hook(lambda _, args, i=i: writes[i].append(args[0].detach()))
             for i, m in enumerate(memories)]
    outputs, boundaries, state = [], [], None
    try:
        for start in range(0, inputs.shape[1], piece):
            out, state = model(inputs[:, start:start + piece], state)
            outputs.append(out)
            boundaries.append([(memory_states(block), state_tensors(block)) for block in state])
    finally:
        for hook in hooks:
            hook.remove()
    return memories, outputs, boundaries, writes


def update_grad_norms(memory: NeuralMemory, writes: list[Tensor],
                      states: list[list[MemoryState]]) -> list[float | None]:
    """‖g_i‖ at every boundary i, where g at the last boundary is the full backward pass's gradient there and g_i is
    it carried back through the memory's own update, state_i → state_{i+1} with the write inputs of pieces i+1...
    held as recorded: the part of the growth that the update rule makes by itself, without the rest of the model
    (MAC's read, attention and write; the blocks above). Needs one memory state per boundary and a gradient at the
    last one; otherwise Nones."""
    last = states[-1]
    if any(len(found) != 1 for found in states) or any(t.grad is None for t in (*last[0].weights, *last[0].momentum)):
        return [None] * len(states)
    seed = [t.grad for t in (*last[0].weights, *last[0].momentum)]
    with torch.enable_grad():
        chain = update_chain(memory, writes[1:len(states)], states[0][0])
        kept = [[*state.weights, *state.momentum] for state in chain]
        for t in (t for tensors in kept[1:] for t in tensors):
            t.retain_grad()
        sum((t * g).sum() for t, g in zip(kept[-1], seed)).backward()
    return [grad_norm_of(tensors) for tensors in kept]


def update_chain(memory: NeuralMemory, writes: list[Tensor], start: MemoryState) -> list[MemoryState]:
    """`start`, detached, with its weights and momenta made leaves that take gradients, then the state after each
    write of `writes` in turn, through `memory` alone."""
    start = detached(start)
    depth = len(start.weights)
    leaves = [t.requires_grad_() for t in (*start.weights, *start.momentum)]
    chain = [dataclasses.replace(start, weights=tuple(leaves[:depth]), momentum=tuple(leaves[depth:]))]
    for x in writes:
        chain.append(memory(x, chain[-1])[1])
    return chain


def check_piece(cfg: TrainConfig, piece: int) -> None:
    """`piece` must leave the outputs those of one call: a multiple of the chunk (and of MAC's segment)."""
    unit = cfg.model.memory.chunk_size
    if cfg.model.variant == "mac":
        unit = math.lcm(unit, cfg.model.attention.segment_len)
    if piece % unit:
        raise ValueError(f"piece {piece} must be a multiple of {unit} (the memory's chunk"
                         f"{' and MAC segment' if cfg.model.variant == 'mac' else ''}), so that the replay reads "
                         "the sequence as training did")


def replay(checkpoint: Path, steps: list[int] | None, piece: int | None, overrides: list[str],
           dtype: torch.dtype = torch.float32) -> tuple[Path, TrainConfig, list[Replay]]:
    """Replay `steps` (default: the checkpoint's own step) of the run a checkpoint belongs to, every one from the
    checkpoint's weights."""
    path, cfg, task, model = load_replay(checkpoint, overrides, dtype)
    piece = piece or (cfg.model.attention.segment_len if cfg.model.variant == "mac" else cfg.model.memory.chunk_size)
    check_piece(cfg, piece)
    chosen = steps if steps else [checkpoint_step(path)]
    return path, cfg, [replay_step(model, cfg, task, step, piece) for step in chosen]
