"""Optimizer and learning-rate schedule built from the ``model.optim`` config node (NeMo's vocabulary)."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from speechtrain.lightning.megatron_parallel import active_engine


@dataclass
class SchedConfig:
    """Learning-rate schedule.

    Attributes:
        name: ``cosine`` (linear warm-up, then cosine decay to ``min_lr`` at ``max_steps``), ``constant``
            (warm-up, then flat) or ``none``.
        warmup_steps: linear warm-up length in optimizer steps.
        min_lr: final learning rate of the cosine decay.
        max_steps: decay length; ``-1`` takes the trainer's ``max_steps`` (estimated from epochs when unset).
    """

    name: str = "cosine"
    warmup_steps: int = 0
    min_lr: float = 0.0
    max_steps: int = -1


@dataclass
class OptimConfig:
    """Optimizer: ``adamw``, ``adam`` or ``sgd``, with its usual hyper-parameters."""

    name: str = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    weight_decay: float = 1e-3
    momentum: float = 0.9
    sched: SchedConfig = field(default_factory=SchedConfig)


def _weight_decay_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Megatron's rule, for the same numbers with and without the bridge: no weight decay on biases and other 1-D
    parameters (norm scales)."""
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]]  # fmt: skip


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg.name`` over ``params``.

    Under ``MegatronStrategy`` this is Megatron Core's optimizer over the DDP-wrapped model (fp32 main parameters,
    loss scaling, the distributed optimizer and clipping as the run asks; see
    :class:`speechtrain.lightning.MegatronOptimizer`), covering the model's trainable parameters, which must be
    ``params``. Elsewhere (a plain Lightning run) it is the torch optimizer with the same weight-decay rule.
    """
    if cfg.name not in ("adamw", "adam", "sgd"):
        raise ValueError(f"Unknown optimizer model.optim.name={cfg.name!r}; choose adamw, adam or sgd.")
    engine = active_engine()
    if engine is not None:
        trainable = {id(p) for p in engine.module.parameters() if p.requires_grad}
        if trainable != {id(p) for p in params}:
            raise ValueError(
                "Under MegatronStrategy the optimizer covers exactly the model's trainable parameters "
                f"({len(trainable)}), but {len(params)} were given: freeze parameters with requires_grad=False "
                "before training starts instead of leaving them out of the optimizer."
            )
        trainer = getattr(engine.module, "_trainer", None)
        precision = trainer.strategy.precision_plugin.precision if trainer is not None else "32-true"
        return engine.build_optimizer(
            name=cfg.name,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            weight_decay=cfg.weight_decay,
            momentum=cfg.momentum,
            precision=precision,
        )
    groups = _weight_decay_groups(params, cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    optimizer_class = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return optimizer_class(groups, lr=cfg.lr, betas=tuple(cfg.betas))


def lr_factor(
    step: int, sched: SchedConfig, max_steps: int, base_lr: float, progress: Callable[[], float] | None = None
) -> float:
    """Multiplier of the base learning rate at optimizer step ``step``.

    ``progress`` (fraction of the run done, e.g. of ``trainer.max_time``) replaces ``step / max_steps`` for the decay
    when given; the warm-up still counts steps.
    """
    if sched.warmup_steps > 0 and step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    if sched.name == "constant":
        return 1.0
    if progress is not None:
        progress = min(1.0, max(0.0, progress()))
    else:
        progress = min(1.0, (step - sched.warmup_steps) / max(1, max_steps - sched.warmup_steps))
    min_factor = sched.min_lr / base_lr if base_lr > 0 else 0.0
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: OptimConfig,
    max_steps: int,
    progress: Callable[[], float] | None = None,
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A per-step ``LambdaLR`` for ``cfg.sched``, or None for ``name: none``. With ``progress`` (a wall-clock
    fraction for runs bounded by ``max_time``), the decay follows it instead of ``step / max_steps``."""
    sched = cfg.sched
    if sched.name == "none":
        return None
    if sched.name not in ("cosine", "constant"):
        raise ValueError(f"Unknown schedule model.optim.sched.name={sched.name!r}; choose cosine, constant or none.")
    total = sched.max_steps if sched.max_steps > 0 else max_steps
    if sched.max_steps > 0:
        progress = None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, sched, total, cfg.lr, progress))
