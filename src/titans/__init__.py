"""titans: Titans neural long-term memory (Behrouz, Zhong, Mirrokni, arXiv 2501.00663).

Each public name is exported here by the subpackage that defines it.
"""

__version__ = "0.1.0"

from .memory import MemoryState, NeuralMemory, parallel_memory, sequential_memory  # noqa: E402
from .models import TitansConfig, TitansEncoder, TitansLM  # noqa: E402
