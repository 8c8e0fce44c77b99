"""Lightning's per-batch checks that cost a host synchronisation, made every few steps instead, together.

Lightning's ``Timer`` (``trainer.max_time``, which every recipe sets) asks rank 0 after every batch whether the time
is up and broadcasts the answer as a pickled object (``broadcast_object_list``: a host round trip), and its training
loop broadcasts a SIGTERM flag and reads it back (``.item()``) before every batch. On a GPU each is a point where
the host waits for the device to finish the step. Both decisions can wait a few steps:

- :class:`RankAgreement` (``trainer.rank_agreement``) collects the flags every rank must agree on (the time is
  up, a preemption signal arrived, Lightning saw SIGTERM) and reduces them all in one all-reduce every
  ``every`` optimizer steps, on the host (a gloo group): no device synchronisation at all;
- :class:`WallClockLimit` is Lightning's ``Timer`` (the same state, checkpoints and ``time_remaining``) whose
  check reads that agreement;
- :func:`sparse_sigterm_checks` makes the loop's SIGTERM broadcast run only when the agreement says a rank saw
  SIGTERM (speechtrain's own preemption handling,
  :class:`~speechtrain.lightning.fault_tolerance.PreemptionCallback`, reads the agreement too).
"""

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import Timer

CHECK_EVERY_N_STEPS = 10


class RankAgreement:
    """Named flags of this rank (registered callables), reduced over the world (any rank set: set) together at the
    end of every ``every``-th optimizer step; :meth:`at_step_end` gives the agreed flags, the same on every rank, or
    an empty dict between agreements. A single process needs no reduction and agrees at every step."""

    def __init__(self, every: int = CHECK_EVERY_N_STEPS) -> None:
        self.every = max(1, every)
        self.sources: dict[str, Callable[[], bool]] = {}
        self.step: int | None = None
        self.agreed: dict[str, bool] = {}

    def register(self, name: str, source: Callable[[], bool]) -> None:
        self.sources[name] = source

    def at_step_end(self, trainer: Any) -> dict[str, bool]:
        step = trainer.global_step
        if step == self.step:  # asked again within the same step (several listeners, accumulation)
            return self.agreed
        distributed = trainer.world_size > 1 and torch.distributed.is_initialized()
        if distributed and step % self.every:
            return {}
        names = list(self.sources)
        flags = [bool(self.sources[name]()) for name in names]
        if distributed and names:
            # Host flags, reduced on the host: a CPU tensor over a gloo group never waits for the device.
            tensor = torch.tensor(flags, dtype=torch.uint8, device="cpu")
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=host_group())
            flags = [value > 0 for value in tensor.tolist()]
        self.step, self.agreed = step, dict(zip(names, flags, strict=True))
        return self.agreed


_HOST_GROUP: list[Any] = [None, None]  # [the default process group it was made for, the gloo group]


def host_group() -> Any:
    """A gloo group over every rank, for host values (flags, counters read on the host): the default group when it
    is gloo already, else one made on first use. Every rank calls this at the same point (``new_group`` is a
    collective), and a new default group (a re-initialised world) gets its own."""
    default = torch.distributed.distributed_c10d._get_default_group()
    if torch.distributed.get_backend(default) == "gloo":
        return default
    if _HOST_GROUP[0] is not default:
        _HOST_GROUP[:] = [default, torch.distributed.new_group(backend="gloo")]
    return _HOST_GROUP[1]


def rank_agreement(trainer: Any) -> RankAgreement:
    """The trainer's :class:`RankAgreement` (made on first use, for a plain Lightning trainer too)."""
    agreement = getattr(trainer, "rank_agreement", None)
    if agreement is None:
        agreement = trainer.rank_agreement = RankAgreement()
    return agreement


class AgreeAtStepEnd(Callback):
    """Runs the trainer's :class:`RankAgreement` at the end of every training batch (the listeners read it)."""

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        rank_agreement(trainer).at_step_end(trainer)


class WallClockLimit(Timer):
    """``Timer(duration, interval="step")`` whose check is the trainer's :class:`RankAgreement` (a run stops at most
    ``every`` steps after its time is up; any rank out of time stops every rank)."""

    def __init__(self, duration: Any, **kwargs: Any) -> None:
        super().__init__(duration=duration, interval="step", **kwargs)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        rank_agreement(trainer).register("out_of_time", lambda: self.time_elapsed() >= self._duration)

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if self._duration is not None and rank_agreement(trainer).at_step_end(trainer).get("out_of_time"):
            trainer.should_stop = True


def sparse_sigterm_checks(trainer: Any) -> None:
    """Make ``trainer``'s training loop run its SIGTERM broadcast (and stop) only once the trainer's
    :class:`RankAgreement` says a rank received SIGTERM (every rank learns it at the same step)."""
    loop = trainer.fit_loop.epoch_loop
    original = loop._broadcast_sigterm_tensor
    agreement = rank_agreement(trainer)
    agreement.register("sigterm", lambda: bool(getattr(trainer, "received_sigterm", False)))

    def when_agreed() -> None:
        if agreement.agreed.get("sigterm"):
            original()

    loop._broadcast_sigterm_tensor = when_agreed
