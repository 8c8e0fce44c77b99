"""Megatron Core's optimizer, presented to Lightning and torch's LR schedulers as a ``torch.optim.Optimizer``.

``get_megatron_optimizer`` builds it over the DDP-wrapped model chunk: the torch (or fused) Adam/AdamW/SGD inside;
fp32 main parameters under ``bf16-true``; ``DynamicGradScaler`` under ``16-mixed``; ``DistributedOptimizer``
(states and main parameters sharded over the data-parallel ranks, gradients reduce-scattered, parameters
all-gathered after the step) for ``use_distributed_optimizer``. Weight decay skips biases and other 1-D
parameters (Megatron's rule).

One step, composed from Megatron's own stages so that the non-finite guard can sit between them:
``prepare_grads`` (main gradients; fp16: unscale, found-inf over the model-parallel ranks, scaler update) ->
``get_grad_norm`` (the global norm over TP/PP ranks, and DP shards under the distributed optimizer; one host
sync) -> the guard's decision from that norm and the step's loss (identical on every rank: no collective) ->
clipping by that norm -> ``step_with_ready_grads``. Megatron's ``step()`` runs the same stages without the guard.
"""

import math
from collections.abc import Callable
from typing import Any

import torch

from speechtrain.lightning.megatron_compat import cuda_tensor_types, fused_cpu_kernels


class MegatronOptimizer(torch.optim.Optimizer):
    """A Megatron Core optimizer under torch's ``Optimizer`` type (see module docstring).

    ``torch.optim.Optimizer.__init__`` is deliberately not called: this object owns no parameter groups of its
    own; ``param_groups`` and ``state`` are the Megatron optimizer's, so LR schedulers and checkpoints act on it.

    Args:
        optimizer: the ``MegatronOptimizer`` from ``get_megatron_optimizer``.
        clip_grad: clip the global gradient norm to this (0: no clipping; the norm is computed anyway).
    """

    def __init__(self, optimizer: Any, clip_grad: float = 0.0) -> None:
        self.mcore = optimizer
        self.clip_grad = clip_grad
        self.defaults: dict[str, Any] = {}
        # Decides from the gradient norm whether the step may update the weights (the strategy's non-finite guard).
        self.should_update: Callable[[float], bool] | None = None

    @classmethod
    def build(
        cls,
        engine: Any,
        name: str = "adamw",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        clip_grad: float = 0.0,
        precision: str = "32-true",
        loss_scaling: dict[str, float] | None = None,
    ) -> "MegatronOptimizer":
        """The optimizer named ``name`` (``adamw``, ``adam`` or ``sgd``: checked by
        :func:`speechtrain.core.optim.build_optimizer`) over ``engine``'s model chunk. ``loss_scaling``: the fp16
        loss scaler's ``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window`` and ``hysteresis`` (Megatron's
        ``OptimizerConfig`` names; unset ones keep Megatron's defaults, which are NeMo's: 2^32, 1, 1000, 2)."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="sgd" if name == "sgd" else "adam",
            lr=lr,
            weight_decay=weight_decay,
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            adam_eps=eps,
            decoupled_weight_decay=name != "adam",  # adam: L2 added to the gradient; adamw: decoupled
            sgd_momentum=momentum,
            bf16=precision == "bf16-true",
            fp16=precision == "16-mixed",
            params_dtype=torch.bfloat16 if precision == "bf16-true" else torch.float32,
            use_distributed_optimizer=engine.use_distributed_optimizer,
            clip_grad=clip_grad,
            **(loss_scaling or {}),
        )
        with cuda_tensor_types():
            mcore = get_megatron_optimizer(config, [engine.ddp])
        if len(getattr(mcore, "chained_optimizers", ())) == 1:  # a chain of one (no expert parameters here)
            mcore = mcore.chained_optimizers[0]
        fused_cpu_kernels(mcore)
        # Megatron's own LR scheduler applies the per-group multipliers at every step; under Lightning's
        # schedulers (which scale each group's initial lr) they are applied once, here.
        for group in mcore.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
        if precision == "16-mixed":
            engine.config.grad_scale_func = mcore.scale_loss  # Megatron's schedules scale the loss before backward
        return cls(mcore, clip_grad=clip_grad)

    # ----------------------------------------------- what torch and Lightning see: the Megatron optimizer's groups
    param_groups = property(lambda self: self.mcore.param_groups)  # type: ignore[assignment]
    state = property(lambda self: self.mcore.state)  # type: ignore[assignment]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op: Lightning calls it after ``training_step``, whose schedule has already run backward. The
        strategy zeroes the gradients (``mcore.zero_grad`` and the DDP buffers) before an optimizer step's first
        batch."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Update the weights from the reduced gradients (see module docstring); skipped on fp16 overflow and
        when ``should_update`` says no."""
        from megatron.core.optimizer import clip_grads

        # Lightning's closure (the step's forward and backward, then its on_before_optimizer_step hooks and clipping).
        result = None if closure is None else torch.enable_grad()(closure)()
        overflow = self.mcore.prepare_grads()  # fp16: Megatron's scaler has already backed off
        norm = math.inf if overflow else float(self.mcore.get_grad_norm())
        if overflow or (self.should_update is not None and not self.should_update(norm)):
            return result
        if self.clip_grad > 0:
            decoupled = self.mcore.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            with cuda_tensor_types():
                clip_grads.clip_grad_by_total_norm_fp32(self.mcore.get_parameters(), self.clip_grad, norm, decoupled)
        self.mcore.step_with_ready_grads()
        return result

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state; under the distributed optimizer the shards are gathered on data-parallel rank 0
        (a collective: every rank must call it) and the other ranks return only the common part."""
        if not self.mcore.config.use_distributed_optimizer:
            return self.mcore.state_dict()
        return {"common": self.mcore.state_dict(), "param_state": self.mcore.get_parameter_state_dp_zero()}

    @torch.no_grad()  # Megatron copies the shards into its (grad-requiring) main parameters in place
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.mcore.config.use_distributed_optimizer:
            self.mcore.load_state_dict(state_dict)
        else:
            self.mcore.load_state_dict(state_dict["common"])
            self.mcore.load_parameter_state_from_dp_zero(state_dict["param_state"])
        fused_cpu_kernels(self.mcore)  # the loaded groups carry the flags they were saved with
