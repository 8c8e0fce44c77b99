"""Checkpoints in Megatron Core's ``dist_checkpointing`` format (``torch_dist`` backend): resumable under another
tensor- or data-parallel layout.

A checkpoint is a folder::

    <name>.ckpt/
        weights/          Megatron's distributed checkpoint of the model and the optimizer: every rank writes its own
                          shards in parallel; any TP x DP layout reads back the parts it needs (resharding is
                          Megatron's); its ``integrity.json`` holds each file's SHA-256
        run.ckpt          the rest of Lightning's checkpoint (loops, callbacks, LR schedulers, every rank's random
                          streams, the sampler's position), CRC-checked on load; ``run_tpXX_ppYYY.ckpt`` the same of
                          the other model-parallel ranks (callbacks such as the EMA keep tensors of their shards)
        metadata.json     the complete-marker: format, layout and every file's size; written last

The folder is written under ``<name>.ckpt.partial``, fsynced, and put in place of the previous checkpoint with the
renames of :mod:`speechtrain.lightning.checkpoint` (a kill at any point leaves the previous or the new checkpoint
findable; :func:`~speechtrain.lightning.checkpoint.checkpoint_candidates` knows both formats).

Megatron's own modules (the SALM's ``GPTModel``) describe their shards themselves (``sharded_state_dict``); every
other parameter and buffer of a speechtrain model is described here, from the tensor-parallel marks Megatron's
layers put on their parameters (``tensor_model_parallel``, ``partition_dim``), by :func:`model_sharded_state_dict`:
Megatron has no description of modules that are not its own. The optimizer's state is Megatron's
``sharded_state_dict`` of its optimizer (for the distributed optimizer its "fully reshardable" form: each state
tensor tied to its parameter's global tensor, so it reshards over TP and DP like the weights).
"""

import ctypes
import hashlib
import json
import logging
import os
import pickle
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from speechtrain.lightning import checkpoint as files
from speechtrain.lightning import parallel_state

logger = logging.getLogger(__name__)

FORMAT = files.DIST_FORMAT
WEIGHTS, RUN = "weights", "run.ckpt"
# The distributed optimizer's state in the checkpoint: Megatron's "fully_reshardable" format, each state tensor
# shaped like its parameter and tied to its global tensor, so any TP x DP layout reads it. Megatron all-gathers the
# flat shards over the data-parallel group to build it (its write is then spread over the DP ranks); its format
# without the gather, "dp_reshardable", cannot change the TP size, and the gather-free model-space one
# (flattened ranges) is refused by megatron-core 0.19.
_DISTRIB_OPTIM_SHARDING = "fully_reshardable"


