"""Checkpoint files of the Megatron bridge: one shard per model-parallel rank, written to survive any kill.

Without model parallelism a checkpoint is one file, as in Lightning. With TP x PP > 1 it is a folder::

    <name>.ckpt/
        tp00_pp000.ckpt ...    model + optimizer state of each (tensor, pipeline) rank (data-parallel rank 0)
        metadata.json          the layout and each shard's size; written last, so a folder without it is an
                               interrupted save

A file is written to ``<name>.ckpt.partial`` in the same folder, fsynced, renamed straight over ``<name>.ckpt``
(``os.replace``, atomic) and the folder fsynced: a kill or a power loss at any moment leaves either the old or the
new checkpoint under the name, never none and never half of one. A folder cannot be renamed over another, so a
sharded save moves the old one aside to ``<name>.ckpt.old`` first; a kill between those two renames leaves both
complete folders beside the name, and :func:`checkpoint_candidates` takes the newer. :func:`clean_leftovers`
removes what killed saves left behind. A checkpoint that cannot be written (a full disk, a file-size limit) is
reported with the path and the operating system's reason, and leaves the previous one intact.

Every checkpoint is read through :func:`load_checkpoint` (or :func:`load_verified` for bytes from another
container): each member of the file's zip container is checked against its CRC-32 (torch writes one per record)
before ``torch.load(weights_only=True)``, so a truncated or corrupted file is refused with its name instead of
loading wrong numbers, and nothing in it can run code.
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
DIST_FORMAT = "speechtrain-dist-checkpoint"  # checkpoint_format=torch_dist (speechtrain.lightning.dist_checkpoint)
METADATA = "metadata.json"


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _agree(error: BaseException | None, path: Path) -> None:
    """A barrier that carries each rank's outcome (one all-reduce of a failure flag): when any rank failed its part
    of the save, every rank raises at once, instead of the others waiting in the next barrier for a rank that is
    gone. The failing rank raises its own error."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        nccl = torch.distributed.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        failed = torch.tensor([1.0 if error is not None else 0.0], device=device)
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if error is None and failed.item() > 0:
            raise CheckpointWriteError(f"Checkpoint {path}: another rank failed to write its part (its error is in "
                                       "its log); the previous checkpoint is kept.")  # fmt: skip
    if error is not None:
        raise error


def _is_global_zero() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _shard_name(tp_rank: int, pp_rank: int) -> str:
    return f"tp{tp_rank:02d}_pp{pp_rank:03d}.ckpt"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


