"""Optimizer and learning-rate schedule built from the ``model.optim`` config node (NeMo's vocabulary)."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from speechtrain.lightning.megatron_parallel import MegatronParallel
from speechtrain.lightning.optimizer import MegatronOptimizer


@dataclass
class SchedConfig:
    """Learning-rate schedule (NeMo's names are accepted too: ``CosineAnnealing``, ``NoamAnnealing``,
    ``InverseSquareRootAnnealing``).

    Attributes:
        name: ``cosine`` (linear warm-up, then cosine decay to ``min_lr`` at ``max_steps``), ``noam`` (linear warm-up
            to ``lr * d_model^-0.5 * warmup^-0.5``, then decay as ``1/sqrt(step)``; the Transformer paper's schedule),
            ``inverse_sqrt`` (linear warm-up to ``lr``, then ``lr * sqrt(warmup / step)``), ``linear`` (warm-up, then
            a straight line to ``min_lr``; NeMo's ``WarmupAnnealing``), ``wsd`` (warm-up, stable at ``lr``, then a
            straight line to ``min_lr`` over the last ``decay_ratio`` of the run: warm-up-stable-decay), ``constant``
            (warm-up, then flat) or ``none``.
        warmup_steps: linear warm-up length in optimizer steps.
        warmup_ratio: warm-up as a fraction of the run (of ``max_steps``, or of ``trainer.max_time`` for runs bounded
            by time); set it or ``warmup_steps``, not both.
        min_lr: floor of the learning rate after the warm-up (the end point of the cosine, linear and wsd decays).
        max_steps: decay length; ``-1`` takes the trainer's ``max_steps`` (estimated from epochs when unset).
        d_model: the model width of the Noam schedule's scale ``d_model^-0.5`` (NeMo's default 1: no scaling).
        decay_ratio: ``wsd``: the fraction of the run after the warm-up spent decaying (0 < it <= 1; 1 is ``linear``).
    """

    name: str = "cosine"
    warmup_steps: int = 0
    warmup_ratio: float | None = None
    min_lr: float = 0.0
    max_steps: int = -1
    d_model: int = 1
    decay_ratio: float = 0.2


# NeMo's scheduler names -> ours.
SCHEDULE_ALIASES = {"CosineAnnealing": "cosine", "NoamAnnealing": "noam", "InverseSquareRootAnnealing": "inverse_sqrt",
                    "WarmupAnnealing": "linear"}  # fmt: skip
SCHEDULES = ("cosine", "noam", "inverse_sqrt", "linear", "wsd", "constant", "none")
OPTIMIZERS = ("adamw", "adam", "sgd", "muon")


@dataclass
class OptimConfig:
    """Optimizer: ``adamw``, ``adam``, ``sgd`` or ``muon`` (Muon for the hidden weight matrices, AdamW with ``betas``
    for the rest, one ``lr`` and schedule for both: :mod:`speechtrain.lightning.muon`), with its usual
    hyper-parameters (``momentum``: SGD's; ``muon_momentum``, ``ns_steps``: Muon's Nesterov momentum and
    Newton-Schulz iterations)."""

    name: str = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    weight_decay: float = 1e-3
    momentum: float = 0.9
    muon_momentum: float = 0.95
    ns_steps: int = 5
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
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer model.optim.name={cfg.name!r}; choose {', '.join(OPTIMIZERS)}.")
    engine = MegatronParallel.active
    if engine is not None:
        trainable = {id(p) for p in engine.module.parameters() if p.requires_grad}
        if trainable != {id(p) for p in params}:
            raise ValueError(
                "Under MegatronStrategy the optimizer covers exactly the model's trainable parameters "
                f"({len(trainable)}), but {len(params)} were given: freeze parameters with requires_grad=False "
                "before training starts instead of leaving them out of the optimizer."
            )
        strategy = getattr(getattr(engine.module, "_trainer", None), "strategy", None)
        precision = strategy.precision_plugin.precision if strategy is not None else "32-true"
        return MegatronOptimizer.build(
            engine,
            name=cfg.name,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            weight_decay=cfg.weight_decay,
            momentum=cfg.momentum,
            precision=precision,
            loss_scaling=getattr(strategy, "loss_scaling", None),
            muon_momentum=cfg.muon_momentum,
            ns_steps=cfg.ns_steps,
        )
    if cfg.name == "muon":
        raise ValueError("model.optim.name=muon runs under MegatronStrategy (the training scripts' strategy) only.")
    groups = _weight_decay_groups(params, cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    optimizer_class = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return optimizer_class(groups, lr=cfg.lr, betas=tuple(cfg.betas))


def _schedule_name(sched: SchedConfig) -> str:
    name = SCHEDULE_ALIASES.get(sched.name, sched.name)
    if name not in SCHEDULES:
        choices = ", ".join([*SCHEDULES, *SCHEDULE_ALIASES])
        raise ValueError(f"Unknown schedule model.optim.sched.name={sched.name!r}; choose one of {choices}.")
    return name


def lr_factor(
    step: int, sched: SchedConfig, max_steps: int, base_lr: float, progress: Callable[[], float] | None = None
) -> float:
    """Multiplier of the base learning rate at optimizer step ``step``.

    ``progress`` (fraction of the run done, e.g. of ``trainer.max_time``) replaces ``step / max_steps`` for the decay
    when given; the warm-up counts steps (``warmup_steps``) or that fraction (``warmup_ratio``).
    """
    name = _schedule_name(sched)
    min_factor = sched.min_lr / base_lr if base_lr > 0 else 0.0
    ratio = sched.warmup_ratio or 0.0
    if name in ("noam", "inverse_sqrt"):
        warmup = max(1, math.ceil(ratio * max_steps) if ratio > 0 else sched.warmup_steps)
        s = step + 1
        if name == "noam":
            # Vaswani et al.: d^-0.5 * min(s^-0.5, s * w^-1.5); peaks at d^-0.5 * w^-0.5 at s = w.
            factor = sched.d_model**-0.5 * min(s**-0.5, s * warmup**-1.5)
        else:
            factor = s / warmup if s < warmup else math.sqrt(warmup / s)
        return factor if s <= warmup else max(factor, min_factor)
    done = None if progress is None else min(1.0, max(0.0, progress()))
    if done is not None and ratio > 0:
        # A run bounded by wall-clock time warms up over its first ``warmup_ratio`` of that time.
        if done < ratio:
            return done / ratio
        decay = (done - ratio) / (1.0 - ratio)
    else:
        warmup = math.ceil(ratio * max_steps) if ratio > 0 else sched.warmup_steps
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        decay = done if done is not None else min(1.0, (step - warmup) / max(1, max_steps - warmup))
    if name == "constant":
        return 1.0
    if name in ("linear", "wsd"):
        span = sched.decay_ratio if name == "wsd" else 1.0
        return min_factor + (1.0 - min_factor) * min(1.0, (1.0 - decay) / span)
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * decay))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: OptimConfig,
    max_steps: int,
    progress: Callable[[], float] | None = None,
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A per-step ``LambdaLR`` for ``cfg.sched``, or None for ``name: none``. With ``progress`` (a wall-clock
    fraction for runs bounded by ``max_time``), the decay follows it instead of ``step / max_steps``."""
    sched = cfg.sched
    name = _schedule_name(sched)
    if name == "none":
        return None
    if sched.warmup_ratio is not None and sched.warmup_steps > 0:
        raise ValueError(
            f"model.optim.sched sets both warmup_steps={sched.warmup_steps} and warmup_ratio={sched.warmup_ratio}: "
            "set one of them (the other to 0 / null)."
        )
    if sched.warmup_ratio is not None and not 0.0 <= sched.warmup_ratio < 1.0:
        raise ValueError(f"model.optim.sched.warmup_ratio must be in [0, 1), got {sched.warmup_ratio}.")
    if name == "wsd" and not 0.0 < sched.decay_ratio <= 1.0:
        raise ValueError(f"model.optim.sched.decay_ratio must be in (0, 1], got {sched.decay_ratio}.")
    if name in ("noam", "inverse_sqrt") and sched.warmup_steps <= 0 and not sched.warmup_ratio:
        raise ValueError(
            f"The {sched.name} schedule needs a warm-up: set model.optim.sched.warmup_steps or warmup_ratio."
        )
    total = sched.max_steps if sched.max_steps > 0 else max_steps
    if sched.max_steps > 0:
        progress = None
    if name in ("noam", "inverse_sqrt") and sched.warmup_ratio and total <= 0:
        raise ValueError(
            f"model.optim.sched.warmup_ratio with the {sched.name} schedule needs the run's length in steps: set "
            "trainer.max_steps or model.optim.sched.max_steps (or use warmup_steps)."
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, sched, total, cfg.lr, progress))
