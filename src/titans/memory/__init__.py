"""The neural long-term memory (paper §3): functional update rule, chunk-parallel and reference, layer."""

from .delta import delta_rule_memory
from .fused import release_workspace
from .layer import MemoryState, NeuralMemory
from .mlp import memory_apply
from .parallel import parallel_memory
from .reference import sequential_memory

__all__ = ["MemoryState", "NeuralMemory", "delta_rule_memory", "memory_apply", "parallel_memory", "release_workspace",
           "sequential_memory"]
