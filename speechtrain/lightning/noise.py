"""Silence upstream messages our users cannot act on, so that the ones that matter stand out.

- Lightning's "Tip:" advertisements for its cloud services (logged on every trainer construction).
- Lightning 2.6's own use of a pytree API that torch 2.11 deprecated (``LeafSpec``): a warning about Lightning's
  code, printed during every ``fit``.
- Megatron Core's INFO chatter (its DDP and optimizer configs, the list of every parameter of each gradient bucket,
  Megatron-FSDP's notes): kept at WARNING unless ``SPEECHTRAIN_ENGINE_LOG`` names a level (``info``, ``debug``).
- Lightning's start of a multi-process run (a five-line banner, one "Initializing distributed" line per rank, "TPU
  available: False"): one line.
- torch's "No CUDA runtime is found" warning, which Megatron's import of torch's C++-extension helper prints on
  every machine without CUDA: nothing to act on there.

:func:`rank_zero_info_only` (installed by the Hydra runner on its log handlers) keeps INFO lines of the other ranks
of a multi-process run out of the log: each rank would print the same line.
"""

import logging
import os
import warnings

ENGINE_LOGGERS = ("megatron",)


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip")


def _short_launch_lines(record: logging.LogRecord) -> bool:
    """Lightning's start of a multi-process run in one line: its banner (five lines between two rules of dashes) as
    ``distributed: gloo, 2 processes registered``, the "Initializing distributed" line of rank 0 only, and no "TPU
    available: False" line."""
    message = str(record.msg)
    if message.startswith("-" * 20) and "distributed_backend=" in message:
        backend = message.split("distributed_backend=", 1)[1].split("\n", 1)[0]
        processes = message.split("Starting with ", 1)[1].split(" ", 1)[0] if "Starting with " in message else "?"
        record.msg, record.args = f"distributed: {backend}, {processes} processes registered", ()
        return True
    if message.startswith("Initializing distributed: GLOBAL_RANK:"):
        return message.startswith("Initializing distributed: GLOBAL_RANK: 0,")
    return not message.startswith("TPU available: False")


def _not_no_cuda_runtime(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("No CUDA runtime is found")


def engine_log_level() -> int:
    """The level of Megatron Core's loggers: ``SPEECHTRAIN_ENGINE_LOG`` (a level name), else WARNING."""
    name = os.environ.get("SPEECHTRAIN_ENGINE_LOG", "warning").upper()
    level = logging.getLevelName(name)
    return level if isinstance(level, int) else logging.WARNING


def silence_upstream_noise() -> None:
    """Install the filters and levels (idempotent)."""
    for name, keep in (("lightning.pytorch.utilities.rank_zero", _not_a_tip),
                       ("torch.utils.cpp_extension", _not_no_cuda_runtime),
                       ("lightning.pytorch.utilities.rank_zero", _short_launch_lines),
                       ("lightning.fabric.utilities.rank_zero", _short_launch_lines),
                       ("lightning.fabric.utilities.distributed", _short_launch_lines)):  # fmt: skip
        upstream = logging.getLogger(name)
        if keep not in upstream.filters:
            upstream.addFilter(keep)
    for name in ENGINE_LOGGERS:
        logging.getLogger(name).setLevel(engine_log_level())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def rank_zero_info_only(record: logging.LogRecord) -> bool:
    """A handler filter: every record of global rank 0, and WARNING and above of the others."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return record.levelno >= logging.WARNING or getattr(rank_zero_only, "rank", 0) == 0
