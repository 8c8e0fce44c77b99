"""What a run on the CPU does differently: host settings for the process and two convolution kernels.

Each item is here because the CPU path of torch (glibc's allocator, x86 denormals, oneDNN's kernels) is slower than
it has to be for what our models do, and nothing installable fixes it; each one's measured reason is in
docs/backends.md and its figure in RESULTS.md. None of it runs on a GPU: :mod:`speechtrain.backends` picks it by the
device.

- :func:`keep_freed_memory`: glibc's ``malloc`` keeps freed blocks of up to 1 GiB instead of unmapping them, so a
  training step reuses the activations' memory of the last one (the host counterpart of CUDA's caching allocator,
  at the same cost: resident memory stays at the run's high-water mark). ``SPEECHTRAIN_KEEP_FREED_MEMORY=0``: off.
- :func:`flush_denormals`: denormal fp32 values are treated as zero (x86 computes with them in microcode; a
  transducer loss's log-space lattice produces many once the model is confident). Per thread, inherited by threads
  created later: applied before torch starts its intra-op threads. ``SPEECHTRAIN_FLUSH_DENORMALS=0``: off.
- :func:`conv2d`: a full 2-D convolution whose weight gradient is computed from contiguous (NCHW) copies, since
  oneDNN's channels-last weight-gradient kernel is the slow one (same results up to fp32 rounding).
- :func:`depthwise_conv2d`: a strided depthwise convolution under bf16 autocast runs in fp32, since oneDNN's bf16
  backward of a strided depthwise convolution takes a slow path (the stride-1 ones do not).
"""

import ctypes
import os
import sys

import torch
import torch.nn.functional as F

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep freed blocks of up to 1 GiB for reuse; True when applied (glibc on Linux and
    not turned off by ``SPEECHTRAIN_KEEP_FREED_MEMORY=0``). Idempotent; affects the whole process."""
    if not sys.platform.startswith("linux") or os.environ.get("SPEECHTRAIN_KEEP_FREED_MEMORY", "1") == "0":
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # another C library (musl): its allocator has no such knobs
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))


def flush_denormals() -> bool:
    """Treat denormal fp32/fp64 inputs and results as zero on this thread (and the threads it creates from now on);
    True when applied (a CPU with the SSE3 modes, and not turned off by ``SPEECHTRAIN_FLUSH_DENORMALS=0``)."""
    if os.environ.get("SPEECHTRAIN_FLUSH_DENORMALS", "1") == "0":
        return False
    return bool(torch.set_flush_denormal(True))


def conv2d(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` for a channels-last ``x``, its weight gradient from contiguous copies (outside autocast and with
    gradients on; else plain ``conv(x)``)."""
    if torch.is_autocast_enabled("cpu") or not torch.is_grad_enabled():
        return conv(x)
    return _ConvWeightGradFromContiguous.apply(x, conv.weight, conv.bias, conv.stride, conv.padding)


class _ConvWeightGradFromContiguous(torch.autograd.Function):
    """A 2-D convolution (groups 1, dilation 1) of channels-last ``x`` whose backward computes the input gradient
    channels-last and the weight gradient from contiguous (NCHW) copies of ``x`` and the gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        ctx.conv = (stride, padding, bias is not None)
        return F.conv2d(x, weight, bias, stride, padding)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        stride, padding, has_bias = ctx.conv
        args = ([weight.shape[0]] if has_bias else None, list(stride), list(padding), [1, 1], False, [0, 0], 1)
        backward = torch.ops.aten.convolution_backward
        grad_x = backward(grad, x, weight, *args, [True, False, False])[0] if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:  # (a frozen subsampling needs none)
            _, grad_weight, grad_bias = backward(grad.contiguous(), x.contiguous(), weight.contiguous(), *args,
                                                 [False, True, has_bias])  # fmt: skip
        return grad_x, grad_weight, grad_bias, None, None


def depthwise_conv2d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, int], padding: tuple[int, int]
) -> torch.Tensor:
    """The depthwise convolution of x (B, C, H, W), in fp32 when it is strided and bf16 autocast is on (a few
    thousand multiply-adds per frame: nothing for autocast to save)."""
    if stride[0] > 1 and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            bias = None if bias is None else bias.float()
            return F.conv2d(x.float(), weight.float(), bias, stride=stride, padding=padding, groups=x.shape[1])
    return F.conv2d(x, weight, bias, stride=stride, padding=padding, groups=x.shape[1])