def is_dist_checkpoint(path: str | os.PathLike) -> bool:
    """``path`` is a folder written by :func:`save_checkpoint` (complete or not)."""
    path = Path(path)
    try:
        return json.loads((path / files.METADATA).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return path.is_dir() and (path / WEIGHTS).is_dir()


# ------------------------------------------------------------------------------------------ sharded state dicts
def _replica(tp_replicated: bool) -> tuple[int, int, int]:
    """Megatron's replica id (PP, TP, DP): all zeros on the one rank that writes a tensor (shard)."""
    tp_rank = parallel_state.tensor_parallel_rank() if tp_replicated else 0
    return (0, tp_rank, parallel_state.data_parallel_rank())


def _megatron_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The outermost Megatron Core modules inside ``module``, by name: they describe their own shards."""
    from megatron.core.transformer.module import MegatronModule

    found: dict[str, torch.nn.Module] = {}
    for name, sub in module.named_modules():
        if name and isinstance(sub, MegatronModule) and not any(name.startswith(f"{n}.") for n in found):
            found[name] = sub
    return found


def model_sharded_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s state dict as Megatron ``ShardedTensor`` s, keyed like ``module.state_dict()``.

    Megatron's modules contribute their own ``sharded_state_dict``; every other tensor is described from its
    parameter's marks: a tensor-parallel parameter (``tensor_model_parallel``) is this TP rank's slice of the
    global tensor along ``partition_dim``, written by data-parallel rank 0; anything else (replicated parameters,
    buffers such as batch-norm statistics) is the whole tensor, written by TP and DP rank 0. The global tensors
    are the ones a TP=1 model holds, so any TP size reads them. The tensors are the parameters themselves (what
    Megatron's optimizers match their state to). Non-tensor entries (Megatron layers' empty ``_extra_state``) are
    left out (see :func:`load_model_state`).

    Raises:
        NotImplementedError: a tensor-parallel parameter outside Megatron's modules split with a stride (its
            global layout is not a plain concatenation).
    """
    from megatron.core.dist_checkpointing import ShardedTensor

    tp, tp_rank = parallel_state.tensor_parallel_world_size(), parallel_state.tensor_parallel_rank()
    sharded: dict[str, Any] = {}
    megatron = _megatron_modules(module)
    for name, sub in megatron.items():
        sharded.update(sub.sharded_state_dict(prefix=f"{name}."))
    params = {name: p for name, p in module.named_parameters(remove_duplicate=False)}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if any(key.startswith(f"{n}.") for n in megatron) or not isinstance(tensor, torch.Tensor):
            continue
        param = params.get(key)
        if tp > 1 and param is not None and getattr(param, "tensor_model_parallel", False):
            if getattr(param, "partition_stride", 1) != 1:
                raise NotImplementedError(
                    f"{key}: a strided tensor-parallel split outside Megatron's modules has no checkpoint "
                    "description; use trainer.strategy.checkpoint_format=torch."
                )
            sharded[key] = ShardedTensor.from_rank_offsets(
                key, tensor, (param.partition_dim, tp_rank, tp), replica_id=_replica(False)
            )
        else:
            sharded[key] = ShardedTensor.from_rank_offsets(key, tensor, replica_id=_replica(True))
    return sharded


def _mcore(optimizer: Any) -> Any:
    return getattr(optimizer, "mcore", optimizer)


def module_parameters(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in _mcore(optimizer).param_groups for p in group["params"]]


def optimizer_sharded_state_dict(optimizer: Any, model_sharded: dict[str, Any], is_loading: bool = False) -> Any:
    """Megatron's sharded state dict of ``optimizer`` (a :class:`~speechtrain.lightning.optimizer.MegatronOptimizer`),
    tied to ``model_sharded`` (:func:`model_sharded_state_dict`)."""
    # (Megatron's all-gather of the distributed optimizer's shards works on CUDA tensors only; a CPU run gathers them
    # on data-parallel rank 0 over gloo, its other form.)
    cpu = next((p.device.type == "cpu" for p in module_parameters(optimizer)), True)
    metadata = {"distrib_optim_sharding_type": _DISTRIB_OPTIM_SHARDING,
                "distrib_optim_fully_reshardable_mem_efficient": cpu}  # fmt: skip
    mcore = _mcore(optimizer)
    inner = getattr(mcore, "chained_optimizers", [mcore])
    if is_loading or len(inner) != 1 or not hasattr(inner[0], "sharded_param_state_fully_reshardable"):
        return mcore.sharded_state_dict(model_sharded, is_loading=is_loading, metadata=metadata)
    # The distributed optimizer's save as Megatron writes it in this form (its state_dict, the parameters' state),
    # each rank describing its own parameters' state instead of Megatron's gather on DP rank 0.
    state = inner[0].state_dict()
    state["param_state"] = _owned_param_state(inner[0], model_sharded)
    state["param_state_sharding_type"] = _DISTRIB_OPTIM_SHARDING
    return state


def _owned_param_state(optimizer: Any, model_sharded: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The distributed optimizer's state in Megatron's "fully_reshardable" form (each state tensor shaped like its
    parameter, tied to its global tensor, keyed ``optimizer.state.<state>.<parameter key>``), as Megatron writes it,
    without gathering it on data-parallel rank 0 first: each rank describes the parameters whose state it holds
    whole (its shard of the flat buffers), the few that straddle two ranks' shards are exchanged and written by the
    rank holding their start. The checkpoint is the one Megatron's gather writes, and Megatron reads it back;
    ``optimizer`` is one Megatron ``DistributedOptimizer``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded)
    by_data = {sharded.data: sharded for sharded in nested_values(tensors)}
    keys = ("param", *optimizer.optimizer_state_keys)
    owned, pieces, order = {}, {}, {}
    for gbuf_idx, gbuf_range_maps in enumerate(optimizer.gbuf_ranges):
        local = {}
        for bucket_maps in gbuf_range_maps.values():
            for bucket in bucket_maps:
                local.update(bucket["param_map"])
        for param, (start, end, _) in optimizer.buffers[gbuf_idx].param_index_map.items():
            order[(gbuf_idx, start)] = len(order)
            if param not in local:
                continue
            states = optimizer._get_main_param_and_optimizer_states(param)
            flat = {key: states[key].detach().reshape(-1).float() for key in keys}
            part = local[param]["param"]
            if part.size == end - start:
                owned[(gbuf_idx, start)] = (param, flat)
            else:
                # (copies of the pieces alone: pickling a view would send its whole storage, the flat buffer)
                pieces[(gbuf_idx, start)] = (part.start, {key: t.cpu().clone() for key, t in flat.items()})
    # (every rank calls it, also with nothing that straddles: the save is a collective call)
    everyone: list[Any] = [None] * torch.distributed.get_world_size(optimizer.data_parallel_group)
    torch.distributed.all_gather_object(everyone, pieces, group=optimizer.data_parallel_group)
    for ident, (first, _) in pieces.items():
        if first == 0:  # this rank writes the straddling parameter
            parts = sorted(rank_pieces[ident] for rank_pieces in everyone if ident in rank_pieces)
            param = next(p for p, (s, _, _) in optimizer.buffers[ident[0]].param_index_map.items() if s == ident[1])
            whole = {key: torch.cat([flat[key] for _, flat in parts]).to(param.device) for key in keys}
            assert all(t.numel() == param.numel() for t in whole.values()), f"{ident}: pieces missing"
            owned[ident] = (param, whole)
    state: dict[int, dict[str, Any]] = {}
    for ident, (param, flat) in owned.items():
        sharded = by_data[param]
        # (the replica id the parameter has on data-parallel rank 0: written by this rank, once over TP)
        replica = (*sharded.replica_id[:-1], 0) if isinstance(sharded.replica_id, tuple) else sharded.replica_id
        state[order[ident]] = {}
        for key, tensor in flat.items():
            fields = {"key": f"optimizer.state.{key}.{sharded.key}", "data": tensor.view(param.shape),
                      "replica_id": replica}  # fmt: skip
            if not isinstance(sharded, ShardedTensorFactory):
                fields["dtype"] = tensor.dtype
            state[order[ident]][key] = replace(sharded, **fields)
            state[order[ident]][key].validate_metadata_integrity()
    return dict(sorted(state.items()))


# ------------------------------------------------------------------------------------------------------ save
def _load_strategy() -> Any:
    """Megatron's ``torch_dist`` load strategy, fully parallel under NCCL only: Megatron's exchange of the loaded
    shards between the data-parallel replicas is written for CUDA tensors; over gloo each rank reads its own shards
    itself."""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    if torch.distributed.get_backend() != "nccl":
        return get_default_load_sharded_strategy()
    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(), parallel_state.data_parallel_group())


