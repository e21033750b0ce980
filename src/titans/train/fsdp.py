"""Sharded data parallelism (`parallel: fsdp`): FSDP2 (`torch.distributed.fsdp.fully_shard`) over a language model's
blocks, with mixed precision, and sharded checkpoints through `torch.distributed.checkpoint` (DCP).

Each block is one FSDP unit (its parameters gathered for its forward and backward, then freed), and the embedding,
final norm and head form the root unit. Every rank holds 1/world of each parameter, its gradient and its AdamW moments.
Under `dtype: bfloat16` the units gather their parameters in bf16 and reduce gradients in float32
(`MixedPrecisionPolicy`), with the forward under the same bf16 autocast as without FSDP; the memories are units of
their own gathered in float32, so the memory's initial weights W_0 and its state stay float32, as `precision.py` keeps
them on one process. MAC reads its memory through `NeuralMemory.retrieve` as well as through its forward, so that
method is registered to gather the memory's parameters too.

A checkpoint of a sharded run holds each rank's shards in DCP's format (`sharded/`); `load_sharded_weights` reads one
into a whole model in a single process (evaluation, generation, export), and a run resumes on any number of ranks.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..memory import NeuralMemory
from .precision import AUTOCAST_DTYPES


def shard_model(model: nn.Module, precision: str) -> None:
    """Apply FSDP2 to `model` (a TitansLM) in place: every memory, every block, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    # FSDP2 warns, on every forward, of outputs that are views (the recurrent state holds expanded W_0 and sliced
    # caches): an in-place op on one would skip its backward hook. Nothing modifies a block's outputs in place, and
    # the sharded gradients equal one process's (tests/train/test_fsdp.py), so the warning says nothing here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor")

    compute = AUTOCAST_DTYPES.get(precision)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)
    memory_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32) if compute else policy
    for block in model.backbone.blocks:
        for module in block.modules():
            if isinstance(module, NeuralMemory):
                fully_shard(module, mp_policy=memory_policy)
                register_fsdp_forward_method(module, "retrieve")
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Whether the next backward reduce-scatters its gradients (the last micro-batch of a step) or accumulates them
    unsharded locally (the others): FSDP2's counterpart of DDP's `no_sync`."""
    model.set_requires_gradient_sync(sync)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and the optimiser's sharded state dicts, under the parameters' own names (what DCP saves)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its shards of the model and optimiser into `folder` (a collective call)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state(model, optimizer), checkpoint_id=str(folder))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank reads its shards of the model and optimiser from `folder` (written on any number of ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_sharded_weights(folder: Path, model: nn.Module) -> None:
    """The whole model from a sharded checkpoint, in one process without torch.distributed (DCP gathers each tensor
    from the shards that hold its pieces)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    model.load_state_dict(state["model"])
