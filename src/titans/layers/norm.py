"""RMSNorm: PyTorch's own, computed in its weight's dtype, so every block imports norms from one place."""

from torch import Tensor, nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.RMSNorm):
    """`torch.nn.RMSNorm` that first casts its input to its weight's dtype.

    Under autocast, inputs arrive in bf16 from matmuls and attention while the weight stays float32: RMSNorm's fused
    kernel then refuses the pair (with a warning) and the composite path normalises in bf16. Normalising in float32
    is autocast's own policy for layer_norm; the next matmul casts back to bf16 as autocast decides. Without autocast
    (input and weight alike) the cast is a no-op."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x if self.weight is None else x.to(self.weight.dtype))
