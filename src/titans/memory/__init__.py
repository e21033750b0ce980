"""The neural long-term memory (paper §3): the update rule, functional chunk-parallel and reference, the layer."""

from .checks import Gates
from .delta import delta_rule_memory
from .fused import release_workspace
from .layer import MemoryState, NeuralMemory, StaticMemoryState
from .losses import LOSSES, Huber, Loss, Lp, Squared
from .mlp import memory_apply
from .parallel import parallel_memory
from .reference import sequential_memory
from .rule import MemoryRule

__all__ = ["LOSSES", "Gates", "Huber", "Loss", "Lp", "MemoryRule", "MemoryState", "NeuralMemory", "Squared",
           "StaticMemoryState", "delta_rule_memory", "memory_apply", "parallel_memory", "release_workspace",
           "sequential_memory"]
