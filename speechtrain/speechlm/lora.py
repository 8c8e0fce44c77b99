"""LoRA adapters for Megatron's tensor-parallel linear layers, and parameter freezing.

LoRA (low-rank adaptation) adds a trainable low-rank update to a frozen linear layer:
``y = W x + (alpha / rank) * B (A dropout(x))`` with ``A`` of shape (rank, in) and ``B`` of shape (out, rank).
``A`` starts Kaiming-uniform, ``B`` at zero, so a freshly adapted model computes exactly what the base model does.

Tensor parallelism. Megatron splits a ``ColumnParallelLinear`` over its outputs and a ``RowParallelLinear`` over
its inputs; the adapter is split to match, so that no rank ever holds or computes more than its share:

- column-parallel (``linear_qkv``, ``linear_fc1``): ``A`` (rank x in) is replicated, ``B`` (out/tp x rank) is
  split like the base weight (with the same stride: ``linear_fc1`` of a gated MLP holds ``[gate_r; up_r]``). The
  low-rank activation ``h = A x`` passes through ``copy_to_tensor_model_parallel_region`` (identity forward,
  all-reduce backward), so every rank gets the full gradient of ``h``, hence of ``A``;
- row-parallel (``linear_proj``, ``linear_fc2``): ``A`` (rank x in/tp) is split like the base weight's inputs,
  ``h = reduce_from_tensor_model_parallel_region(A_r x_r)`` (all-reduce forward) is the full low-rank activation,
  and ``B`` (out x rank) is replicated.

Replicated adapter parameters get identical gradients on every tensor-parallel rank, so no extra synchronisation
is needed. Split ones carry Megatron's ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``
attributes, which is what :func:`speechtrain.lightning.checkpoint.gather_full_state_dict` reads. Initial ``A``
values are drawn for the full matrix from a seed derived from ``LoRAConfig.seed`` and the module name, then
sliced: a TP=2 model starts from exactly the TP=1 adapters.

State-dict keys. The adapter is *registered on the base module* rather than wrapping it: ``lora_a`` and ``lora_b``
become parameters of the base linear and a forward hook adds the low-rank term to its output. The base module
stays where it was, with its class, so every existing key (``...linear_qkv.weight``, ``...linear_qkv._extra_state``)
is unchanged and a checkpoint of the base model loads into the adapted model with only the ``lora_`` keys
missing (``load_state_dict(..., strict=False)``). With LoRA applied, one layer's linear keys read::

    decoder.layers.0.self_attention.linear_qkv.weight          (base, unchanged)
    decoder.layers.0.self_attention.linear_qkv._extra_state    (base, unchanged)
    decoder.layers.0.self_attention.linear_qkv.lora_a          (adapter)
    decoder.layers.0.self_attention.linear_qkv.lora_b          (adapter)

:func:`merge_lora` folds the adapters into the base weights (exactly, per rank) and removes them, for export.
Megatron's distributed-checkpoint ``sharded_state_dict`` is not adapted: it would treat the adapters as
replicated; save with the full (gathered) state dict instead.

Freezing. :func:`freeze_parameters` freezes parameters by regular expression with exceptions;
:func:`set_frozen_modules_eval` (or :class:`FrozenEvalMixin` / :func:`train_keeping_frozen_eval`) keeps fully frozen
modules in eval mode during training, so their dropout and normalisation statistics behave as at inference.
"""

import math
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from speechtrain.lightning.megatron_compat import import_megatron, model_parallel_rng

LORA_PATTERN = r"(^|\.)lora_"  # parameter names of the adapters (searched anywhere in a name)
DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class LoRAConfig:
    """Which linear layers get adapters, and their shape.

    ``targets`` are module-name suffixes matched on whole name components (``linear_qkv`` matches
    ``decoder.layers.3.self_attention.linear_qkv``; ``self_attention.linear_qkv`` works too).
    """

    rank: int = 8
    alpha: float = 16
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    seed: int = 0  # initialisation of A (drawn for the full matrix, then sliced per TP rank)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


# ---------------------------------------------------------------------------------------------------------------
# Tensor-parallel slicing helpers


def _tp_group_rank_world(module: torch.nn.Module) -> tuple[Any, int, int]:
    group = getattr(module, "tp_group", None)
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return group, 0, 1
    return group, torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def shard_tensor(full: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1) -> torch.Tensor:
    """This rank's piece of ``full`` split over ``dim``, the way Megatron splits its weights.

    With ``stride`` s the dimension is cut into ``s * world`` equal blocks and rank r keeps blocks
    ``r, r + world, ...`` (the gated MLP's ``linear_fc1`` has stride 2: rank r holds ``[gate_r; up_r]``).
    """
    if world == 1:
        return full.clone()
    if full.shape[dim] % (world * stride):
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split into {world * stride} blocks")
    blocks = torch.chunk(full, world * stride, dim=dim)
    return torch.cat(blocks[rank::world], dim=dim).clone()


