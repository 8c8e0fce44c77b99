"""Platform kernels and process settings, chosen by the device: the one place where a device's workarounds live.

Model code calls :func:`conv2d` and :func:`depthwise_conv2d` and reads as the math; on a CUDA (or any non-CPU)
device they are the plain torch operations, on the CPU the kernels of :mod:`speechtrain.backends.cpu`.
:func:`configure_process` applies a device's process-wide settings once, when the trainer is built.
"""

import torch
import torch.nn.functional as F

from speechtrain.backends import cpu


def configure_process(device_type: str) -> list[str]:
    """Apply the process-wide settings of ``device_type`` (``"cpu"``, ``"cuda"``, ...); returns the names of those
    applied. A CPU run keeps freed host memory for reuse and flushes denormals (:mod:`speechtrain.backends.cpu`);
    other devices need nothing here."""
    if device_type != "cpu":
        return []
    settings = {"keep_freed_memory": cpu.keep_freed_memory, "flush_denormals": cpu.flush_denormals}
    return [name for name, apply in settings.items() if apply()]


def device_type_of(accelerator: object) -> str:
    """The device type a trainer's ``accelerator`` argument selects: ``"auto"`` (or none) is CUDA where available."""
    name = accelerator if accelerator is None or isinstance(accelerator, str) else type(accelerator).__name__
    name = (name or "auto").lower()
    if name in ("auto", "gpu"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if "cuda" in name else "cpu" if "cpu" in name else name


def conv2d(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)``."""
    return cpu.conv2d(conv, x) if x.device.type == "cpu" else conv(x)


def depthwise_conv2d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, int], padding: tuple[int, int]
) -> torch.Tensor:
    """The depthwise (``groups = channels``) convolution of x (B, C, H, W)."""
    if x.device.type == "cpu":
        return cpu.depthwise_conv2d(x, weight, bias, stride, padding)
    return F.conv2d(x, weight, bias, stride=stride, padding=padding, groups=x.shape[1])