_saving: dict[str, Any] = {}  # this process's save strategy, its data-parallel group and the structure it planned


def _save_strategy(state: dict[str, Any]) -> tuple[Any, bool]:
    """Megatron's ``torch_dist`` save strategy, its work spread over the data-parallel replicas (fully parallel), and
    whether it is the one of the previous save, kept because the structure of ``state`` (every shard's key, shape,
    offset, replica and dtype) is that save's on every rank: Megatron then reuses its distribution of the shards over
    the replicas and, from the third save on, its save plan, instead of exchanging them again. The ranks agree on
    the reuse with one all-reduce (the save is a collective call)."""
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    group, structure = parallel_state.data_parallel_group(), _structure(state)
    same = _saving.get("group") is group and _saving.get("structure") == structure
    nccl = torch.distributed.get_backend() == "nccl"
    agreed = torch.tensor([int(same)], device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    if agreed.item():
        return _saving["strategy"], True
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(cached_metadata=True), group,
                                                do_cache_distribution=True)  # fmt: skip
    _saving.update(group=group, structure=structure, strategy=strategy)
    return strategy, False


def _structure(state: dict[str, Any]) -> tuple:
    """What Megatron's save plan depends on: each entry's type, key, shapes, offsets, replica and dtype."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    fields = ("key", "global_shape", "global_offset", "local_shape", "replica_id", "dtype", "flattened_range")
    return tuple((type(v).__name__, *(getattr(v, name, None) for name in fields)) for v in nested_values(state))


def _sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_and_digest(write: Callable[..., None], rank: int, buckets: list, results: Any) -> None:
    """Megatron's write of this rank's shard files (``buckets``; each file fsynced by Megatron), then their SHA-256
    in ``.sha256_rank<rank>.json`` beside them, fsynced: the hashes of the integrity manifest are taken by the
    process that wrote the files (an asynchronous save's writer: not the training process), and
    :func:`_integrity_manifest` merges them."""
    write(rank, buckets, results)
    digests = {os.path.basename(bucket[0]): _sha256(bucket[0]) for bucket in buckets}
    target = Path(buckets[0][0]).with_name(_DIGESTS.format(rank=rank))
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(digests))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


_DIGESTS = ".sha256_rank{rank}.json"


def _integrity_manifest(weights: Path) -> set[str]:
    """Write Megatron's integrity manifest of ``weights`` (``integrity.json``: every file's SHA-256, what
    ``load(..., verify_integrity=True)`` and :func:`verify` check) from the writers' digests, which are removed; a
    file no writer hashed (Megatron's index, common state and config, written by the ranks themselves, small) is
    hashed here. Returns the names the writers hashed (and fsynced)."""
    from megatron.core.dist_checkpointing.validation import INTEGRITY_FNAME

    digests: dict[str, str] = {}
    for entry in sorted(weights.glob(_DIGESTS.format(rank="*") + "*")):
        if entry.suffix == ".json":
            digests.update(json.loads(entry.read_text()))
        entry.unlink()
    listed = {}
    for entry in sorted(weights.iterdir(), key=str):
        if entry.is_file() and entry.name != INTEGRITY_FNAME:
            listed[entry.name] = digests.get(entry.name) or _sha256(entry)
    with open(weights / INTEGRITY_FNAME, "w") as f:
        json.dump({"algorithm": "sha256", "files": listed}, f, indent=2)
    return set(digests) & set(listed)


def _fsync_tree(folder: Path, synced: set[str] = frozenset()) -> dict[str, int]:
    """fsync every file under ``folder`` but those of ``synced`` (relative paths: fsynced by their writer), and the
    folders themselves; each file's size by its relative path."""
    sizes = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root) / name
            relative = str(path.relative_to(folder))
            if relative not in synced:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            sizes[relative] = path.stat().st_size
        files._fsync_folder(Path(root))
    return dict(sorted(sizes.items()))


