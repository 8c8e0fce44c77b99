"""Megatron Core's optimizer, presented to Lightning and torch's LR schedulers as a ``torch.optim.Optimizer``.

``get_megatron_optimizer`` builds it over the DDP-wrapped model chunk: the torch (or fused) Adam/AdamW/SGD inside;
fp32 main parameters under ``bf16-true``; ``DynamicGradScaler`` under ``16-mixed``; ``DistributedOptimizer``
(states and main parameters sharded over the data-parallel ranks, gradients reduce-scattered, parameters
all-gathered after the step) for ``use_distributed_optimizer``. Weight decay skips biases and other 1-D
parameters (Megatron's rule).

One step, composed from Megatron's own stages so that the non-finite guard can sit between them:
``prepare_grads`` (main gradients; fp16: unscale, found-inf over the model-parallel ranks, scaler update) ->
``get_grad_norm`` (the global norm over TP/PP ranks, and DP shards under the distributed optimizer; the step's one
host sync, skipped where neither clipping nor the guard needs it and the step logs nothing) -> the guard's decision
from that norm (identical on every rank: no collective) ->
clipping by that norm -> ``step_with_ready_grads``. Megatron's ``step()`` runs the same stages without the guard.

Where the DDP's contiguous gradient buffers hold exactly the gradients that Megatron norms and clips (fp32
gradients, no tensor or pipeline parallelism, no distributed optimizer, no shared or separately normed parameters:
:func:`whole_gradient_buffers`), the norm is one norm per buffer and the clipping one scale per buffer, instead of
one per parameter (Megatron's loop dispatches one operator, one kernel launch on a GPU, per tensor); the numbers are
Megatron's within fp32 rounding (the sum of squares in another order). Elsewhere Megatron's own functions run.
"""

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from speechtrain.lightning.megatron_compat import cuda_tensor_types, fused_cpu_kernels

logger = logging.getLogger(__name__)


