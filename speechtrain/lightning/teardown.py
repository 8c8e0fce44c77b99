"""Release everything a training run holds, so that several runs can share one process (tests, sweeps)."""

import gc
import sys
from typing import Any

import torch


def teardown(trainer: Any, model: torch.nn.Module | None = None) -> None:
    """Destroy the process group (and Megatron's parallel state), tear the trainer down, free accelerator memory.

    Safe to call twice, and on CPU-only machines.

    Args:
        trainer: a Lightning ``Trainer``.
        model: optionally the model; its gradients are dropped and its weights moved to the CPU.
    """
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if trainer is not None and not getattr(trainer, "_speechtrain_torn_down", False):
        trainer._teardown()
        trainer._speechtrain_torn_down = True
    if model is not None:
        model.zero_grad(set_to_none=True)
        model.to("cpu")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
