"""Ranks and groups of the current run, whether or not Megatron's parallel state is initialised.

Models and data code ask here, never a strategy: without Megatron (a plain single-process run) every parallel
size is 1 and every rank 0.
"""

import sys
from typing import Any

import torch


def _mpu() -> Any:
    """Megatron's ``parallel_state`` if it is imported and initialised, else None (never imports Megatron)."""
    module = sys.modules.get("megatron.core.parallel_state")
    if module is None or not module.model_parallel_is_initialized():
        return None
    return module


def _ask(getter: str, default: Any) -> Any:
    """Megatron's ``parallel_state.<getter>()``, or ``default`` when Megatron's parallel state is not set up."""
    mpu = _mpu()
    return getattr(mpu, getter)() if mpu else default


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_initialized() -> bool:
    """Whether Megatron's parallel state is set up in this process."""
    return _mpu() is not None


def tensor_parallel_world_size() -> int:
    return _ask("get_tensor_model_parallel_world_size", 1)


def tensor_parallel_rank() -> int:
    return _ask("get_tensor_model_parallel_rank", 0)


def pipeline_parallel_world_size() -> int:
    return _ask("get_pipeline_model_parallel_world_size", 1)


def pipeline_parallel_rank() -> int:
    return _ask("get_pipeline_model_parallel_rank", 0)


def is_pipeline_first_stage() -> bool:
    return pipeline_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return pipeline_parallel_rank() == pipeline_parallel_world_size() - 1


def data_parallel_world_size() -> int:
    """Without Megatron's parallel state, the size of the distributed world (plain DDP), else 1."""
    return _ask("get_data_parallel_world_size", torch.distributed.get_world_size() if _distributed() else 1)


def data_parallel_rank() -> int:
    return _ask("get_data_parallel_rank", torch.distributed.get_rank() if _distributed() else 0)


def data_parallel_group() -> Any:
    """The data-parallel process group (None: the default group, or no distributed run)."""
    return _ask("get_data_parallel_group", None)


def tensor_parallel_group() -> Any:
    return _ask("get_tensor_model_parallel_group", None)


def pipeline_parallel_group() -> Any:
    return _ask("get_pipeline_model_parallel_group", None)


def all_reduce(tensor: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
    """In-place all-reduce (sum by default) over ``group``; a no-op without a group of two or more ranks."""
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(tensor, op=op or torch.distributed.ReduceOp.SUM, group=group)
    return tensor


def average_norm_statistics(module: torch.nn.Module) -> None:
    """Average the running statistics of every normalisation layer (buffers ``running_mean`` / ``running_var``:
    batch norm, and the Conformer's masked batch norm) over the data-parallel group, in one all-reduce.

    Each data-parallel rank updates its statistics from its own batches; without this, validation on each rank
    would use different statistics and checkpoints and archives would hold rank 0's. A collective call on every
    rank (a no-op without data parallelism); the order of the buffers is the module's, the same on every rank.
    """
    size = data_parallel_world_size()
    if size == 1:  # (more than one rank: Megatron's data-parallel group, or the default group of plain DDP)
        return
    stats = [b for name, b in module.named_buffers() if name.rsplit(".", 1)[-1] in ("running_mean", "running_var")
             and b.is_floating_point()]  # fmt: skip
    if not stats:
        return
    flat = torch._utils._flatten_dense_tensors([s.float() for s in stats])
    torch.distributed.all_reduce(flat, group=data_parallel_group())
    flat /= size
    with torch.no_grad():
        for stat, mean in zip(stats, torch._utils._unflatten_dense_tensors(flat, stats)):
            stat.copy_(mean)


def same_on_tensor_parallel_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the first rank of this rank's tensor-parallel group holds it, on every rank of the group.

    Generation loops pass each step's sampled tokens through it: tensor-parallel peers then feed the same tokens
    and stop at the same step whatever their random streams, so no rank can leave the loop (and its collectives)
    early. A no-op without tensor parallelism. Collective: every rank of the group calls it.
    """
    group = tensor_parallel_group()
    if group is None or torch.distributed.get_world_size(group) == 1:
        return tensor
    tensor = tensor.contiguous()
    torch.distributed.broadcast(tensor, src=torch.distributed.get_global_rank(group, 0), group=group)
    return tensor


def in_first_replica() -> bool:
    """Whether this rank belongs to the first data-parallel replica of the model: the ranks that run the work that
    follows ``fit`` and the generation inside validation.

    The one choice for every script (evaluation, judging with another archive, sample synthesis, SALM/GPT
    generation): those ranks run it *together, each with its own tensor-parallel shards*, because a tensor-parallel
    layer cannot run on one rank alone, and an archive restored for judging is sharded the same way
    (:meth:`speechtrain.core.model.SpeechModel.restore_from`). Other replicas would repeat the same work and skip
    it. Only global rank 0 prints or writes the results. Archives and exports are not part of this: they gather
    the shards, so every rank calls them. Without a distributed run this is True.
    """
    return data_parallel_rank() == 0


def whole_model_numel(parameters: Any) -> int:
    """Elements of the whole model (all tensor-parallel shards) from this rank's ``parameters``: a tensor-parallel
    parameter holds 1/TP of its weight, the others are replicated. No collective (pipeline stages: this stage's)."""
    tp = tensor_parallel_world_size()
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in parameters)