class MegatronOptimizer(torch.optim.Optimizer):
    """A Megatron Core optimizer under torch's ``Optimizer`` type (see module docstring).

    ``torch.optim.Optimizer.__init__`` is deliberately not called: this object owns no parameter groups of its
    own; ``param_groups`` and ``state`` are the Megatron optimizer's, so LR schedulers and checkpoints act on it.

    Args:
        optimizer: the ``MegatronOptimizer`` from ``get_megatron_optimizer``.
        clip_grad: clip the global gradient norm to this (0: no clipping; the norm is computed anyway).
    """

    def __init__(self, optimizer: Any, clip_grad: float = 0.0, buffers: list | None = None) -> None:
        self.mcore = optimizer
        self.clip_grad = clip_grad
        self.buffers = buffers  # the DDP gradient buffers that hold exactly the gradients to norm and clip, or None
        self.defaults: dict[str, Any] = {}
        # Decides from the gradient norm whether the step may update the weights (the strategy's non-finite guard).
        self.should_update: Callable[[float | None], bool] | None = None
        self.needs_norm: Callable[[], bool] | None = None  # None: always compute the gradient norm

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
        muon_momentum: float = 0.95,
        ns_steps: int = 5,
    ) -> "MegatronOptimizer":
        """The optimizer named ``name`` (``adamw``, ``adam``, ``sgd`` or ``muon``: checked by
        :func:`speechtrain.core.optim.build_optimizer`) over ``engine``'s model chunk. ``loss_scaling``: the fp16
        loss scaler's ``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window`` and ``hysteresis`` (Megatron's
        ``OptimizerConfig`` names; unset ones keep Megatron's defaults, which are NeMo's: 2^32, 1, 1000, 2).

        ``muon``: Megatron's AdamW is built as for ``adamw``, then its hidden weight matrices move to Muon
        (:mod:`speechtrain.lightning.muon`; ``muon_momentum``, ``ns_steps``), all else staying in Megatron's
        optimizer (main parameters, loss scaling, norms, clipping, the non-finite guard)."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        adamw_modules = getattr(engine.module, "MUON_ADAMW_MODULES", None)
        if name == "muon" and adamw_modules is None:
            raise ValueError(
                f"model.optim.name=muon: {type(engine.module).__name__} does not name its input and output layers "
                "(MUON_ADAMW_MODULES), which must stay with AdamW; choose adamw."
            )
        if name == "muon" and engine.use_distributed_optimizer:
            raise ValueError(
                "model.optim.name=muon cannot run with trainer.strategy.use_distributed_optimizer=true: the "
                "distributed optimizer shards flat slices of many matrices, and Muon updates whole matrices."
            )
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
        if name == "muon":
            mcore.optimizer = _muon_over(mcore, engine.module, adamw_modules, muon_momentum, ns_steps)
            # Megatron matches a checkpoint's groups to the optimizer's by (wd_mult, lr_mult, ...), which the Muon
            # and AdamW halves of one of its groups share; the saved groups come in the order this build makes.
            mcore._filter_and_reorder_param_groups = lambda current, saved: saved
        fused_cpu_kernels(mcore)
        # Megatron's own LR scheduler applies the per-group multipliers at every step; under Lightning's
        # schedulers (which scale each group's initial lr) they are applied once, here.
        for group in mcore.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
        if precision == "16-mixed":
            engine.config.grad_scale_func = mcore.scale_loss  # Megatron's schedules scale the loss before backward
        return cls(mcore, clip_grad=clip_grad, buffers=whole_gradient_buffers(mcore, engine.ddp))

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
        # The norm costs the step's one host synchronisation: computed for clipping and the non-finite guard, else
        # only on the steps whose metrics are logged (``needs_norm``).
        needed = self.clip_grad > 0 or self.needs_norm is None or self.needs_norm()
        norm = math.inf if overflow else float(self._grad_norm()) if needed else None
        if overflow or (self.should_update is not None and not self.should_update(norm)):
            return result
        if self.clip_grad > 0 and self.buffers is not None:
            coefficient = self.clip_grad / (norm + 1.0e-6)  # Megatron's ``clip_grad_by_total_norm_fp32``
            if coefficient < 1.0:
                torch._foreach_mul_([buffer.grad_data for buffer in self.buffers], coefficient)
        elif self.clip_grad > 0:
            decoupled = self.mcore.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            with cuda_tensor_types():
                clip_grads.clip_grad_by_total_norm_fp32(self.mcore.get_parameters(), self.clip_grad, norm, decoupled)
        self.mcore.step_with_ready_grads()
        return result

    def _grad_norm(self) -> torch.Tensor:
        """The global gradient norm (a device tensor: the caller's ``float`` is the step's host sync)."""
        if self.buffers is None:
            return self.mcore.get_grad_norm()
        norms = torch._foreach_norm([buffer.grad_data for buffer in self.buffers])
        return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))

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


def whole_gradient_buffers(mcore: Any, ddp: Any) -> list | None:
    """``ddp``'s gradient buffers (Megatron's ``_ParamAndGradBuffer``) when their ``grad_data`` hold exactly the
    gradients that ``mcore`` norms and clips, else None. Megatron's ``FP32Optimizer`` hands the optimizer the
    buffers' own views as gradients (``param.grad = param.main_grad``; the mixed-precision optimizers copy them into
    separate fp32 tensors and the distributed one owns a shard of each); the buffers' padding is zero and reduces to
    zero. The norm skips tensor-parallel duplicates, shared parameters (tied embeddings) and separately normed
    ones, and sums over the model-parallel ranks: where any of these is present Megatron's path stays."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.optimizer import FP32Optimizer, _get_param_grad_norm_group
    from megatron.core.transformer.module import param_is_not_shared

    if type(mcore) is not FP32Optimizer or ddp.expert_parallel_buffers or not ddp.buffers:
        return None
    if torch.distributed.get_world_size(mcore.get_grad_stats_parallel_group()) != 1:
        return None
    params = mcore.get_parameters()
    in_buffers = [p for buffer in ddp.buffers for p in buffer.params]
    if len(params) != len(in_buffers) or {id(p) for p in params} != {id(p) for p in in_buffers}:
        return None
    exact = all(
        param_is_not_shared(p)
        and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)
        and tensor_parallel.param_is_not_gtp_duplicate(p)
        and _get_param_grad_norm_group(p) is None
        and p.dtype == torch.float32
        for p in params
    )
    return list(ddp.buffers) if exact and all(b.grad_data.dtype == torch.float32 for b in ddp.buffers) else None


def _muon_over(mcore: Any, module: torch.nn.Module, adamw_modules: Any, momentum: float, ns_steps: int) -> Any:
    """Megatron's inner AdamW (``mcore.optimizer``) split into Muon + AdamW (:mod:`speechtrain.lightning.muon`),
    the data-parallel ranks sharing Muon's iterations. Under ``bf16-true`` Megatron's groups hold fp32 main copies
    of the bf16 weights, in the same places: the matrices are found through the copies."""
    from speechtrain.lightning import parallel_state
    from speechtrain.lightning.muon import muon_parameters, split_for_muon

    chosen = muon_parameters(module, adamw_modules)
    for model_params, main_params in zip(getattr(mcore, "float16_groups", ()),
                                         getattr(mcore, "fp32_from_float16_groups", ()), strict=True):  # fmt: skip
        chosen |= {id(main) for p, main in zip(model_params, main_params, strict=True) if id(p) in chosen}
    ranks = parallel_state.data_parallel_world_size()
    split = split_for_muon(
        mcore.optimizer, chosen, momentum, ns_steps, parallel_state.data_parallel_group() if ranks > 1 else None
    )
    matrices = [p for g in split.muon.param_groups for p in g["params"]]
    others = [p for o in split.optimizers[1:] for g in o.param_groups for p in g["params"]]
    logger.info("Muon on %d weight matrices (%.2fM parameters, iterations shared by %d data-parallel ranks), AdamW "
                "on %d other tensors (%.2fM).", len(matrices), sum(p.numel() for p in matrices) / 1e6, ranks,
                len(others), sum(p.numel() for p in others) / 1e6)  # fmt: skip
    return split
