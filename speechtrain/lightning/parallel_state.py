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


def is_initialized() -> bool:
    """Whether Megatron's parallel state is set up in this process."""
    return _mpu() is not None


def tensor_parallel_world_size() -> int:
    mpu = _mpu()
    return mpu.get_tensor_model_parallel_world_size() if mpu else 1


def tensor_parallel_rank() -> int:
    mpu = _mpu()
    return mpu.get_tensor_model_parallel_rank() if mpu else 0


def pipeline_parallel_world_size() -> int:
    mpu = _mpu()
    return mpu.get_pipeline_model_parallel_world_size() if mpu else 1


def pipeline_parallel_rank() -> int:
    mpu = _mpu()
    return mpu.get_pipeline_model_parallel_rank() if mpu else 0


def is_pipeline_first_stage() -> bool:
    return pipeline_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return pipeline_parallel_rank() == pipeline_parallel_world_size() - 1


def data_parallel_world_size() -> int:
    mpu = _mpu()
    if mpu:
        return mpu.get_data_parallel_world_size()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def data_parallel_rank() -> int:
    mpu = _mpu()
    if mpu:
        return mpu.get_data_parallel_rank()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def data_parallel_group() -> Any:
    """The data-parallel process group (None: the default group, or no distributed run)."""
    mpu = _mpu()
    return mpu.get_data_parallel_group() if mpu else None


def tensor_parallel_group() -> Any:
    mpu = _mpu()
    return mpu.get_tensor_model_parallel_group() if mpu else None


def pipeline_parallel_group() -> Any:
    mpu = _mpu()
    return mpu.get_pipeline_model_parallel_group() if mpu else None


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
    group = data_parallel_group()
    size = data_parallel_world_size()
    if size == 1 or group is None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    stats = [b for name, b in module.named_buffers() if name.rsplit(".", 1)[-1] in ("running_mean", "running_var")
             and b.is_floating_point()]  # fmt: skip
    if not stats:
        return
    flat = torch._utils._flatten_dense_tensors([s.float() for s in stats])
    torch.distributed.all_reduce(flat, group=group)
    flat /= size
    with torch.no_grad():
        for stat, mean in zip(stats, torch._utils._unflatten_dense_tensors(flat, stats)):
            stat.copy_(mean)


def model_parallel_group() -> Any:
    """The tensor x pipeline group of this rank (None when there is no model parallelism)."""
    mpu = _mpu()
    return mpu.get_model_parallel_group() if mpu else None


_options = {"distributed_optimizer": False}


def set_distributed_optimizer(enabled: bool) -> None:
    """Chosen by the strategy: shard optimizer states over the data-parallel group."""
    _options["distributed_optimizer"] = enabled


def distributed_optimizer_enabled() -> bool:
    return _options["distributed_optimizer"] and is_initialized()


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
