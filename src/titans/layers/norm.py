"""RMSNorm (PyTorch's own) — re-exported so every block imports norms from one place."""

from torch.nn import RMSNorm

__all__ = ["RMSNorm"]
