"""Gradient norms and clipping that are correct under tensor and pipeline parallelism.

Each model-parallel rank holds a piece of the model. The global norm adds the squares of every *distinct*
parameter once: sharded (tensor-parallel) weights from every TP rank, parameters that each TP rank holds in
full (norms, row-parallel biases) only from TP rank 0, every pipeline stage's own layers, and parameters shared
between stages (marked ``shared=True``, e.g. tied embeddings) only on their first stage.
"""

from collections.abc import Iterable

import torch

from speechtrain.lightning import parallel_state


def _counts_once(param: torch.nn.Parameter) -> bool:
    if getattr(param, "shared", False) and not parallel_state.is_pipeline_first_stage():
        return False
    return getattr(param, "tensor_model_parallel", False) or parallel_state.tensor_parallel_rank() == 0


def grad_norm(parameters: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm over all model-parallel ranks (identical on every rank)."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None and _counts_once(p)]
    group = parallel_state.model_parallel_group()
    if norm_type == float("inf"):
        total = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros(())
        return parallel_state.all_reduce(total, group, op=torch.distributed.ReduceOp.MAX)
    total = sum((g.float().norm(norm_type) ** norm_type for g in grads), torch.zeros(()))
    parallel_state.all_reduce(total, group)
    return total ** (1.0 / norm_type)


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so that their global norm is at most ``max_norm``; returns the norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    total = grad_norm(parameters, norm_type)
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        for p in parameters:
            p.grad.detach().mul_(coefficient.to(p.grad.dtype))
    return total
