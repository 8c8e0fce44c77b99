"""Counts what a GPU step pays for but a CPU cannot time: host synchronisations, collectives and dispatched operators.

On a GPU a training step runs ahead of the host until the host waits for a result: ``.item()``, ``bool(t)``,
``float(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()``, a copy to the CPU, or an operator whose output shape depends
on the data (``nonzero``, boolean indexing, ``repeat_interleave`` without ``output_size``, ``unique``). Each such
call stalls the host until the GPU has caught up, and the kernels after it start late. Collectives must run in the
same order and sizes on every rank whatever the data, or NCCL hangs. And every dispatched operator costs a kernel
launch (microseconds of host time), which for small models outweighs the kernel itself.

:class:`StepBudget` is a Lightning callback that records, for each training-loop iteration (the optimizer step, the
loss reduction, the hooks and the logging; the data loader's ``next`` excluded, since it rightly builds CPU
tensors), the host synchronisations (kind and the speechtrain or library line that made them), the collectives
(kind and bytes) and the number of dispatched ATen operators. The host calls are seen by a ``TorchFunctionMode``
and the data-dependent operators by a ``TorchDispatchMode``, so they are found on the CPU exactly as they would be
made on a GPU. ``benchmarks/step_budget.py`` runs it on each model family; tests hold the counts.
"""

import inspect
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

TORCH = Path(torch.__file__).resolve().parent
HERE = Path(__file__).resolve()
# Tensor methods that wait for the device (on a CPU tensor they are free, which is why a CPU run cannot time them).
SYNC_METHODS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu"}
# Operators whose output shape depends on the values: the host must read a count from the device.
DATA_DEPENDENT = {"aten.nonzero.default", "aten.masked_select.default", "aten.repeat_interleave.Tensor",
                  "aten._unique2.default", "aten.unique_dim.default", "aten.unique_consecutive.default",
                  "aten.argwhere.default", "aten.bincount.default", "aten._local_scalar_dense.default"}  # fmt: skip
# Where a place is named from (the outermost of these folders in its path).
ANCHORS = ("speechtrain", "lightning", "megatron", "tests", "benchmarks", "torchmetrics")
# Places that read tensors which live on the host on every device (on a CPU run they look like any other):
# Megatron's RNG tracker compares the CPU generator's state before and after each of its forks; the ranks'
# agreement on stopping reduces host flags over a gloo group.
HOST_ONLY = ("megatron/core/tensor_parallel/random.py", "speechtrain/lightning/limits.py")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "all_to_all_single", "all_to_all", "reduce", "gather", "scatter", "barrier",
               "all_gather_object", "broadcast_object_list", "gather_object", "send", "recv", "isend", "irecv",
               "batch_isend_irecv", "monitored_barrier")  # fmt: skip


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module (speechtrain, Lightning or Megatron)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if not (path.is_relative_to(TORCH) or path == HERE or "torch/utils" in path.as_posix()):
            parts = path.parts
            roots = [len(parts) - 1 - parts[::-1].index(a) for a in ANCHORS if a in parts]  # the last of each
            start = min(roots) if roots else len(parts) - 1  # the outermost: tests/lightning/x.py, not lightning/x.py
            return "/".join(parts[start:]) + f":{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _group_ranks(function: Any, args: tuple, kwargs: dict) -> str:
    """The global ranks of the call's process group, e.g. ``g0,1`` (the world when none is given)."""
    try:
        group = inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("group")
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except (TypeError, ValueError, RuntimeError):
        return "g?"
    return "g" + ",".join(map(str, sorted(ranks)))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


class _Step:
    def __init__(self) -> None:
        self.syncs: list[str] = []
        self.collectives: list[str] = []
        self.ops = 0

    def as_dict(self) -> dict[str, Any]:
        return {"syncs": self.syncs, "collectives": self.collectives, "ops": self.ops}


