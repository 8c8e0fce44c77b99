"""Checkpoint files of the Megatron bridge: one shard per model-parallel rank, written atomically.

Without model parallelism a checkpoint is one file, as in Lightning. With TP x PP > 1 it is a folder::

    <name>.ckpt/
        tp00_pp000.ckpt ...    model + optimizer state of each (tensor, pipeline) rank (data-parallel rank 0)
        metadata.json          the layout; written last, so a folder without it is an interrupted save

Every save goes to ``<name>.ckpt.partial`` first and is renamed into place only when complete, so a crash never
leaves a checkpoint that looks whole; an older checkpoint of the same name survives until the new one is ready,
and one that cannot be written (a full disk) is reported with the path and leaves the previous one intact. On
load, every member of the file's zip container is checked against its CRC-32 (torch writes one per record), so a
truncated or corrupted file is refused with its name instead of loading wrong numbers.
"""

import errno
import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

from speechtrain.lightning import parallel_state

FORMAT = "speechtrain-sharded-checkpoint"
METADATA = "metadata.json"


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _is_global_zero() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _shard_name(tp_rank: int, pp_rank: int) -> str:
    return f"tp{tp_rank:02d}_pp{pp_rank:03d}.ckpt"


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _replace(tmp: Path, path: Path) -> None:
    """Move ``tmp`` to ``path``; an existing ``path`` is removed only once ``tmp`` is in place."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        _remove(old)
        os.replace(path, old)
    os.replace(tmp, path)
    _remove(old)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full); the previous one at that path is intact."""


def _save(checkpoint: dict[str, Any], tmp: Path, path: Path) -> None:
    """``torch.save`` to ``tmp``; on failure the partial file is removed and the error names ``path``."""
    try:
        torch.save(checkpoint, tmp)
    except (OSError, RuntimeError) as e:  # torch reports a failed write as RuntimeError("... file write failed")
        _remove(tmp)
        if isinstance(e, RuntimeError) and "write" not in str(e).lower():
            raise
        reason = "the disk is full" if getattr(e, "errno", None) == errno.ENOSPC else f"{type(e).__name__}: {e}"
        kept = f"the previous checkpoint at {path} is intact" if path.exists() else "no earlier checkpoint existed"
        raise CheckpointWriteError(
            getattr(e, "errno", None) or errno.EIO, f"Could not write checkpoint {path}: {reason}; {kept}."
        ) from e


def verify_file(path: str | os.PathLike) -> None:
    """Check a checkpoint file's zip container: present, complete and every member matching its CRC-32.

    Raises:
        ValueError: naming the file (and the bad member) when it is truncated or corrupt.
    """
    path = Path(path)
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            head = f.read(4)
        if head[:2] == b"PK" or not head:  # a zip whose end is missing, or an empty file
            raise ValueError(f"Checkpoint {path} is truncated or corrupt (its zip directory is missing).")
        return  # a legacy (non-zip) torch file: nothing to verify
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ValueError(f"Checkpoint {path} is truncated or corrupt: {e}.") from None
    if bad is not None:
        raise ValueError(f"Checkpoint {path} is corrupt: member {bad!r} does not match its checksum.")