PARTIAL, OLD = ".partial", ".old"


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` survive a power loss (the folder's entry list reaches the disk)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(tmp: Path, path: Path) -> None:
    """Put the complete ``tmp`` (a fsynced file or folder) in place of ``path``, durably.

    A file is renamed straight over ``path``. A folder cannot replace a folder in one rename: the old one goes to
    ``<path>.old`` first and is deleted once the new one is in place (see :func:`checkpoint_candidates` for a kill
    in between)."""
    if (tmp.is_dir() or path.is_dir()) and path.exists():
        old = path.with_name(path.name + OLD)
        _remove(old)
        os.replace(path, old)
        os.replace(tmp, path)
        _fsync_folder(path.parent)  # both renames on disk before the old copy goes
        _remove(old)
    else:
        os.replace(tmp, path)
        _fsync_folder(path.parent)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full); the previous one at that path is intact."""


class _FileSink:
    """The file ``torch.save`` writes into, through ``os.write``: it keeps the operating system's error of a failed
    write (``ENOSPC``, ``EFBIG``), which torch reports only as "unexpected pos"."""

    def __init__(self, fd: int) -> None:
        self.fd, self.position, self.error = fd, 0, None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        try:
            while view:
                written = os.write(self.fd, view)
                view, self.position = view[written:], self.position + written
        except OSError as error:
            self.error = error
            raise
        return len(data)

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self.position


def _write_error(error: OSError, path: Path) -> CheckpointWriteError:
    code = error.errno or errno.EIO
    reasons = {errno.ENOSPC: "the disk is full",
               errno.EFBIG: "the file would exceed the size limit of this process or file system"}  # fmt: skip
    reason = reasons.get(code, error.strerror or str(error))
    kept = f"the previous checkpoint at {path} is intact" if path.exists() else "no earlier checkpoint existed"
    name = errno.errorcode.get(code, str(code))
    return CheckpointWriteError(code, f"Could not write checkpoint {path}: {reason} ({name}: {error}); {kept}.")


def _save(checkpoint: dict[str, Any], tmp: Path, path: Path) -> None:
    """``torch.save`` to ``tmp`` and fsync it; on failure ``tmp`` is removed and the error names ``path``."""
    sink = None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            sink = _FileSink(fd)
            torch.save(checkpoint, sink)
            os.fsync(fd)
        finally:
            os.close(fd)
    except (OSError, RuntimeError) as error:  # torch reports a failed write as a RuntimeError
        _remove(tmp)
        cause = sink.error if sink is not None and sink.error is not None else error
        if not isinstance(cause, OSError):
            raise
        raise _write_error(cause, path) from cause


class CorruptCheckpointError(ValueError):
    """A checkpoint (file or bytes) that is truncated or fails its checksums."""


def verify_file(path: str | os.PathLike) -> None:
    """Check a checkpoint file's zip container: present, complete and every member matching its CRC-32.

    Raises:
        CorruptCheckpointError: naming the file (and the bad member) when it is truncated or corrupt.
    """
    path = Path(path)
    with open(path, "rb") as f:
        _verify(f, str(path))


def _verify(f: Any, name: str) -> None:
    if not zipfile.is_zipfile(f):
        f.seek(0)
        head = f.read(4)
        if head[:2] == b"PK" or not head:  # a zip whose end is missing, or an empty file
            raise CorruptCheckpointError(f"Checkpoint {name} is truncated or corrupt (its zip directory is missing).")
        return  # a legacy (non-zip) torch file: nothing to verify
    try:
        with zipfile.ZipFile(f) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CorruptCheckpointError(f"Checkpoint {name} is truncated or corrupt: {e}.") from None
    if bad is not None:
        raise CorruptCheckpointError(f"Checkpoint {name} is corrupt: member {bad!r} does not match its checksum.")


def load_verified(source: str | os.PathLike | bytes, name: str | None = None, weights_only: bool = True) -> Any:
    """``torch.load`` of a checkpoint file (or its bytes, e.g. a member of another archive) after
    :func:`verify_file`'s check; ``name`` names it in errors (default: the path). The one place where speechtrain
    unpickles a file: with ``weights_only=True`` (the default) only tensors and plain containers are accepted.

    Raises:
        CorruptCheckpointError: the data is truncated or corrupt.
        pickle.UnpicklingError: it holds anything but tensors and plain data (``weights_only``).
    """
    import io

    if isinstance(source, bytes):
        handle: Any = io.BytesIO(source)
        name = name or "<bytes>"
    else:
        handle = open(source, "rb")  # noqa: SIM115 - closed below, after torch.load
        name = name or str(source)
    with handle:
        _verify(handle, name)
        handle.seek(0)
        return torch.load(handle, map_location="cpu", weights_only=weights_only)


def save_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``checkpoint`` (each rank's own) so that no kill or power loss leaves ``path`` without a complete
    checkpoint; a collective call on all ranks.

    Raises:
        CheckpointWriteError: when the file cannot be written (e.g. a full disk); the previous one is kept.
    """
    path = Path(path)
    tp, pp = parallel_state.tensor_parallel_world_size(), parallel_state.pipeline_parallel_world_size()
    tmp = path.with_name(path.name + PARTIAL)
    if tp * pp == 1:
        error = None
        if _is_global_zero():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                _save(checkpoint, tmp, path)
                _replace(tmp, path)
            except Exception as e:  # every rank learns of it in _agree (no rank left waiting in a barrier)
                error = e
        _agree(error, path)
        return
    error = None
    if _is_global_zero():
        try:
            _remove(tmp)
            tmp.mkdir(parents=True)
        except Exception as e:
            error = e
    _agree(error, path)
    if parallel_state.data_parallel_rank() == 0:
        shard = tmp / _shard_name(parallel_state.tensor_parallel_rank(), parallel_state.pipeline_parallel_rank())
        try:
            _save(checkpoint, shard, path)
        except Exception as e:
            error = e
    _agree(error, path)
    if _is_global_zero():
        expected = {_shard_name(t, p) for t in range(tp) for p in range(pp)}
        missing = expected - {f.name for f in tmp.iterdir()}
        if missing:
            raise RuntimeError(f"Checkpoint {path}: shards {sorted(missing)} were not written.")
        sizes = {name: (tmp / name).stat().st_size for name in sorted(expected)}
        metadata = {"format": FORMAT, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                    "shard_bytes": sizes}  # fmt: skip
        _fsync_folder(tmp)
        marker = tmp / METADATA
        with open(marker, "w") as f:  # the complete-marker, written last
            f.write(json.dumps(metadata))
            f.flush()
            os.fsync(f.fileno())
        _fsync_folder(tmp)
        _replace(tmp, path)
    _barrier()


def _complete_folder(path: Path) -> bool:
    """A sharded checkpoint folder whose save finished: its marker is there and every shard has its size."""
    try:
        metadata = json.loads((path / METADATA).read_text())
        sizes = metadata.get("shard_bytes", {})
        return all((path / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, ValueError, AttributeError):
        return False


def checkpoint_candidates(path: str | os.PathLike) -> list[Path]:
    """Where the checkpoint saved under ``path`` can be read from, best first: ``path`` itself; for a sharded
    folder missing because a kill fell between its two renames, the new complete ``<path>.partial`` and the old
    ``<path>.old`` (also a file moved aside by earlier versions of this module). Read-only (every rank of a resumed
    run computes the same answer); files are yet to be verified (:func:`verify_file`)."""
    path = Path(path)
    if path.is_file() or _complete_folder(path):
        return [path]
    if path.exists():
        return []
    partial, old = path.with_name(path.name + PARTIAL), path.with_name(path.name + OLD)
    return [p for p in (partial, old) if _complete_folder(p)] + ([old] if old.is_file() else [])


def clean_leftovers(folder: str | os.PathLike) -> list[Path]:
    """Remove what killed saves left in ``folder`` (global rank 0, at the start of a run): ``*.partial`` files
    and incomplete folders, and the ``*.old`` / ``*.partial`` leftovers of checkpoints that are in place. The best
    leftover of a checkpoint that is not in place (see :func:`checkpoint_candidates`) is kept. Returns what was
    removed."""
    folder = Path(folder)
    removed = []
    for item in sorted(folder.glob(f"*{PARTIAL}")) + sorted(folder.glob(f"*{OLD}")):
        target = item.with_name(item.name[: -len(item.suffix)])
        if item in checkpoint_candidates(target)[:1]:
            continue
        _remove(item)
        removed.append(item)
    return removed


def load_checkpoint(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """This rank's part of a checkpoint written by :func:`save_checkpoint` (or a plain Lightning file).

    Raises:
        ValueError: the file is truncated or corrupt, the folder is an interrupted save, or it was written with
            another TP/PP layout.
    """
    path = Path(path)
    if path.is_file():
        return load_verified(path, weights_only=weights_only)
    metadata_file = path / METADATA
    if not metadata_file.is_file():
        raise ValueError(f"Checkpoint {path} is incomplete (no {METADATA}): its save was interrupted.")
    metadata = json.loads(metadata_file.read_text())
    if metadata.get("format") == DIST_FORMAT:
        raise ValueError(
            f"Checkpoint {path} is in Megatron's distributed format (checkpoint_format=torch_dist): resume from it "
            "with trainer.fit(ckpt_path=...) under MegatronStrategy, which reads it under any layout."
        )
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
    return load_verified(shard, weights_only=weights_only)


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
