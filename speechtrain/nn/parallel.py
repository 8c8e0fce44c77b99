"""Column- and row-parallel linear layers (Megatron's partitioning), with a plain-PyTorch single-process path.

``ColumnParallelLinear`` splits the output features over the tensor-parallel ranks; ``RowParallelLinear``
splits the input features and all-reduces the partial products. Under TP=1 or without Megatron both are an
ordinary affine map with parameters ``weight`` (out, in) and ``bias`` (out,), initialised like ``torch.nn.Linear``
except that biases start at zero (as in Megatron). Megatron's layers are used only for TP > 1. State dicts of both
paths have the same keys.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from speechtrain.lightning import parallel_state

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def linear_default_init(weight: torch.Tensor) -> torch.Tensor:
    """``torch.nn.Linear``'s weight initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), on the full (out, in) weight.

    The default of every layer here. Xavier-uniform, tried first, draws the (in -> in) and (4 in -> in) weights of a
    transformer 1.7-2.2x larger: the demo Conformer then sat in the CTC all-blank plateau for its whole budget,
    while with this initialisation it leaves the plateau early.
    """
    return torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def _megatron_config(tp_size: int):  # noqa: ANN202 (Megatron's ModelParallelConfig)
    from speechtrain.lightning.megatron_compat import import_megatron

    import_megatron()
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size,
        use_cpu_initialization=True,  # the full weight is drawn on every rank, then sliced: TP=n == TP=1
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32,
    )


class _PlainLinear(torch.nn.Module):
    """Single-process path: the full weight, initialised exactly like Megatron's CPU initialisation."""

    def __init__(self, in_features: int, out_features: int, bias: bool, init_method: InitMethod) -> None:
        super().__init__()
        weight = torch.empty(out_features, in_features)
        init_method(weight)
        self.weight = torch.nn.Parameter(weight)
        self.bias = torch.nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _affine(kind: str, in_features: int, out_features: int, bias: bool, init_method: InitMethod, **kwargs: Any):  # noqa: ANN202
    """Megatron's ``kind`` layer under TP > 1, else the plain layer (the same map; Megatron's backward is slower)."""
    tp = parallel_state.tensor_parallel_world_size()
    if tp == 1:
        return _PlainLinear(in_features, out_features, bias, init_method)
    config = _megatron_config(tp)  # imports Megatron quietly first
    from megatron.core import tensor_parallel

    layer = getattr(tensor_parallel, kind)
    return layer(in_features, out_features, config=config, init_method=init_method, bias=bias, **kwargs)


class _ParallelLinear(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out[0] if isinstance(out, tuple) else out  # Megatron's layers return (output, bias)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W``'s rows (output features) split over the tensor-parallel ranks.

    Forward: (..., in) -> (..., out / TP), or (..., out) with ``gather_output``.

    Args:
        in_features: input width.
        out_features: full output width (divisible by the TP size).
        bias: learn a bias (split like the output).
        gather_output: return the full output on every rank instead of this rank's slice.
        init_method: initialiser applied to the full (out, in) weight.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        init_method: InitMethod = linear_default_init,
    ) -> None:
        super().__init__()
        tp = parallel_state.tensor_parallel_world_size()
        if out_features % tp:
            raise ValueError(f"out_features={out_features} is not divisible by tensor_model_parallel_size={tp}.")
        kwargs = {"gather_output": gather_output} if tp > 1 else {}
        self.linear = _affine("ColumnParallelLinear", in_features, out_features, bias, init_method, **kwargs)


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with ``W``'s columns (input features) split over the TP ranks; outputs all-reduced.

    Forward: (..., in / TP) (or (..., in) without ``input_is_parallel``) -> (..., out), identical on all ranks.

    Args:
        in_features: full input width (divisible by the TP size).
        out_features: output width.
        bias: learn a bias (held in full by every rank, added after the reduction).
        input_is_parallel: the input is already this rank's slice (output of a ``ColumnParallelLinear``).
        init_method: initialiser applied to the full (out, in) weight.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_method: InitMethod = linear_default_init,
    ) -> None:
        super().__init__()
        tp = parallel_state.tensor_parallel_world_size()
        if in_features % tp:
            raise ValueError(f"in_features={in_features} is not divisible by tensor_model_parallel_size={tp}.")
        kwargs = {"input_is_parallel": input_is_parallel, "skip_bias_add": False} if tp > 1 else {}
        self.linear = _affine("RowParallelLinear", in_features, out_features, bias, init_method, **kwargs)
