"""``MegatronMixedPrecision``: the precision plugin of the Megatron bridge.

- ``32``: fp32 weights and compute; Megatron's fp32 optimizer.
- ``bf16-mixed``: fp32 weights, autocast to bf16; fp32 optimizer.
- ``16-mixed``: fp32 weights, autocast to fp16; Megatron's ``DynamicGradScaler`` (2^32 initial, hysteresis 2,
  window 1000): an overflowing step is skipped.
- ``bf16-true``: bf16 weights and compute (autocast casts fp32 inputs); the optimizer keeps fp32 main parameters
  and the gradients are reduced in fp32.

Modules that set ``keep_fp32 = True`` (audio front-ends, codecs) keep fp32 weights under ``bf16-true`` and
disable autocast themselves, so features are always computed in fp32. fp8 goes through transformer-engine's
``fp8_autocast``: it needs the ``gpu`` extra, a CUDA device and a model with transformer-engine layers (the SALM
LLM with ``llm.transformer_engine``); anything else is refused with the reason. Gradient clipping
(``trainer.gradient_clip_val``) is done by the optimizer with the global norm over TP, PP (and, under the
distributed optimizer, DP) ranks; ``gradient_clip_algorithm=value`` is refused.
"""

import contextlib
import importlib.util
from collections.abc import Iterator

import torch
from lightning.pytorch.plugins.precision import Precision

_ALIASES = {"32": "32-true", 32: "32-true", "16": "16-mixed", 16: "16-mixed", "bf16": "bf16-mixed"}
SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
FP8_FORMATS = ("hybrid", "e4m3")
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16}


class MegatronMixedPrecision(Precision):
    """Precision plugin for :class:`~speechtrain.lightning.MegatronStrategy` (see module docstring).

    Args:
        precision: ``32``, ``bf16-mixed``, ``16-mixed`` or ``bf16-true`` (Lightning's spellings, ``32-true`` too).
        fp8: ``None``, ``hybrid`` or ``e4m3``: fp8 through transformer-engine layers on a GPU.
    """

    def __init__(self, precision: str | int = "32", fp8: str | None = None):
        precision = _ALIASES.get(precision, precision)
        if precision not in SUPPORTED:
            raise ValueError(f"Unsupported precision {precision!r}; choose one of {', '.join(SUPPORTED)}.")
        if fp8 is not None and fp8 not in FP8_FORMATS:
            raise ValueError(f"fp8={fp8!r}: choose one of {', '.join(FP8_FORMATS)}.")
        if fp8 is not None and importlib.util.find_spec("transformer_engine") is None:
            raise ImportError(
                f"fp8={fp8!r} needs transformer-engine, which is not installed. On a CUDA machine: "
                "pip install 'speechtrain[gpu]' (the 'gpu' extra); it cannot be installed without CUDA."
            )
        self.precision = precision
        self.autocast_dtype = _AUTOCAST.get(precision)
        self.fp8 = fp8
        self.init_args = {"precision": precision, "fp8": fp8}
        self.device_type = "cpu"  # set by the strategy to its root device's type

    def check_model(self, module: torch.nn.Module) -> None:
        """Refuse, at start and with the reason, what this precision cannot do with ``module`` on this device."""
        if self.fp8 is None:
            return
        if self.device_type != "cuda":
            raise RuntimeError(
                f"fp8={self.fp8!r} needs a CUDA GPU; transformer-engine's fp8 kernels do not run on CPU."
            )
        if not any(type(m).__module__.startswith("transformer_engine") for m in module.modules()):
            raise RuntimeError(
                f"fp8={self.fp8!r} applies only to transformer-engine layers, and {type(module).__name__} has none "
                "(speech encoders and the TTS model are built from torch layers). Use bf16-mixed, or the SALM LLM "
                "with model.llm.transformer_engine=true."
            )

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.precision != "bf16-true":
            return module
        module.to(torch.bfloat16)
        for child in module.modules():
            if getattr(child, "keep_fp32", False):
                child.float()
        return module

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.autocast_dtype is not None:
                stack.enter_context(torch.autocast(self.device_type, dtype=self.autocast_dtype))
            if self.fp8 is not None:
                import transformer_engine.pytorch as te
                from transformer_engine.common.recipe import DelayedScaling, Format

                recipe = DelayedScaling(fp8_format=Format.HYBRID if self.fp8 == "hybrid" else Format.E4M3)
                stack.enter_context(te.fp8_autocast(enabled=True, fp8_recipe=recipe))
            yield

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float | int) -> None:
        """Clipping happens inside the optimizer step, by the global norm (see module docstring)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer: the optimizer inside
        optimizer.clip_grad = float(clip_val)

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float | int) -> None:
        raise ValueError(
            "trainer.gradient_clip_algorithm=value is not supported under MegatronStrategy: gradients are clipped "
            "by their global norm inside Megatron's optimizer. Use gradient_clip_algorithm=norm."
        )
