"""Runs that survive preemption and numerical faults.

* :class:`PreemptionCallback` (registered by ``exp_manager``; NeMo's ``create_preemption_callback``): on SIGTERM
  or SIGUSR1 (SLURM's warning signals) the run finishes the current step, every rank agrees at a step boundary,
  the ``last`` checkpoint is written and training stops. Once the checkpoint is on disk (every rank's part), global
  rank 0 writes the requeue marker: ``<run folder>/requeue`` and, when the job script names one, the file
  ``$SPEECHTRAIN_REQUEUE_MARKER`` (``step=<n>`` and ``checkpoint=<path>``). A job script requeues when the marker is
  there, whatever ``srun`` reports: under ``srun --kill-on-bad-exit=1`` the other tasks are killed and ``srun``
  exits 137, not with rank 0's status. :func:`exit_if_preempted` then ends the process with
  :data:`PREEMPTED_EXIT_CODE` on global rank 0 (75, ``EX_TEMPFAIL``: "try again", for launchers without a marker).
  Started again with ``exp_manager.resume_if_exists=true``, the run continues from that checkpoint. The
  ranks agree through the trainer's :class:`~speechtrain.lightning.limits.RankAgreement` (one tiny all-reduce, with
  the wall-clock limit's flag, every ``check_interval`` steps, default 10), not every step; a single process looks
  at its own flag after every step.
* :class:`NonFiniteGuard` (owned by ``MegatronStrategy``): a step whose loss or gradient norm is not finite is
  skipped on every rank (no optimizer update, batch-norm statistics restored), counted and logged with the cut
  IDs of the batch; after ``max_consecutive`` such steps in a row the last good state is checkpointed and
  :class:`NonFiniteLossError` stops the run. The decision costs no collective, no extra pass over the gradients
  and no host sync of its own: it reads the global gradient norm that Megatron's optimizer computes anyway (reduced
  over the model-parallel ranks, the same number on every rank; a non-finite loss makes it non-finite). Under fp16
  the loss scaler skips overflowing steps first.
"""

import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from speechtrain.lightning.limits import rank_agreement

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
REQUEUE_MARKER = "requeue"  # in the run folder: the run was preempted after saving, start it again
REQUEUE_MARKER_ENV = "SPEECHTRAIN_REQUEUE_MARKER"  # a path of the job script's choosing for the same marker


def requeue_markers(trainer: pl.Trainer) -> list[Path]:
    """Where the requeue marker of ``trainer``'s run goes: the run folder's ``requeue``, and
    ``$SPEECHTRAIN_REQUEUE_MARKER`` when set (a job script knows that path before the run folder is named)."""
    markers = [Path(trainer.default_root_dir) / REQUEUE_MARKER]
    if os.environ.get(REQUEUE_MARKER_ENV):
        markers.append(Path(os.environ[REQUEUE_MARKER_ENV]))
    return markers


def write_requeue_marker(path: Path, step: int, checkpoint: Path) -> None:
    """Write the marker durably (a temporary file, fsynced, renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(f"step={step}\ncheckpoint={checkpoint}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_resume_checkpoint(trainer: pl.Trainer, fallback_name: str) -> Path:
    """Write the checkpoint a restart resumes from: the run's ``last`` checkpoint when ``exp_manager`` set up
    checkpointing, else ``<default_root_dir>/<fallback_name>``. A collective call on all ranks."""
    callback = trainer.checkpoint_callback
    if callback is not None and getattr(callback, "save_last", False) and callback.dirpath:
        path = Path(callback.format_checkpoint_name({}, callback.CHECKPOINT_NAME_LAST))
        if callback._last_global_step_saved != trainer.global_step or not path.exists():
            callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))
        path = Path(callback.last_model_path or path)
    else:
        path = Path(trainer.default_root_dir) / fallback_name
        trainer.save_checkpoint(path)
    # An asynchronous save (MegatronStrategy's async_save) is complete only once finalized: the restart needs it.
    wait = getattr(trainer.strategy, "wait_for_checkpoint", None)
    if wait is not None:
        wait()
    return path


class PreemptionCallback(pl.Callback):
    """Checkpoint and stop at the next step boundary after SIGTERM / SIGUSR1 (see the module docstring).

    Args:
        signals: names of the signals that mean "you are about to be preempted".
        check_interval: in a distributed run, the ranks compare their flags every this many steps.
    """

    def __init__(self, signals: tuple[str, ...] = PREEMPTION_SIGNALS, check_interval: int = 10) -> None:
        if check_interval < 1:
            raise ValueError(f"PreemptionCallback: check_interval must be >= 1, got {check_interval}.")
        self.signals = [getattr(signal, name) for name in signals]
        self.check_interval = check_interval
        self.received: int | None = None
        self.preempted = False
        self.checkpoint: Path | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is None:
            logger.warning("Received %s: saving a checkpoint at the end of this step, then stopping.",
                           signal.Signals(signum).name)  # fmt: skip
        self.received = signum

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning's own handlers (which would kill the processes without a checkpoint on SIGTERM).
        import threading

        if threading.current_thread() is not threading.main_thread():
            logger.warning("PreemptionCallback: not in the main thread; signals are not handled.")
            return
        for signum in self.signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handler)
        agreement = rank_agreement(trainer)  # the ranks compare their flags with the other periodic checks
        agreement.every = self.check_interval
        agreement.register("preempted", lambda: self.received is not None)
        if trainer.is_global_zero:  # a marker of an earlier, preempted start of this run: that start is resumed
            for marker in requeue_markers(trainer):
                if marker.is_file() and marker.read_text().startswith("step="):
                    marker.unlink(missing_ok=True)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if trainer.world_size > 1:
            if not rank_agreement(trainer).at_step_end(trainer).get("preempted"):
                return
        elif self.received is None:
            return
        self.checkpoint = save_resume_checkpoint(trainer, "preempted.ckpt")  # (returns when every rank saved)
        self.preempted = True
        trainer.should_stop = True
        if trainer.is_global_zero:
            markers = requeue_markers(trainer)
            for marker in markers:
                write_requeue_marker(marker, trainer.global_step, self.checkpoint)
            logger.warning("Preempted: saved %s at step %d and wrote %s; stopping (exit code %d). Restart the same "
                           "command with exp_manager.resume_if_exists=true to continue.", self.checkpoint,
                           trainer.global_step, " and ".join(map(str, markers)), PREEMPTED_EXIT_CODE)  # fmt: skip

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._handler:  # Lightning may have restored its originals already
                signal.signal(signum, handler)
        self._previous = {}


def was_preempted(trainer: pl.Trainer) -> bool:
    """Whether a :class:`PreemptionCallback` of ``trainer`` stopped its run."""
    return any(isinstance(cb, PreemptionCallback) and cb.preempted for cb in trainer.callbacks)


def exit_if_preempted(trainer: pl.Trainer) -> None:
    """After ``fit``: if a :class:`PreemptionCallback` stopped the run, exit the process (global rank 0 with
    :data:`PREEMPTED_EXIT_CODE`, the others with 0 so that a launcher does not kill rank 0 before it exits)."""
    if was_preempted(trainer):
        sys.exit(PREEMPTED_EXIT_CODE if trainer.is_global_zero else 0)


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradients."""


