"""An exponential moving average of the weights (``exp_manager.ema``, NeMo's keys), kept on the model's device.

After every ``every_n_steps``-th optimizer step the average moves toward the live weights:
``ema += (1 - d) * (live - ema)``, with ``d = min(decay, (1 + n) / (10 + n))`` after ``n`` updates (the usual
warm-up: early on the average follows the live weights closely instead of holding on to the random
initialisation; with ``decay`` 0.999 and no warm-up the initial weights would still weigh 5% after 3,000 steps).
It covers the trainable parameters and the floating-point buffers (batch-norm statistics), so that the averaged
weights are evaluated with statistics of their own.

Validation during training runs on the averaged weights (``validate_original_weights: true``: on the live ones);
checkpoints hold the live weights and, in this callback's state, the average, so a resumed run continues both
exactly. When training completes, the average is written into the model: the run's archive, its closing
validation and its report are those of the averaged weights.

Why not Lightning's ``EMAWeightAveraging``: it keeps a deep copy of the whole module (an ``AveragedModel``) and
averages it parameter by parameter, and its swap replaces the module's tensors, which under Megatron Core's DDP
are views into its contiguous parameter buffers. Here the average is one list of tensors updated with one fused
``torch._foreach_lerp_`` per step (no per-parameter Python loop, no host sync, no collective: every rank keeps
the average of the weights it holds, so data-parallel replicas stay identical and tensor/pipeline-parallel ranks
each average their own shard), and a swap copies values into the existing tensors. (The bridge's distributed
optimizer gathers the updated parameters inside its step, never overlapped with the next forward, so every rank's
weights are whole when the average reads them.)
"""

import logging
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from speechtrain.lightning.fault_tolerance import was_preempted

logger = logging.getLogger(__name__)


@dataclass
class EMAConfig:
    """``exp_manager.ema``.

    Attributes:
        enable: keep the moving average.
        decay: the average's decay per update, in (0, 1) (0.999: a memory of ~1,000 updates).
        every_n_steps: update after every N-th optimizer step.
        validate_original_weights: validate the live weights during training instead of the average.
    """

    enable: bool = False
    decay: float = 0.999
    every_n_steps: int = 1
    validate_original_weights: bool = False


def _averaged_tensors(module: torch.nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The tensors the average covers, with their names: trainable parameters, then floating-point buffers."""
    names, tensors = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            names.append(name)
            tensors.append(param)
    for name, buf in module.named_buffers():
        if buf.is_floating_point():
            names.append(name)
            tensors.append(buf)
    return names, tensors


class EMA(pl.Callback):
    """The moving average of the weights (see the module docstring).

    Args:
        decay: see :class:`EMAConfig`.
        every_n_steps: see :class:`EMAConfig`.
        validate_original_weights: see :class:`EMAConfig`.

    Raises:
        ValueError: ``decay`` outside (0, 1) or ``every_n_steps`` < 1.
    """

    def __init__(self, decay: float = 0.999, every_n_steps: int = 1, validate_original_weights: bool = False):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"exp_manager.ema.decay={decay}: must lie strictly between 0 and 1 (e.g. 0.999).")
        if every_n_steps < 1:
            raise ValueError(f"exp_manager.ema.every_n_steps={every_n_steps}: must be at least 1.")
        self.decay = decay
        self.every_n_steps = every_n_steps
        self.validate_original_weights = validate_original_weights
        self.updates = 0
        self._names: list[str] = []
        self._live: list[torch.Tensor] = []
        self._ema: list[torch.Tensor] = []
        self._pending: dict[str, Any] | None = None
        self._last_step = -1
        self._swapped = False
        self._all_fp32 = True

    # -- the average ------------------------------------------------------------------------------------------
    def _ensure(self, pl_module: pl.LightningModule) -> None:
        if self._live:
            return
        self._names, self._live = _averaged_tensors(pl_module)
        # fp32 whatever the weights' dtype: an average of bf16 weights kept in bf16 would not move at all for
        # decays near 1 (bf16 resolves ~0.4% steps).
        self._ema = self._fp32_copy_of_live()
        self._all_fp32 = all(t.dtype == torch.float32 for t in self._live)
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None

    def _fp32_copy_of_live(self) -> list[torch.Tensor]:
        return [t.detach().to(dtype=torch.float32, copy=True) for t in self._live]

    def _restore(self, state: dict[str, Any]) -> None:
        names = list(state["names"])
        if names != self._names:
            missing = sorted(set(self._names) - set(names))[:5]
            extra = sorted(set(names) - set(self._names))[:5]
            raise ValueError(
                "exp_manager.ema: the checkpoint's moving average does not match this model's weights "
                f"(missing from it: {missing}, not in the model: {extra}). Resume with the model that wrote it, "
                "or start the average afresh with exp_manager.ema.enable=false."
            )
        for ema, saved in zip(self._ema, state["ema"], strict=True):
            if ema.shape != saved.shape:
                raise ValueError(f"exp_manager.ema: a saved average of shape {tuple(saved.shape)} for a weight "
                                 f"of shape {tuple(ema.shape)}; the checkpoint belongs to another model.")  # fmt: skip
        torch._foreach_copy_(self._ema, [t.to(self._ema[0].device) for t in state["ema"]])
        self.updates = int(state["updates"])

    @torch.no_grad()
    def update(self) -> None:
        """Move the average toward the live weights once."""
        n = self.updates
        weight = 1.0 - min(self.decay, (1.0 + n) / (10.0 + n))
        # Weights in another dtype (Megatron's bf16 parameters) are cast for the update, one tensor each.
        live = self._live if self._all_fp32 else [t.float() for t in self._live]
        torch._foreach_lerp_(self._ema, live, weight)
        self.updates = n + 1

    @torch.no_grad()
    def _swap(self) -> None:
        """Exchange the live weights and the average (values copied into the existing tensors)."""
        saved = self._fp32_copy_of_live()
        torch._foreach_copy_(self._live, self._ema)
        self._ema = saved
        self._swapped = not self._swapped

    # -- Lightning hooks --------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ensure(pl_module)
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kw: Any) -> None:
        step = trainer.global_step
        if step == self._last_step:  # a micro-batch of gradient accumulation, or a skipped step
            return
        self._last_step = step
        if step % self.every_n_steps == 0:
            self.update()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not self.validate_original_weights:  # not the closing trainer.validate
            self._swap()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._swapped:
            self._swap()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Before the checkpoint callback's on_train_end (exp_manager puts that last), which writes the archive.
        if self._swapped:
            self._swap()
        if self._live and not was_preempted(trainer):
            with torch.no_grad():
                torch._foreach_copy_(self._live, self._ema)
            logger.info("exp_manager.ema: the model now holds the moving average of its weights (%d updates)",
                        self.updates)  # fmt: skip

    # -- checkpoint state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if not self._live:
            return {}
        ema = self._live if self._swapped else self._ema  # mid-validation, the average sits in the model
        return {"names": list(self._names), "ema": [t.detach().float().clone() for t in ema],
                "updates": self.updates}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self._live:
            self._restore(state_dict)
        else:
            self._pending = state_dict
