"""Training progress as log lines, for runs whose output is not a terminal (``make demo > log``, a batch job).

Lightning's progress bar redraws one terminal line; written to a file it shows nothing until the end.
:class:`speechtrain.lightning.Trainer` swaps it for :class:`ProgressLog` when stdout is not a terminal: global rank
0 logs the step, the epoch, the time spent and left, and the metrics the model shows in the bar, at the first step
and then every ``SPEECHTRAIN_PROGRESS_S`` seconds (default 30); and Lightning's model-summary table (a dozen lines)
for :class:`ModelSizeLine`, one line.
"""

import logging
import time
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import Timer

from speechtrain.common.progress import format_duration, progress_interval

logger = logging.getLogger("speechtrain.progress")


class ProgressLog(Callback):
    """Logs a progress line at the first training step and every ``every_s`` seconds after it (global rank 0)."""

    def __init__(self, every_s: float | None = None) -> None:
        self.every_s = progress_interval() if every_s is None else every_s
        self.start = self.last = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.start, self.last = time.monotonic(), None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return
        now = time.monotonic()
        if self.last is not None and now - self.last < self.every_s:
            return
        self.last = now
        logger.info(self.line(trainer, now))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero and self.start is not None:
            elapsed = format_duration(time.monotonic() - self.start)
            logger.info("training: done, %d steps in %s", trainer.global_step, elapsed)

    def line(self, trainer: Any, now: float) -> str:
        elapsed = now - (self.start if self.start is not None else now)
        step, max_steps = trainer.global_step, trainer.max_steps
        left = self._time_left(trainer, elapsed, step, max_steps)
        shown = f"step {step:,}" + (f"/{max_steps:,}" if max_steps and max_steps > 0 else "")
        shown += f", epoch {trainer.current_epoch}, {format_duration(elapsed)} elapsed"
        shown += f", {format_duration(left)} left" if left is not None else ""
        metrics = {k: v for k, v in trainer.progress_bar_metrics.items() if k != "v_num"}
        values = " ".join(f"{k}={_short(v)}" for k, v in list(metrics.items())[:5])
        return f"training: {shown}" + (f" | {values}" if values else "")

    @staticmethod
    def _time_left(trainer: Any, elapsed: float, step: int, max_steps: int) -> float | None:
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        remaining = timer.time_remaining("train") if timer is not None else None
        left = [remaining] if remaining else []
        if max_steps and max_steps > 0 and step > 0:
            left.append(elapsed / step * (max_steps - step))
        return min(left) if left else None


class ModelSizeLine(Callback):
    """One log line with the model's parameter counts at the start of ``fit`` (global rank 0): what Lightning's
    summary table says in the line a log file needs."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero:
            total = sum(p.numel() for p in pl_module.parameters())
            trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
            logger.info("model: %s, %.2fM parameters (%.2fM trainable)", type(pl_module).__name__, total / 1e6,
                        trainable / 1e6)  # fmt: skip


def _short(value: Any) -> str:
    value = float(value)
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"


def logs_this_step(trainer: Any) -> bool:
    """Whether this training batch's logged values reach the loggers and the progress bar (every
    ``trainer.log_every_n_steps`` batches, Lightning's own rule). Each value a step logs costs a host
    synchronisation when Lightning converts it (or a blocking copy to the device for a Python number); the models
    and the bridge log only on these batches. True outside a training loop."""
    connector = getattr(trainer, "_logger_connector", None) if trainer is not None else None
    return True if connector is None else bool(connector.should_update_logs)