class NonFiniteGuard:
    """Decides, from the step's loss and gradient norm, whether it may update the weights (see module docstring).

    The strategy calls :meth:`before_step` when an optimizer step's first batch starts, :meth:`observe` with each
    batch's reduced loss, and the optimizer calls :meth:`check` with the global gradient norm.

    Args:
        max_consecutive: stop after this many skipped steps in a row (0: never skip; a non-finite step then
            updates the weights as it would without the guard).
    """

    def __init__(self, max_consecutive: int = 10) -> None:
        if max_consecutive < 0:
            raise ValueError(f"max_consecutive_nonfinite_steps must be >= 0, got {max_consecutive}.")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0
        self._norm_buffers: list[torch.Tensor] | None = None  # found once, at the first step
        self._norm_saved: list[torch.Tensor] = []
        self._losses: list[torch.Tensor] = []
        self._ids: list[Any] = []

    def before_step(self, module: torch.nn.Module) -> None:
        """Remember the batch-norm running statistics: a skipped step's forward pass (NaN activations) would
        otherwise poison them, and every later evaluation with them. One fused copy, no Python loop per step."""
        self._losses, self._ids = [], []
        if self.max_consecutive == 0:
            return
        if self._norm_buffers is None:
            norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]
            self._norm_buffers = [b for m in norms for b in m.buffers(recurse=False) if b.is_floating_point()]
            self._norm_saved = [b.detach().clone() for b in self._norm_buffers]
        elif self._norm_buffers:
            torch._foreach_copy_(self._norm_saved, self._norm_buffers)

    def observe(self, loss: torch.Tensor, batch: Any) -> None:
        """One batch of the step: its loss (already reduced over the data-parallel ranks) and cut IDs."""
        self._losses.append(loss.detach())
        if isinstance(batch, dict):
            self._ids.extend(batch.get("ids", []))

    def check(self, trainer: pl.Trainer, module: torch.nn.Module, grad_norm: float | None) -> bool:
        """True when this step may update the weights. Otherwise the step is counted and logged, the batch-norm
        statistics are restored, and after ``max_consecutive`` in a row the last good state is saved and
        :class:`NonFiniteLossError` raised. The same answer on every rank, without a collective.

        The decision reads the gradient norm alone: a non-finite loss gives non-finite gradients through the
        backward pass, and reading the loss too would be a second host synchronisation. Without a norm (none was
        computed) it reads the step's losses."""
        if self.max_consecutive == 0:
            return True
        if grad_norm is not None:
            finite = math.isfinite(grad_norm)
        else:
            finite = bool(torch.isfinite(torch.stack(self._losses)).all()) if self._losses else True
        if finite:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.total += 1
        if self._norm_buffers:
            with torch.no_grad():
                torch._foreach_copy_(self._norm_buffers, self._norm_saved)
        ids = list(self._ids)
        shown = ", ".join(map(str, ids[:20])) + (f" ... ({len(ids)} in all)" if len(ids) > 20 else "")
        logger.warning("Step %d: non-finite loss or gradients; the optimizer step is skipped (%d in a row, %d in "
                       "this run). Cuts in this rank's batch: %s", trainer.global_step, self.consecutive, self.total,
                       shown or "(no ids)")  # fmt: skip
        if self.consecutive >= self.max_consecutive:
            path = save_resume_checkpoint(trainer, f"nonfinite-step={trainer.global_step}.ckpt")
            raise NonFiniteLossError(
                f"{self.consecutive} consecutive steps had a non-finite loss or gradients (the last at step "
                f"{trainer.global_step}; cuts in this rank's batch: {shown or '(no ids)'}). The last good state is "
                f"saved in {path}. Check those cuts, lower the learning rate or raise gradient clipping, then "
                "resume from it; trainer.strategy.max_consecutive_nonfinite_steps sets the patience."
            )
        return False

    def state_dict(self) -> dict[str, int]:
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consecutive, self.total = int(state.get("consecutive", 0)), int(state.get("total", 0))
