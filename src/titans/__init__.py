"""titans: Titans neural long-term memory (Behrouz, Zhong, Mirrokni, arXiv 2501.00663).

The memory layer and its functional core, the models and their config, at the package top. They are imported on first
use (PEP 562), so that a subpackage that needs no torch (`titans.data`, whose worker processes tokenize text) starts
without importing it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {"Gates": "memory", "MemoryRule": "memory", "MemoryState": "memory", "NeuralMemory": "memory",
            "parallel_memory": "memory", "sequential_memory": "memory", "TitansConfig": "models",
            "TitansEncoder": "models", "TitansLM": "models"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # once imported, an ordinary attribute
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # `import titans; titans.memory...`, as when eager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
