"""``MegatronMixedPrecision``: the precision plugin of the Megatron bridge.

- ``32``: fp32 everything.
- ``bf16-mixed`` / ``16-mixed``: fp32 weights, autocast to bf16 / fp16 (on CPU and GPU). ``16-mixed`` scales the
  loss dynamically (initial scale 2^32, halved on overflow after ``hysteresis`` overflows, doubled after
  ``growth_interval`` clean steps, never below ``min_scale``); a step whose gradients overflow is skipped.
- ``bf16-true``: weights and activations in bf16.
- fp8: through transformer-engine layers, which need the ``gpu`` extra and a CUDA GPU.

Audio front-ends disable autocast themselves and stay fp32. Gradient clipping uses the global norm over the
tensor and pipeline parallel ranks (:mod:`speechtrain.lightning.grad_norm`).
"""

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision

from speechtrain.lightning import parallel_state
from speechtrain.lightning.grad_norm import clip_grad_norm_

_ALIASES = {"32": "32-true", 32: "32-true", "16": "16-mixed", 16: "16-mixed", "bf16": "bf16-mixed"}
SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 (NeMo/Megatron defaults).

    Args:
        initial_scale: starting scale.
        min_scale: the scale never goes below this.
        growth_interval: clean steps before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
    """

    def __init__(
        self, initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_interval: int = 1000, hysteresis: int = 2
    ) -> None:
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._clean_steps = 0
        self._hysteresis_left = hysteresis

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (skipped when ``found_inf``)."""
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self._hysteresis_left = self.hysteresis
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self.scale *= 2.0
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = state["scale"]
        self._clean_steps = state["clean_steps"]
        self._hysteresis_left = state["hysteresis_left"]


def _fp8_error(fp8: str) -> Exception:
    if importlib.util.find_spec("transformer_engine") is None:
        return ImportError(
            f"fp8={fp8!r} needs transformer-engine, which is not installed. On a CUDA machine: "
            "pip install 'speechtrain[gpu]' (the 'gpu' extra); it cannot be installed without CUDA."
        )
    if not torch.cuda.is_available():
        return RuntimeError(f"fp8={fp8!r} needs a CUDA GPU; transformer-engine's fp8 kernels do not run on CPU.")
    return NotImplementedError(
        f"fp8={fp8!r}: speechtrain's layers are not transformer-engine layers yet, so fp8 would not apply."
    )


class MegatronMixedPrecision(Precision):
    """Precision plugin for :class:`~speechtrain.lightning.MegatronStrategy` (see module docstring).

    Args:
        precision: ``32``, ``bf16-mixed``, ``16-mixed`` or ``bf16-true`` (Lightning's spellings, ``32-true`` too).
        fp8: ``None``, ``hybrid`` or ``e4m3``: fp8 through transformer-engine.
        loss_scale: a :class:`DynamicLossScaler` for ``16-mixed`` (default: NeMo's defaults).
    """

    def __init__(
        self, precision: str | int = "32", fp8: str | None = None, loss_scale: DynamicLossScaler | None = None
    ):
        precision = _ALIASES.get(precision, precision)
        if precision not in SUPPORTED:
            raise ValueError(f"Unsupported precision {precision!r}; choose one of {', '.join(SUPPORTED)}.")
        if fp8 is not None:
            raise _fp8_error(fp8)
        self.precision = precision
        self.init_args = {"precision": precision, "fp8": fp8}
        self.scaler = (loss_scale or DynamicLossScaler()) if precision == "16-mixed" else None
        self.skip_step = False

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(torch.bfloat16) if self.precision == "bf16-true" else module

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.autocast(device, dtype=self.autocast_dtype):
            yield

    def grad_scale_func(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Multiplies the loss before backward (Megatron's schedules call it), or None without fp16."""
        if self.scaler is None:
            return None
        return lambda loss: loss * self.scaler.scale

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float | int) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(parameters, float(clip_val))

    def _unscale_and_check(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide gradients by the loss scale; True when any model-parallel rank saw inf/NaN."""
        inverse = 1.0 / self.scaler.scale
        found = torch.zeros(())
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(inverse)
                    found += (~torch.isfinite(p.grad)).any().float()
        parallel_state.all_reduce(found, parallel_state.model_parallel_group())
        return bool(found > 0)

    def optimizer_step(
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        closure_result = closure()
        if self.skip_step:  # the strategy's NonFiniteGuard dropped this step's gradients
            self.skip_step = False
            return closure_result
        found_inf = self._unscale_and_check(optimizer) if self.scaler is not None else False
        self._after_closure(model, optimizer)
        if not found_inf:
            optimizer.step(**kwargs)
        if self.scaler is not None:
            self.scaler.update(found_inf)
            model.log("loss_scale", self.scaler.scale, batch_size=1)
        return closure_result

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scale" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scale"])