def save_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike, module: torch.nn.Module,
                    optimizers: list[Any], saves: "AsyncSaves | None" = None) -> None:  # fmt: skip
    """Write Lightning's ``checkpoint`` of ``module`` and ``optimizers`` at ``path`` (see module docstring); a
    collective call on all ranks. ``checkpoint['state_dict']`` and ``['optimizer_states']`` are not used: the model
    and optimizer state come from ``module`` and ``optimizers`` themselves, each rank writing its shards.

    With ``saves`` (:class:`AsyncSaves`, no save of it pending) the shards are written by a process of each rank's
    while training goes on, and the folder is completed (marker, rename) when ``saves`` finalizes it; until then
    ``path`` holds the previous checkpoint, if any.

    Raises:
        CheckpointWriteError: a rank could not write its part; the previous checkpoint is kept.
    """
    from megatron.core import dist_checkpointing

    if len(optimizers) > 1:
        raise NotImplementedError("checkpoint_format=torch_dist holds one optimizer; this run has several.")
    path = Path(path)
    tmp = path.with_name(path.name + files.PARTIAL)
    error = None
    if files._is_global_zero():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            files._remove(tmp)
            (tmp / WEIGHTS).mkdir(parents=True)
        except Exception as e:
            error = e
    files._agree(error, path)
    request = None
    try:
        state = {"model": model_sharded_state_dict(module)}
        if optimizers:
            state["optimizer"] = optimizer_sharded_state_dict(optimizers[0], state["model"])
        # Written as Megatron's asynchronous request either way (run at once when synchronous), the files hashed by
        # their writer (:func:`_write_and_digest`) rather than all on rank 0 at the end (``verify_integrity``).
        strategy, reused = _save_strategy(state)
        request = dist_checkpointing.save(state, str(tmp / WEIGHTS), sharded_strategy=strategy,
                                          validate_access_integrity=not reused,  # (checked when it was planned)
                                          async_sharded_save=True, async_strategy="mcore")  # fmt: skip
        if request.async_fn is not None:  # (None: nothing of the checkpoint to write on this rank)
            request = request._replace(async_fn=partial(_write_and_digest, request.async_fn))
        if saves is None:
            request.execute_sync()
    except Exception as e:
        error = e if not isinstance(e, OSError) else files._write_error(e, path)
    files._agree(error, path)
    if parallel_state.data_parallel_rank() == 0:  # the run state of each model-parallel rank (see _run_name)
        try:
            run = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            files._save(run, tmp / _run_name(), path)
        except Exception as e:
            error = e
    files._agree(error, path)
    distributed = bool(optimizers) and _distributed(optimizers[0])
    if saves is None:
        _complete(tmp, path, distributed)
    else:
        saves.schedule(request, lambda: _complete(tmp, path, distributed))