def save_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``checkpoint`` (each rank's own) atomically; a collective call on all ranks.

    Raises:
        CheckpointWriteError: when the file cannot be written (e.g. a full disk); the previous one is kept.
    """
    path = Path(path)
    tp, pp = parallel_state.tensor_parallel_world_size(), parallel_state.pipeline_parallel_world_size()
    tmp = path.with_name(path.name + ".partial")
    if tp * pp == 1:
        if _is_global_zero():
            path.parent.mkdir(parents=True, exist_ok=True)
            _save(checkpoint, tmp, path)
            _replace(tmp, path)
        _barrier()
        return
    if _is_global_zero():
        _remove(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    if parallel_state.data_parallel_rank() == 0:
        shard = tmp / _shard_name(parallel_state.tensor_parallel_rank(), parallel_state.pipeline_parallel_rank())
        _save(checkpoint, shard, path)
    _barrier()
    if _is_global_zero():
        expected = {_shard_name(t, p) for t in range(tp) for p in range(pp)}
        missing = expected - {f.name for f in tmp.iterdir()}
        if missing:
            raise RuntimeError(f"Checkpoint {path}: shards {sorted(missing)} were not written.")
        (tmp / METADATA).write_text(
            json.dumps({"format": FORMAT, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp})
        )
        _replace(tmp, path)
    _barrier()


def load_checkpoint(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """This rank's part of a checkpoint written by :func:`save_checkpoint` (or a plain Lightning file).

    Raises:
        ValueError: the file is truncated or corrupt, the folder is an interrupted save, or it was written with
            another TP/PP layout.
    """
    path = Path(path)
    if path.is_file():
        verify_file(path)
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    metadata_file = path / METADATA
    if not metadata_file.is_file():
        raise ValueError(f"Checkpoint {path} is incomplete (no {METADATA}): its save was interrupted.")
    metadata = json.loads(metadata_file.read_text())
    saved = (metadata["tensor_model_parallel_size"], metadata["pipeline_model_parallel_size"])
    current = (parallel_state.tensor_parallel_world_size(), parallel_state.pipeline_parallel_world_size())
    if saved != current:
        raise ValueError(
            f"Checkpoint {path} was saved with tensor_model_parallel_size={saved[0]}, "
            f"pipeline_model_parallel_size={saved[1]}; this run uses {current[0]} and {current[1]}. Resume with the "
            "same layout, or start a new run from the model archive (.stm), which holds the full weights and "
            "loads under any layout."
        )
    shard = path / _shard_name(parallel_state.tensor_parallel_rank(), parallel_state.pipeline_parallel_rank())
    verify_file(shard)
    return torch.load(shard, map_location="cpu", weights_only=weights_only)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint file or folder (global rank 0)."""
    path = Path(path)
    if _is_global_zero():
        _remove(path)


def gather_full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on every rank: tensor-parallel shards joined, pipeline stages merged.

    A collective call on all ranks. Normalisation statistics are first averaged over the data-parallel ranks.
    Entries that are not tensors (Megatron layers' empty ``_extra_state``) are left out, so the result has the keys
    of the same model built without Megatron.
    """
    parallel_state.average_norm_statistics(module)
    state = {name: value for name, value in module.state_dict().items() if isinstance(value, torch.Tensor)}
    tp_group, pp_group = parallel_state.tensor_parallel_group(), parallel_state.pipeline_parallel_group()
    tp, pp = parallel_state.tensor_parallel_world_size(), parallel_state.pipeline_parallel_world_size()
    if tp * pp == 1:
        return state
    params = dict(module.named_parameters())
    full: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        param = params.get(name)
        if tp > 1 and param is not None and getattr(param, "tensor_model_parallel", False):
            pieces = [torch.empty_like(tensor) for _ in range(tp)]
            torch.distributed.all_gather(pieces, tensor.contiguous(), group=tp_group)
            dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
            if stride > 1:  # a strided split (SwiGLU's [gate; up]): shard r holds [gate_r; up_r]
                parts = [piece.chunk(stride, dim=dim) for piece in pieces]
                pieces = [part[j] for j in range(stride) for part in parts]
            tensor = torch.cat(pieces, dim=dim)
        full[name] = tensor.detach().cpu()
    if pp > 1:
        stages: list[dict[str, torch.Tensor] | None] = [None] * pp
        torch.distributed.all_gather_object(stages, full, group=pp_group)
        full = {name: tensor for stage in stages for name, tensor in stage.items()}
    return full


def shard_full_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`gather_full_state_dict` for this rank: full tensors sliced to ``module``'s
    tensor-parallel shards (by each parameter's ``partition_dim`` and ``partition_stride``), so a full-weight
    archive loads into a model built under any tensor-parallel size. Keys that are not tensor-parallel parameters
    of ``module`` pass as they are. (Pipeline stages are not split here: load the whole state dict and let
    ``strict=False`` drop the rest.)
    """
    tp = parallel_state.tensor_parallel_world_size()
    if tp == 1:
        return dict(state)
    rank = parallel_state.tensor_parallel_rank()
    params = dict(module.named_parameters())
    out = {}
    for name, tensor in state.items():
        param = params.get(name)
        if param is not None and getattr(param, "tensor_model_parallel", False) and tensor.shape != param.shape:
            dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
            tensor = torch.cat([part.chunk(tp, dim=dim)[rank] for part in tensor.chunk(stride, dim=dim)], dim=dim)
        out[name] = tensor.contiguous()
    return out
