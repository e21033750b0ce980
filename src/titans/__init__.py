"""titans: Titans neural long-term memory (Behrouz, Zhong, Mirrokni, arXiv 2501.00663).

The memory layer and its functional core, the models and their config, at the package top.
"""

__version__ = "0.1.0"

from .memory import MemoryState, NeuralMemory, parallel_memory, sequential_memory  # noqa: E402
from .models import TitansConfig, TitansEncoder, TitansLM  # noqa: E402

__all__ = ["MemoryState", "NeuralMemory", "parallel_memory", "sequential_memory", "TitansConfig", "TitansEncoder",
           "TitansLM"]