def _complete(tmp: Path, path: Path, distributed_optimizer: bool) -> None:
    """Global rank 0 marks the written folder ``tmp`` complete (the integrity manifest, sizes, fsync, marker last)
    and puts it at ``path``; a collective call (every rank learns of a failure)."""
    error = None
    if files._is_global_zero():
        try:
            hashed = _integrity_manifest(tmp / WEIGHTS)
            sizes = _fsync_tree(tmp, {f"{WEIGHTS}/{name}" for name in hashed})
            metadata = {"format": FORMAT, "tensor_model_parallel_size": parallel_state.tensor_parallel_world_size(),
                        "pipeline_model_parallel_size": parallel_state.pipeline_parallel_world_size(),
                        "data_parallel_size": parallel_state.data_parallel_world_size(),
                        "distributed_optimizer": distributed_optimizer, "shard_bytes": sizes}  # fmt: skip
            with open(tmp / files.METADATA, "w") as f:  # the complete-marker, written last
                f.write(json.dumps(metadata))
                f.flush()
                os.fsync(f.fileno())
            files._fsync_folder(tmp)
            files._replace(tmp, path)
        except Exception as e:
            written = not isinstance(e, OSError) or isinstance(e, files.CheckpointWriteError)
            error = e if written else files._write_error(e, path)
    files._agree(error, path)


