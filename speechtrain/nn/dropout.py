"""Dropout with a cheaper mask: one 32-bit random draw gives two 16-bit uniforms, so an element is dropped with
probability ``p`` rounded to a multiple of 1/65536.

``torch.nn.Dropout`` draws its mask with ``bernoulli_``, one random number and one comparison in floating point per
element; on CPU that is a noticeable share of a FastConformer training step. Drawing raw integer bits is much
cheaper. The scaling by ``1 / (1 - p)`` is folded into the saved mask, so the backward pass is one multiply, as with
PyTorch's.
"""

import torch


class Dropout(torch.nn.Module):
    """Drop-in ``torch.nn.Dropout`` (identity in eval mode or at ``p = 0``) on the default random generator.

    Args:
        p: drop probability, in [0, 1).
    """

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {p}.")
        self.p = p
        self._threshold = round(p * 65536) - 32768  # keep where the signed 16-bit draw is >= this

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        count = x.numel()
        bits = torch.empty((count + 1) // 2, dtype=torch.int32, device=x.device).random_(-(2**31), 2**31)
        keep = bits.view(torch.int16)[:count].view(x.shape) >= self._threshold
        return x * keep.to(x.dtype).mul_(1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"