def unshard_tensor(pieces: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The full tensor from every rank's piece (in rank order): the inverse of :func:`shard_tensor`."""
    if len(pieces) == 1:
        return pieces[0]
    chunks = [piece.chunk(stride, dim=dim) for piece in pieces]
    return torch.cat([chunks[rank][s] for s in range(stride) for rank in range(len(pieces))], dim=dim)


def gather_tensor_parallel(param: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The full tensor of a (possibly) tensor-parallel parameter or gradient-shaped tensor; a collective call.

    ``param`` supplies Megatron's partition attributes; to gather a gradient call it with the gradient tensor
    after copying them (or use :func:`gather_full_gradient`).
    """
    if not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return param.detach()
    world = torch.distributed.get_world_size(group)
    pieces = [torch.empty_like(param) for _ in range(world)]
    torch.distributed.all_gather(pieces, param.detach().contiguous(), group=group)
    return unshard_tensor(pieces, param.partition_dim, getattr(param, "partition_stride", 1))


def gather_full_gradient(param: torch.Tensor, group: Any = None) -> torch.Tensor | None:
    """The full gradient of a tensor-parallel parameter (``None`` when it has none); a collective call."""
    if param.grad is None:
        return None
    grad = param.grad.detach()
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(param, attr):
            setattr(grad, attr, getattr(param, attr))
    return gather_tensor_parallel(grad, group)


# ---------------------------------------------------------------------------------------------------------------
# The adapter


def _parallel_linear_kind(module: torch.nn.Module) -> str | None:
    import_megatron()
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    return None


def _module_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


class LoRAHook:
    """The forward hook that adds ``scaling * B (A dropout(x))`` to a parallel linear's output.

    The adapter's parameters (``lora_a``, ``lora_b``) live on the hooked module; this object holds the rest of its
    state and is kept as ``module.lora`` (a plain attribute: not a submodule, so no state-dict keys).
    """

    def __init__(self, kind: str, rank: int, alpha: float, dropout: float) -> None:
        self.kind = kind
        self.rank = rank
        self.alpha = alpha
        self.dropout = dropout

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def _dropout(self, module: torch.nn.Module, x: torch.Tensor, split_input: bool) -> torch.Tensor:
        if not self.dropout or not module.training:
            return x
        if split_input:  # different slices on each rank: the per-rank model-parallel stream, as Megatron does
            with model_parallel_rng():
                return F.dropout(x, self.dropout, training=True)
        return F.dropout(x, self.dropout, training=True)  # replicated input: the shared default stream

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
            scatter_to_tensor_model_parallel_region,
        )

        x = args[0] if args else kwargs["input_"]
        base_out, bias = output
        group = module.tp_group
        a, b = module.lora_a, module.lora_b
        if self.kind == "column":
            h = F.linear(self._dropout(module, x, split_input=False), a.to(x.dtype))
            h = copy_to_tensor_model_parallel_region(h, group=group)  # full dA on every rank
            delta = F.linear(h, b.to(x.dtype)) * self.scaling
            gather = kwargs.get("runtime_gather_output")
            if gather is None:
                gather = module.gather_output
            if gather:
                delta = gather_from_tensor_model_parallel_region(delta, group=group)
        else:
            if not module.input_is_parallel:
                x = scatter_to_tensor_model_parallel_region(x, group=group)
            h = F.linear(self._dropout(module, x, split_input=True), a.to(x.dtype))
            h = reduce_from_tensor_model_parallel_region(h, group=group)  # the full low-rank activation
            delta = F.linear(h, b.to(x.dtype)) * self.scaling
        return base_out + delta.to(base_out.dtype), bias


def add_lora(module: torch.nn.Module, cfg: LoRAConfig, name: str = "") -> LoRAHook:
    """Give one Megatron ``ColumnParallelLinear`` / ``RowParallelLinear`` a LoRA adapter (in place).

    ``name`` (the module's name in the model) seeds the initial ``A`` so that every layer differs and every TP
    size draws the same full matrix.
    """
    import_megatron()
    from megatron.core.tensor_parallel.layers import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
    )

    kind = _parallel_linear_kind(module)
    if kind is None:
        raise TypeError(
            f"LoRA: {name or type(module).__name__} is a {type(module).__name__}, not a Megatron ColumnParallelLinear "
            "or RowParallelLinear (transformer-engine layers, whose linear_qkv fuses the layer norm, are not "
            "supported: build the model with transformer_engine=false)."
        )
    if hasattr(module, "lora_a"):
        raise ValueError(f"LoRA: {name or type(module).__name__} already has an adapter.")
    if cfg.rank < 1:
        raise ValueError(f"LoRA rank must be positive, got {cfg.rank}.")
    if getattr(module, "sequence_parallel", False):
        raise NotImplementedError(f"LoRA: {name}: sequence parallelism is not supported by the adapters.")
    if getattr(module, "explicit_expert_comm", False) or getattr(module, "is_expert", False):
        raise NotImplementedError(f"LoRA: {name}: expert (MoE) linear layers are not supported.")
    if getattr(module, "weight", None) is None:
        raise NotImplementedError(
            f"LoRA: {name}: layers without their own weight (shared output layer) are not supported."
        )
    weight = module.weight
    _, tp_rank, tp_world = _tp_group_rank_world(module)
    in_full, out_full = module.input_size, module.output_size

    # A from the full matrix with a per-module seed (nn.Linear's default init: bound 1/sqrt(fan_in)).
    generator = torch.Generator().manual_seed(_module_seed(cfg.seed, name))
    full_a = torch.empty(cfg.rank, in_full, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=generator)
    if kind == "column":
        a_init = full_a
        b_init = torch.zeros(weight.shape[0], cfg.rank)  # (out/tp, rank)
    else:
        a_init = shard_tensor(full_a, 1, tp_rank, tp_world)  # (rank, in/tp)
        b_init = torch.zeros(out_full, cfg.rank)
    lora_a = torch.nn.Parameter(a_init.to(device=weight.device, dtype=weight.dtype))
    lora_b = torch.nn.Parameter(b_init.to(device=weight.device, dtype=weight.dtype))
    if kind == "column":
        set_defaults_if_not_set_tensor_model_parallel_attributes(lora_a)
        set_tensor_model_parallel_attributes(lora_b, True, 0, getattr(weight, "partition_stride", 1))
    else:
        set_tensor_model_parallel_attributes(lora_a, True, 1, 1)
        set_defaults_if_not_set_tensor_model_parallel_attributes(lora_b)
    module.register_parameter("lora_a", lora_a)
    module.register_parameter("lora_b", lora_b)
    hook = LoRAHook(kind, cfg.rank, cfg.alpha, cfg.dropout)
    module.register_forward_hook(hook, with_kwargs=True)
    module.lora = hook
    return hook


def _matches_target(name: str, targets: Iterable[str]) -> bool:
    return any(name == target or name.endswith("." + target) for target in targets)


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig) -> list[str]:
    """Add adapters to every module whose name ends with one of ``cfg.targets``; returns their names.

    Parameters are not frozen here: see :func:`freeze_parameters` / :func:`freeze_all_but_lora`.
    """
    names = [name for name, module in model.named_modules() if name and _matches_target(name, cfg.targets)]
    if not names:
        sample = [name for name, _ in model.named_modules() if name][:12]
        raise ValueError(
            f"LoRA: no module name ends with any of the targets {list(cfg.targets)}; modules: {sample} ..."
        )
    modules = dict(model.named_modules())
    for name in names:
        add_lora(modules[name], cfg, name)
    return names


def lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The adapted modules of ``model`` by name."""
    return {
        name: module for name, module in model.named_modules() if isinstance(getattr(module, "lora", None), LoRAHook)
    }


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter entries of ``model.state_dict()`` (this rank's slices)."""
    return {name: value for name, value in model.state_dict().items() if re.search(LORA_PATTERN, name)}


def remove_lora(module: torch.nn.Module) -> None:
    """Drop one module's adapter without merging it."""
    hook = getattr(module, "lora", None)
    if not isinstance(hook, LoRAHook):
        raise ValueError(f"{type(module).__name__} has no LoRA adapter.")
    # Found by identity rather than through a stored handle, which a deep copy of the model would share.
    for key, fn in list(module._forward_hooks.items()):
        if fn is hook:
            del module._forward_hooks[key]
            module._forward_hooks_with_kwargs.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)
    del module.lora_a, module.lora_b, module.lora


@torch.no_grad()
def merge_lora(model: torch.nn.Module) -> list[str]:
    """Fold every adapter into its base weight (``W += scaling * B @ A``, per rank) and remove it; returns names.

    Exact under tensor parallelism without communication: a column-parallel rank holds rows of ``W`` and the
    matching rows of ``B`` with the full ``A``; a row-parallel rank holds columns of ``W`` and of ``A`` with the full
    ``B``. The merged model has exactly the base model's parameters and state-dict keys.
    """
    merged = []
    for name, module in lora_modules(model).items():
        hook: LoRAHook = module.lora
        delta = (module.lora_b.float() @ module.lora_a.float()) * hook.scaling
        module.weight.add_(delta.to(module.weight.dtype))
        remove_lora(module)
        merged.append(name)
    return merged


# ---------------------------------------------------------------------------------------------------------------
# Freezing


@dataclass
class FreezeReport:
    """Parameter names and element counts after :func:`freeze_parameters` (the whole model, not just the call)."""

    frozen: list[str]
    trainable: list[str]
    frozen_count: int  # number of parameter elements
    trainable_count: int

    def __str__(self) -> str:
        total = self.frozen_count + self.trainable_count
        share = 100.0 * self.trainable_count / total if total else 0.0
        return (
            f"trainable {self.trainable_count:,} of {total:,} parameters ({share:.2f}%) in {len(self.trainable)} "
            f"tensors; frozen {self.frozen_count:,} in {len(self.frozen)} tensors"
        )


def freeze_report(model: torch.nn.Module) -> FreezeReport:
    frozen, trainable, frozen_count, trainable_count = [], [], 0, 0
    for name, param in model.named_parameters():
        if param.requires_grad:
            trainable.append(name)
            trainable_count += param.numel()
        else:
            frozen.append(name)
            frozen_count += param.numel()
    return FreezeReport(frozen, trainable, frozen_count, trainable_count)


def freeze_parameters(
    model: torch.nn.Module, patterns: Sequence[str], exceptions: Sequence[str] = (), *, strict: bool = True
) -> FreezeReport:
    """Freeze (``requires_grad=False``) every parameter whose name matches a pattern and no exception.

    ``patterns`` are matched at the start of the name (``re.match``: ``^llm\\.``, ``perception\\.encoder\\.``);
    ``exceptions`` anywhere in it (``re.search``: ``lora_``, ``\\.norm\\.``), since they usually name a kind of
    parameter rather than a place. Excepted and unmatched parameters are left as they are. With ``strict`` a pattern
    that matches no parameter is an error (a typo would otherwise silently train everything).
    """
    compiled = [re.compile(p) for p in patterns]
    excepted = [re.compile(p) for p in exceptions]
    used = [False] * len(compiled)
    for name, param in model.named_parameters():
        hits = [i for i, pattern in enumerate(compiled) if pattern.match(name)]
        for i in hits:
            used[i] = True
        if hits and not any(pattern.search(name) for pattern in excepted):
            param.requires_grad_(False)
    unused = [pattern for pattern, hit in zip(patterns, used, strict=True) if not hit]
    if strict and unused:
        raise ValueError(f"freeze: the patterns {unused} match no parameter name (matched with re.match).")
    return freeze_report(model)


def freeze_all_but_lora(model: torch.nn.Module, prefix_pattern: str = r"^llm\.") -> FreezeReport:
    """Freeze everything under ``prefix_pattern`` except the LoRA adapters (the usual LoRA fine-tuning setup)."""
    if not lora_modules(model):
        raise ValueError("freeze_all_but_lora: the model has no LoRA adapters; call apply_lora first.")
    return freeze_parameters(model, [prefix_pattern], [LORA_PATTERN])


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that require gradients, for the optimiser."""
    return [param for param in model.parameters() if param.requires_grad]


def set_frozen_modules_eval(model: torch.nn.Module) -> list[str]:
    """Put every submodule whose parameters are all frozen (and that has at least one) into eval mode.

    Returns the names of the outermost modules switched. Call it after ``model.train()``: training mode is
    recursive and would switch them back. Eval mode changes only dropout and normalisation statistics; a frozen
    module still passes gradients to its inputs.
    """
    switched: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(done + ".") or done == "" for done in switched):
            continue  # inside a module already switched (eval is recursive)
        params = list(module.parameters())
        if params and not any(param.requires_grad for param in params):
            module.eval()
            switched.append(name)
    return switched


def train_keeping_frozen_eval(module: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
    """``module.train(mode)``, then, in training mode, frozen submodules back to eval mode."""
    module.train(mode)
    if mode:
        set_frozen_modules_eval(module)
    return module


class FrozenEvalMixin:
    """A ``train()`` that keeps fully frozen submodules in eval mode; put it before ``LightningModule``::

        class SpeechLM(FrozenEvalMixin, LightningModule): ...

    Any ``train()`` call (ours before fitting, Lightning's ``on_validation_model_train`` default, a callback's, a
    DDP wrapper's, which reaches this module's ``train``) would otherwise put frozen modules back into training mode
    (dropout on, normalisation statistics updated). Lightning 2.x itself does not call ``train()`` at fit start:
    it keeps the modes the model has (warning "Found N module(s) in eval mode at the start of training", expected
    here) and restores each submodule's mode after validation. So call ``model.train()`` (with this mixin) or
    :func:`train_keeping_frozen_eval` before ``trainer.fit``, or :func:`set_frozen_modules_eval` from
    ``on_train_epoch_start``; older Lightning versions that call ``model.train()`` are covered by the mixin.
    """

    def train(self, mode: bool = True):  # type: ignore[no-untyped-def]
        result = super().train(mode)  # type: ignore[misc]
        if mode:
            set_frozen_modules_eval(self)  # type: ignore[arg-type]
        return result