class _HostCalls(TorchFunctionMode):
    def __init__(self, owner: "StepBudget") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        step = self.owner.current
        sync = name in SYNC_METHODS or (name == "to" and _to_cpu(args, kwargs))
        place = _caller() if step is not None and sync and not self.owner.inside_sync else None
        if place is not None and not place.startswith(HOST_ONLY):
            step.syncs.append(f"{'.to(cpu)' if name == 'to' else name} at {place}")
            self.owner.inside_sync = True
            try:
                return func(*args, **kwargs)
            finally:
                self.owner.inside_sync = False
        return func(*args, **kwargs)


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    """``t.to("cpu")``: a copy to the host. A ``torch.device`` target is taken to be the compute device (moving a
    tensor to where the model is), which on a CPU run cannot be told apart from the host."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, str) and torch.device(target).type == "cpu"


class _Operators(TorchDispatchMode):
    def __init__(self, owner: "StepBudget") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        step = self.owner.current
        if step is not None:
            step.ops += 1
            name = str(func)
            data_dependent = name in DATA_DEPENDENT or (
                name.startswith("aten.index") and len(args) > 1 and _bool_index(args[1])  # (the indices)
            )
            if data_dependent and not self.owner.inside_sync:
                place = _caller()
                if not place.startswith(HOST_ONLY):
                    step.syncs.append(f"{name} at {place}")
        return func(*args, **(kwargs or {}))


def _bool_index(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    if isinstance(value, list | tuple):
        return any(_bool_index(v) for v in value)
    return False


class StepBudget(pl.Callback):
    """Records host synchronisations, collectives and operators per training-loop iteration (see module docstring).

    ``steps`` holds one dict per iteration: ``syncs`` (``"<kind> at <file:line>"``), ``collectives``
    (``"<kind> <bytes>"`` in call order) and ``ops``. :meth:`write` saves them as JSON (one file per rank).
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.current: _Step | None = None
        self.inside_sync = False
        self.inside_collective = False
        self._modes: list[Any] = []
        self._patched: dict[str, Any] = {}
        self._loop_methods: dict[str, Any] = {}

    # ----------------------------------------------------------------------------------------- the windows
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loop_methods:  # (attached twice: through the lifecycle group and the trainer's own list)
            return
        loop = trainer.fit_loop.epoch_loop
        advance, advance_end = loop.advance, loop.on_advance_end
        fetcher_next = None

        def counted_advance(data_fetcher: Any) -> Any:
            nonlocal fetcher_next
            if fetcher_next is None:  # the data loader's next() is not part of the step
                fetcher_next = type(data_fetcher).__next__
            self._begin()
            try:
                return advance(data_fetcher)
            finally:
                self._pause()

        def counted_advance_end(data_fetcher: Any) -> Any:
            self._resume()
            try:
                return advance_end(data_fetcher)
            finally:
                self._end()

        self._loop_methods = {"advance": advance, "on_advance_end": advance_end}
        loop.advance, loop.on_advance_end = counted_advance, counted_advance_end
        self._patch_fetch(trainer)
        self._patch_collectives()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop = trainer.fit_loop.epoch_loop
        for name, method in self._loop_methods.items():
            setattr(loop, name, method)
        self._loop_methods = {}
        self._unpatch()

    def _patch_fetch(self, trainer: pl.Trainer) -> None:
        from lightning.pytorch.loops import fetchers

        for cls in (fetchers._PrefetchDataFetcher, fetchers._DataFetcher):
            original = cls.__next__

            def fetch(fetcher: Any, original: Any = original) -> Any:
                paused = self.current
                self.current = None
                try:
                    return original(fetcher)
                finally:
                    self.current = paused

            self._patched[f"fetch:{cls.__name__}"] = (cls, "__next__", original)
            cls.__next__ = fetch

    def _patch_collectives(self) -> None:
        from torch.distributed import distributed_c10d

        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue

            def collective(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                step = self.current
                if step is not None and not self.inside_collective:
                    size = _nbytes(args[0] if args else kwargs.get("tensor", kwargs.get("tensor_list")))
                    step.collectives.append(f"{_name} {size} {_group_ranks(_original, args, kwargs)}")
                    if _name.endswith("_object") or _name == "broadcast_object_list":  # pickled over the host
                        step.syncs.append(f"{_name} at {_caller()}")
                # (c10d hands a call back to the public function through the torch-function mode: counted once)
                outer, self.inside_collective = self.inside_collective, True
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.inside_collective = outer

            for module in (dist, distributed_c10d):
                if getattr(module, name, None) is original:
                    self._patched[f"{module.__name__}.{name}"] = (module, name, original)
                    setattr(module, name, collective)

    def _unpatch(self) -> None:
        for owner, name, original in self._patched.values():
            setattr(owner, name, original)
        self._patched = {}

    def _begin(self) -> None:
        self.current = _Step()
        self._modes = [_HostCalls(self), _Operators(self)]
        for mode in self._modes:
            mode.__enter__()

    def _pause(self) -> None:
        self._paused, self.current = self.current, None

    def _resume(self) -> None:
        self.current = getattr(self, "_paused", None)

    def _end(self) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = []
        if self.current is not None:
            self.steps.append(self.current.as_dict())
        self.current = None

    # ----------------------------------------------------------------------------------------- the results
    def write(self, path: str | Path, rank: int = 0) -> None:
        Path(path).write_text(json.dumps({"rank": rank, "steps": self.steps}) + "\n")


def _consistent(ranks: list[dict[str, Any]]) -> bool:
    """Whether, at one step, every two ranks issued the same collectives (kind and bytes, in order) on the groups
    they share: what NCCL needs not to hang. ``ranks``: rank -> that step's collectives."""

    def shared(calls: list[str], other: int) -> list[str]:
        return [c for c in calls if other in {int(r) for r in c.rsplit(" g", 1)[1].split(",") if r != "?"}]

    return all(shared(ranks[a], b) == shared(ranks[b], a) for a in ranks for b in ranks if a < b)


def _kind(call: str) -> str:
    """``"all_reduce 1024 g0,1"`` -> ``"all_reduce (2 ranks)"``."""
    name, _, group = call.split(" ")
    return f"{name} ({len(group[1:].split(','))} ranks)"


def summarise(ranks: list[list[dict[str, Any]]], skip: int = 2) -> dict[str, Any]:
    """Per-step figures of the recorded ranks (each a list of step dicts, in rank order), the first ``skip`` steps
    of each left out (the first steps build caches and buckets): the most syncs and operators in a step, the syncs
    by place, whether at every step every two ranks issued the same collectives on the groups they share, and the
    distinct sequences of collective kinds over the steps (the periodic agreement of
    :class:`~speechtrain.lightning.limits.RankAgreement` adds one every few steps; nothing else may vary)."""
    kept = [steps[skip:] for steps in ranks]
    count = min(len(steps) for steps in kept)
    syncs = [len(step["syncs"]) for steps in kept for step in steps]
    consistent = all(_consistent({r: kept[r][i]["collectives"] for r in range(len(kept))}) for i in range(count))
    kinds = {tuple(_kind(c) for c in step["collectives"]) for steps in kept for step in steps}
    places = Counter(s for steps in kept for step in steps for s in step["syncs"])
    steps = sum(len(s) for s in kept)
    return {
        "steps": steps,
        "max_syncs_per_step": max(syncs, default=0),
        "syncs_per_step": round(sum(syncs) / max(steps, 1), 2),
        "sync_places": {place: round(n / max(steps, 1), 2) for place, n in places.most_common()},
        "collectives_per_step": max((len(step["collectives"]) for s in kept for step in s), default=0),
        "collective_bytes_per_step": max(
            (sum(int(c.split(" ")[1]) for c in step["collectives"]) for s in kept for step in s), default=0
        ),
        "same_collectives_on_every_rank": consistent and len({len(steps) for steps in kept}) == 1,
        "collective_sequences": sorted(list(k) for k in kinds),
        "max_ops_per_step": max((step["ops"] for s in kept for step in s), default=0),
    }


class CudaSyncErrors(pl.Callback):
    """On a GPU: every training step after the first ``skip`` runs under ``torch.cuda.set_sync_debug_mode("error")``,
    so any host synchronisation raises, except inside Megatron's gradient norm (the step's one allowed sync)."""

    def __init__(self, skip: int = 2) -> None:
        self.skip = skip
        self._norm: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.optimizer import clip_grads

        original = self._norm = clip_grads.get_grad_norm_fp32

        def allowed(*args: Any, **kwargs: Any) -> Any:
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(mode)

        clip_grads.get_grad_norm_fp32 = allowed

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.skip:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode(0)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.optimizer import clip_grads

        torch.cuda.set_sync_debug_mode(0)
        if self._norm is not None:
            clip_grads.get_grad_norm_fp32 = self._norm