class AsyncSaves:
    """Asynchronous saves (``trainer.strategy.async_save``) on Megatron Core's engine: ``dist_checkpointing.save``
    returns the write as an ``AsyncRequest``, its ``AsyncCallsQueue`` runs it in a process forked from each rank
    (the fork is the snapshot: training changes the rank's tensors, not the writer's copy) and finalizes it on every
    rank once all writers are done: Megatron's index and hashes, then :func:`_complete` (marker, rename), then the
    removals of older checkpoints deferred meanwhile (:meth:`after_save`). One save at a time: a save waits for the
    pending one (:meth:`finish`).

    Completion is looked at without any communication (:meth:`writing_here`: this rank's writer process still
    running); the ranks agree on it with the other periodic host checks (``trainer.rank_agreement``), and
    :meth:`finalize_if_written` finalizes once they agreed that every writer is done. Every call here is made by
    every rank at the same point.
    """

    FLAG = "checkpoint_writing"

    def __init__(self) -> None:
        self.queue: Any = None
        self.deferred: list[Callable[[], None]] = []

    @property
    def pending(self) -> bool:
        """A save was scheduled and is not finalized yet."""
        return self.queue is not None and self.queue.get_num_unfinalized_calls() > 0

    def schedule(self, request: Any, complete: Callable[[], None]) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        assert not self.pending, "a save must finish the pending one first"
        if self.queue is None:
            self.queue = AsyncCallsQueue(persistent=False)  # a process forked per save (a snapshot of its tensors)
        if request.async_fn is not None:  # (None: nothing of the checkpoint to write on this rank)
            request = request._replace(async_fn=partial(_dies_with_its_rank, os.getpid(), request.async_fn))
        request.add_finalize_fn(complete)
        request.add_finalize_fn(self._run_deferred)
        self.queue.schedule_async_request(request)

    def writing_here(self) -> bool:
        """This rank's writer is still running (no communication: a look at its process)."""
        if not self.pending:
            return False
        return not self.queue.async_calls[0].async_caller.is_current_async_call_done(blocking=False, no_dist=True)

    def finalize_if_written(self, agreed_writing: bool | None) -> None:
        """Finalize the pending save when the ranks agreed (``agreed_writing`` False: no rank's writer is running);
        None: no agreement at this step."""
        if self.pending and agreed_writing is False:
            finalized = self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            assert finalized, "every rank's writer was agreed done"

    def finish(self) -> None:
        """Wait for the pending save's writers on every rank and finalize it (a collective call)."""
        if self.pending:
            self.queue.maybe_finalize_async_calls(blocking=True)

    def after_save(self, action: Callable[[], None]) -> None:
        """Run ``action`` (the removal of an older checkpoint) once the pending save is complete, or now."""
        if self.pending:
            self.deferred.append(action)
        else:
            action()

    def abort(self) -> None:
        """Stop the pending save's writer of this rank without finalizing (the run failed: its folder stays an
        incomplete ``.partial``, the previous checkpoint in place); deferred removals are dropped."""
        if self.pending:
            for call in self.queue.async_calls:
                call.async_caller.close(abort=True)
            self.queue = None
        self.deferred = []

    def _run_deferred(self) -> None:
        actions, self.deferred = self.deferred, []
        for action in actions:
            action()


