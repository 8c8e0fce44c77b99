"""Finds tensors made without saying on which device, the mistake a CPU-only test suite cannot otherwise see.

On a GPU, ``torch.zeros(n)`` inside a training step makes a CPU tensor that then meets CUDA tensors (an error) or
goes into an NCCL collective (refused). :class:`DevicelessFactoryCalls` is a ``TorchFunctionMode`` that records
every factory call (``torch.zeros``, ``arange``, ``tensor`` ...) that gives no ``device`` and is made directly by
speechtrain code, with its file and line. :class:`RecordDevicelessFactories` switches it on around every
training and validation batch of a Lightning run (after the batch is on its device, before the next one is
loaded), so data loading, which rightly builds CPU tensors, is not counted.
"""

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.overrides import TorchFunctionMode

PACKAGE = Path(__file__).resolve().parents[1]
TORCH = Path(torch.__file__).resolve().parent
COMPAT = PACKAGE / "lightning" / "megatron_compat.py"  # its CPU stand-ins for Megatron's CUDA calls pass through
FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.rand, torch.randn,
    torch.randint, torch.randperm, torch.linspace, torch.eye,
}  # fmt: skip


class DevicelessFactoryCalls(TorchFunctionMode):
    """Records ``file:line function`` for each factory call without ``device=`` made by speechtrain code."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            frame = sys._getframe(1)
            while frame is not None and (
                Path(frame.f_code.co_filename).resolve().is_relative_to(TORCH)
                or Path(frame.f_code.co_filename).resolve() == COMPAT
            ):
                frame = frame.f_back
            if frame is not None:
                path = Path(frame.f_code.co_filename).resolve()
                if path.is_relative_to(PACKAGE) and path != Path(__file__).resolve():
                    self.calls.append(f"{path.relative_to(PACKAGE.parent)}:{frame.f_lineno} torch.{func.__name__}")
        return func(*args, **kwargs)


class RecordDevicelessFactories(pl.Callback):
    """Runs :class:`DevicelessFactoryCalls` around each training and validation batch; ``calls`` holds the finds."""

    def __init__(self) -> None:
        self.mode = DevicelessFactoryCalls()
        self.calls = self.mode.calls

    def _start(self, *args: Any) -> None:
        self.mode.__enter__()

    def _stop(self, *args: Any) -> None:
        self.mode.__exit__(None, None, None)

    on_train_batch_start = on_validation_batch_start = _start
    on_train_batch_end = on_validation_batch_end = _stop