def _dies_with_its_rank(rank_pid: int, write: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """The writer process of an asynchronous save (forked from the rank ``rank_pid``) ends with the rank: a rank
    killed with SIGKILL leaves no writer behind, still filling a folder that the restarted run removes and holding
    the job's output open (Linux; elsewhere the writer finishes its shards and exits)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != rank_pid:  # the rank died before the request above took effect
            os._exit(1)
    write(*args, **kwargs)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _run_name(tp_rank: int | None = None, pp_rank: int | None = None) -> str:
    """The run-state file of a model-parallel rank: ``run.ckpt`` for the first, ``run_tpXX_ppYYY.ckpt`` for the
    others. Callbacks may keep per-rank tensors of this rank's shards (the EMA of the weights), so each
    model-parallel rank writes its own, as in the ``torch`` format; data-parallel replicas hold the same."""
    tp_rank = parallel_state.tensor_parallel_rank() if tp_rank is None else tp_rank
    pp_rank = parallel_state.pipeline_parallel_rank() if pp_rank is None else pp_rank
    return RUN if tp_rank == pp_rank == 0 else f"run_tp{tp_rank:02d}_pp{pp_rank:03d}.ckpt"


def _load_run(path: Path, saved: dict[str, Any]) -> dict[str, Any]:
    """This rank's run state: its own under the saved TP/PP layout, else the first rank's, whose callbacks must not
    hold tensors other than scalars (they would be another layout's shards).

    Raises:
        ValueError: the layout changed and a callback's state holds tensors (named)."""
    layout = (parallel_state.tensor_parallel_world_size(), parallel_state.pipeline_parallel_world_size())
    same = layout == (saved["tensor_model_parallel_size"], saved["pipeline_model_parallel_size"])
    own = path / _run_name()
    run = files.load_verified(own if same and own.is_file() else path / RUN)
    if not same:
        sharded = [name for name, state in run.get("callbacks", {}).items() if _holds_tensors(state)]
        if sharded:
            raise ValueError(
                f"Checkpoint {path} was written with tensor_model_parallel_size={saved['tensor_model_parallel_size']}"
                f", pipeline_model_parallel_size={saved['pipeline_model_parallel_size']}; this run uses {layout[0]} "
                f"and {layout[1]}, and the state of {', '.join(sharded)} holds tensors of the saved layout's shards. "
                "Resume under the saved layout, or without that callback."
            )
    return run


def _holds_tensors(state: Any) -> bool:
    """Any tensor of one dimension or more in ``state`` (scalars such as ModelCheckpoint's scores are not shards)."""
    if isinstance(state, torch.Tensor):
        return state.ndim > 0
    if isinstance(state, dict):
        return any(_holds_tensors(v) for v in state.values())
    return isinstance(state, list | tuple) and any(_holds_tensors(v) for v in state)


def _distributed(optimizer: Any) -> bool:
    return bool(_mcore(optimizer).config.use_distributed_optimizer)


# ------------------------------------------------------------------------------------------------------ load
def verify(path: str | os.PathLike) -> None:
    """Check a checkpoint folder without loading it: complete (every file of its marker there, at its size) and
    every file of its weights matching its SHA-256, and ``run.ckpt`` its CRCs.

    Raises:
        CorruptCheckpointError: naming the folder and what is wrong.
    """
    from megatron.core.dist_checkpointing.validation import _verify_integrity_manifest_impl

    path = Path(path)
    _check(path)
    try:
        _verify_integrity_manifest_impl(str(path / WEIGHTS))
    except Exception as e:
        raise files.CorruptCheckpointError(f"Checkpoint {path} is corrupt: {e}") from None
    files.verify_file(path / RUN)


def _check(path: Path) -> dict[str, Any]:
    """The marker of a complete checkpoint at ``path`` (sizes checked, the index safe to read), or a
    ``CorruptCheckpointError``."""
    if not files._complete_folder(path):
        raise files.CorruptCheckpointError(
            f"Checkpoint {path} is incomplete or truncated (a file is missing or has another size than when it "
            "was written): its save was interrupted or it was damaged since."
        )
    _check_index(path / WEIGHTS / ".metadata")
    return json.loads((path / files.METADATA).read_text())


# What the index of a torch_dist checkpoint (torch.distributed.checkpoint's ``.metadata``) may name when unpickled.
_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": None,  # (any name: the index's own dataclasses and enums)
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # (and dtypes, below)
    "collections": {"OrderedDict"},
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = module in _INDEX_CLASSES and (_INDEX_CLASSES[module] is None or name in _INDEX_CLASSES[module])
        if allowed or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def _check_index(index: Path) -> None:
    """torch's distributed checkpoint reads its index ``.metadata`` with ``pickle.load``, which would run any code a
    crafted file names: it is read here first by an unpickler that admits only the index's own classes."""
    try:
        with open(index, "rb") as f:
            _IndexUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise files.CorruptCheckpointError(f"Checkpoint index {index} is refused: {e}.") from None


def load_checkpoint(path: str | os.PathLike, module: torch.nn.Module) -> dict[str, Any]:
    """Lightning's checkpoint dict from ``path``, its ``state_dict`` this rank's part of the model under the current
    layout (any TP/DP; Megatron reshards); the optimizer state is read later, by :func:`load_optimizer_state`, once
    the optimizer exists. A collective call on all ranks. Every file is checked (sizes, SHA-256 and CRCs) first.

    Raises:
        CorruptCheckpointError: the checkpoint is incomplete, truncated or altered.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    saved = _check(path)
    saved_pp, current_pp = saved["pipeline_model_parallel_size"], parallel_state.pipeline_parallel_world_size()
    if saved_pp != current_pp and _megatron_modules(module):
        logger.warning("Checkpoint %s was written with pipeline_model_parallel_size=%d, this run uses %d.", path,
                       saved_pp, current_pp)  # fmt: skip
    run = _load_run(path, saved)
    try:
        model = dist_checkpointing.load({"model": model_sharded_state_dict(module)}, str(path / WEIGHTS),
                                        sharded_strategy=_load_strategy(),
                                        verify_integrity=True)["model"]  # fmt: skip
    except Exception as e:
        if type(e).__name__ == "CheckpointingException":
            raise files.CorruptCheckpointError(f"Checkpoint {path} cannot be read: {e}") from None
        raise
    run["state_dict"] = load_model_state(module, model)
    run["optimizer_states"] = []  # read by load_optimizer_state
    run[_PATH_KEY] = str(path)
    return run


_PATH_KEY = "speechtrain_dist_checkpoint"


def load_model_state(module: torch.nn.Module, loaded: dict[str, Any]) -> dict[str, Any]:
    """A state dict for ``module.load_state_dict``: the loaded tensors, with the module's own non-tensor entries
    (which the checkpoint leaves out) and in its key order."""
    current = module.state_dict()
    return {key: loaded.get(key, value) for key, value in current.items()}


def holds_optimizer_state(checkpoint: dict[str, Any]) -> bool:
    """``checkpoint`` (from :func:`load_checkpoint`) has its optimizer state still in the folder."""
    return _PATH_KEY in checkpoint


@torch.no_grad()  # Megatron copies the loaded state into its (grad-requiring) main parameters in place
def load_optimizer_state(checkpoint: dict[str, Any], module: torch.nn.Module, optimizers: list[Any]) -> None:
    """Load the optimizer state of the checkpoint :func:`load_checkpoint` returned into ``optimizers`` (built for
    the current layout). A collective call on all ranks."""
    from megatron.core import dist_checkpointing

    from speechtrain.lightning.megatron_compat import fused_cpu_kernels

    if not optimizers:
        return
    path = Path(checkpoint[_PATH_KEY])
    saved = _check(path)
    optimizer = optimizers[0]
    model_sharded = model_sharded_state_dict(module)
    if bool(saved.get("distributed_optimizer")) != _distributed(optimizer):
        logger.info("Checkpoint %s: optimizer state written with use_distributed_optimizer=%s, read with %s.",
                    path, saved.get("distributed_optimizer"), _distributed(optimizer))  # fmt: skip
    sharded = optimizer_sharded_state_dict(optimizer, model_sharded, is_loading=True)
    state = dist_checkpointing.load({"optimizer": sharded}, str(path / WEIGHTS),
                                    sharded_strategy=_load_strategy())["optimizer"]  # fmt: skip
    _mcore(optimizer).load_state_dict(state)
    fused_cpu_kernels(_mcore(optimizer))  # the loaded groups carry the flags they were saved with
