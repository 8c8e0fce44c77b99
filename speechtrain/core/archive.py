"""The ``.stm`` model archive: one portable file with a model's config, weights and artifacts.

Layout (an uncompressed tar, readable with ``tar -tf``)::

    manifest.json             format version, artifacts by config key, size and sha256 of every other member
    model_config.yaml         the model config; artifact paths replaced by ``stm:<file name>``
    model_weights.safetensors the state dict (safetensors: loading never unpickles code)
    trainer_config.yaml       optional: the arguments of the trainer that trained the model
    artifacts/<file name>     tokenizer files and the like

Archives are written to a temporary name next to the target and renamed, so a crash never leaves a half-written
file under the final name. Reading verifies every member's size and checksum, refuses links, absolute paths and
``..`` components, reads in bounded memory (:func:`read_tar`: ``SPEECHTRAIN_MAX_ARCHIVE_BYTES`` decompressed bytes
per archive, default 64 GiB, and ``SPEECHTRAIN_MAX_ARCHIVE_MEMBER_BYTES`` per member, default 32 GiB), and names the
archive and the problem when anything is off.
"""

import hashlib
import importlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import yaml
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

FORMAT = "speechtrain-archive"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CONFIG = "model_config.yaml"
WEIGHTS = "model_weights.safetensors"
TRAINER_CONFIG = "trainer_config.yaml"
ARTIFACT_DIR = "artifacts"
ARTIFACT_PREFIX = "stm:"
# Bounds on what one archive (.stm, .nemo) may hold once decompressed, read from the environment when an archive is
# opened: a decompression bomb is refused by name before it fills memory (a real archive holds a model's weights).
MAX_ARCHIVE_BYTES_ENV = "SPEECHTRAIN_MAX_ARCHIVE_BYTES"
MAX_ARCHIVE_MEMBER_BYTES_ENV = "SPEECHTRAIN_MAX_ARCHIVE_MEMBER_BYTES"
DEFAULT_MAX_ARCHIVE_BYTES = 64 * 2**30
DEFAULT_MAX_ARCHIVE_MEMBER_BYTES = 32 * 2**30


class ArchiveError(ValueError):
    """The file is not a valid speechtrain archive (corrupt, truncated, hostile or of another format)."""


@dataclass
class Archive:
    """The contents of an archive, as read by :func:`read_archive`.

    Attributes:
        config: the model config, with artifact references resolved to files in ``artifact_dir``.
        state_dict: the weights, on the CPU.
        artifacts: config key -> extracted file path.
        trainer_config: the trainer's arguments, when the archive holds them.
        artifact_dir: a temporary folder that holds the extracted artifacts for as long as this object lives.
    """

    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    artifacts: dict[str, Path] = field(default_factory=dict)
    trainer_config: dict[str, Any] | None = None
    artifact_dir: tempfile.TemporaryDirectory | None = None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _set_key(config: dict[str, Any], dotted_key: str, value: Any) -> None:
    node = config
    *parents, last = dotted_key.split(".")
    for part in parents:
        node = node[part]
    node[last] = value


def _portable_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that share no storage (safetensors refuses shared storage)."""
    result, seen = {}, set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach().cpu()
        pointer = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if pointer in seen or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add(pointer)
        result[name] = tensor
    return result


def write_archive(
    path: str | Path,
    config: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    artifacts: dict[str, str | Path] | None = None,
    trainer_config: dict[str, Any] | None = None,
) -> Path:
    """Write an archive atomically.

    Args:
        path: target file (``.stm`` by convention); its folder is created.
        config: plain-data model config. For every ``artifacts`` key (a dotted config key) the value stored in
            the archive's config becomes ``stm:<file name>``.
        state_dict: the model weights.
        artifacts: dotted config key -> local file to pack.
        trainer_config: optional plain-data trainer arguments.

    Returns:
        The path written.
    """
    path = Path(path)
    config = json.loads(json.dumps(config))
    members: dict[str, bytes] = {}
    artifact_names: dict[str, str] = {}
    for key, source in (artifacts or {}).items():
        source = Path(source)
        if not source.is_file():
            raise FileNotFoundError(f"Artifact {key!r} points to {source}, which is not a file.")
        name = source.name
        while f"{ARTIFACT_DIR}/{name}" in members:
            name = f"_{name}"
        members[f"{ARTIFACT_DIR}/{name}"] = source.read_bytes()
        artifact_names[key] = name
        _set_key(config, key, f"{ARTIFACT_PREFIX}{name}")
    members[CONFIG] = yaml.safe_dump(config, sort_keys=False).encode()
    members[WEIGHTS] = save_safetensors(_portable_state_dict(state_dict))
    if trainer_config is not None:
        members[TRAINER_CONFIG] = yaml.safe_dump(trainer_config, sort_keys=False).encode()
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "artifacts": artifact_names,
        "members": {name: {"size": len(data), "sha256": _sha256(data)} for name, data in members.items()},
    }
    members = {MANIFEST: json.dumps(manifest, indent=1).encode(), **members}

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle, tarfile.open(fileobj=handle, mode="w") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
        with open(tmp_name, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


def _safe_member_name(archive: Path, name: str) -> str:
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or name.startswith("/") or "\\" in name:
        raise ArchiveError(f"{archive}: refusing member with unsafe path {name!r}.")
    return str(pure)


def _archive_member(path: Path, info: tarfile.TarInfo) -> str:
    name = _safe_member_name(path, info.name)
    if not info.isfile():
        raise ArchiveError(f"{path}: refusing member {name!r}: only regular files are allowed.")
    return name


def _read_members(path: Path) -> dict[str, bytes]:
    with open(path, "rb") as head:
        is_zip = head.read(4) == b"PK\x03\x04"
    if is_zip:  # torch.save's format: a Lightning .ckpt, or a bare state dict
        raise ArchiveError(
            f"{path} is a PyTorch/Lightning checkpoint (a zip), not a speechtrain model archive (.stm, a tar). Pass "
            "the run's archive <run folder>/<name>.stm (written when training ends), or fine-tune from the "
            "checkpoint: examples/asr_finetune.py init_from.path=<the .ckpt> reads the model config from its run "
            "folder (a training script's init_from.path also takes a .ckpt: its weights over the YAML's model)."
        )
    return read_tar(path, _archive_member)


def byte_limit(variable: str, default: int) -> int:
    """A byte count from the environment variable ``variable`` (``default`` when unset).

    Raises:
        ValueError: the value is not a whole number > 0.
    """
    value = os.environ.get(variable)
    if value is None:
        return default
    if not value.strip().isdigit() or int(value) <= 0:
        raise ValueError(f"{variable}={value!r}: expected a number of bytes > 0.")
    return int(value)


class _CountingReader:
    """A decompressed byte stream that stops with an :class:`ArchiveError` past ``limit`` bytes (headers count:
    tarfile reads long-name and pax headers whole)."""

    def __init__(self, raw: Any, path: Path, limit: int, error: type[ArchiveError]) -> None:
        self.raw, self.path, self.limit, self.error, self.count = raw, path, limit, error, 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(self.limit + 1 - self.count if size is None or size < 0 else size)
        self.count += len(data)
        if self.count > self.limit:
            raise self.error(
                f"{self.path}: more than {self.limit} bytes once decompressed, over the limit per archive "
                f"({MAX_ARCHIVE_BYTES_ENV}); refused (a decompression bomb?)."
            )
        return data


def _decompressed(path: Path) -> Any:
    """``path`` opened for reading, through gzip, bz2 or xz when its first bytes say so."""
    import bz2
    import gzip
    import lzma

    with open(path, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.open(path, "rb")
    if magic.startswith(b"BZh"):
        return bz2.open(path, "rb")
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.open(path, "rb")
    return open(path, "rb")  # noqa: SIM115 - closed by read_tar


def read_tar(
    path: Path,
    member_name: Callable[[Path, tarfile.TarInfo], str | None],
    error: type[ArchiveError] = ArchiveError,
) -> dict[str, bytes]:
    """Every member of the tar ``path`` (plain, gzip, bz2 or xz) that ``member_name`` names (None: skip it; it
    raises for a member to refuse), read in one sequential pass in bounded memory: a member over
    ``SPEECHTRAIN_MAX_ARCHIVE_MEMBER_BYTES`` or more than ``SPEECHTRAIN_MAX_ARCHIVE_BYTES`` decompressed bytes in
    all is refused before it is read.

    Raises:
        ArchiveError (of class ``error``): a refused member, a limit passed, or a truncated or corrupt file.
    """
    import lzma
    import zlib

    max_total = byte_limit(MAX_ARCHIVE_BYTES_ENV, DEFAULT_MAX_ARCHIVE_BYTES)
    max_member = byte_limit(MAX_ARCHIVE_MEMBER_BYTES_ENV, DEFAULT_MAX_ARCHIVE_MEMBER_BYTES)
    members: dict[str, bytes] = {}
    declared = 0
    try:
        with _decompressed(path) as raw, tarfile.open(fileobj=_CountingReader(raw, path, max_total, error),
                                                      mode="r|") as tar:  # fmt: skip
            for info in tar:
                name = member_name(path, info)
                if name is None:
                    continue
                if info.size > max_member:
                    raise error(
                        f"{path}: member {name!r} holds {info.size} bytes, over the limit of {max_member} bytes per "
                        f"member ({MAX_ARCHIVE_MEMBER_BYTES_ENV}); refused."
                    )
                declared += info.size
                if declared > max_total:
                    raise error(
                        f"{path}: more than {max_total} bytes once decompressed, over the limit per archive "
                        f"({MAX_ARCHIVE_BYTES_ENV}); refused at member {name!r}."
                    )
                handle = tar.extractfile(info)
                members[name] = handle.read() if handle is not None else b""
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as cause:
        raise error(f"{path} is not a readable archive (corrupt or truncated?): {cause}") from None
    return members


def read_archive(path: str | Path) -> Archive:
    """Read and verify an archive written by :func:`write_archive`.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ArchiveError: when the file is corrupt, truncated, of another format or contains unsafe members.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No model archive at {path}.")
    members = _read_members(path)
    if MANIFEST not in members:
        hint = " It looks like a NeMo checkpoint: name it *.nemo." if "model_weights.ckpt" in members else ""
        raise ArchiveError(f"{path} is not a speechtrain archive: it has no {MANIFEST}.{hint}")
    try:
        manifest = json.loads(members[MANIFEST])
    except json.JSONDecodeError as error:
        raise ArchiveError(f"{path}: {MANIFEST} is not valid JSON: {error}") from error
    if manifest.get("format") != FORMAT:
        raise ArchiveError(f"{path} is not a speechtrain archive (format {manifest.get('format')!r}).")
    if manifest.get("version", 0) > FORMAT_VERSION:
        raise ArchiveError(
            f"{path} uses archive format version {manifest['version']}; this speechtrain reads up to "
            f"{FORMAT_VERSION}. Upgrade speechtrain."
        )
    for name, expected in manifest["members"].items():
        data = members.get(name)
        if data is None:
            raise ArchiveError(f"{path} is truncated or incomplete: member {name!r} is missing.")
        if len(data) != expected["size"] or _sha256(data) != expected["sha256"]:
            raise ArchiveError(f"{path} is corrupt: member {name!r} does not match its recorded checksum.")

    config = yaml.safe_load(members[CONFIG])
    try:
        state_dict = load_safetensors(members[WEIGHTS])
    except Exception as error:  # safetensors raises its own error type for anything that is not its format
        raise ArchiveError(
            f"{path}: {WEIGHTS} is not a safetensors file ({error}); weights are never unpickled."
        ) from None
    trainer_config = yaml.safe_load(members[TRAINER_CONFIG]) if TRAINER_CONFIG in members else None
    artifact_dir = None
    artifacts: dict[str, Path] = {}
    if manifest["artifacts"]:
        artifact_dir = tempfile.TemporaryDirectory(prefix="speechtrain-artifacts-")
        for key, name in manifest["artifacts"].items():
            member = f"{ARTIFACT_DIR}/{_safe_member_name(path, name)}"
            if member not in members or "/" in name:
                raise ArchiveError(f"{path}: artifact {key!r} refers to a missing or unsafe member {name!r}.")
            target = Path(artifact_dir.name) / name
            target.write_bytes(members[member])
            artifacts[key] = target
            _set_key(config, key, str(target))
    return Archive(config, state_dict, artifacts, trainer_config, artifact_dir)


# Readers of other frameworks' checkpoint files by suffix, registered by the model family that knows the format;
# core names only the package that registers each (imported on first use, as archives' model classes are).
MODEL_FILE_READERS: dict[str, Callable[[str | Path], Archive]] = {}
FOREIGN_FORMATS = {".nemo": "speechtrain.asr"}


def read_model_file(path: str | Path) -> Archive:
    """A speechtrain archive, or another framework's checkpoint translated to one by its registered reader
    (:data:`MODEL_FILE_READERS`; a NeMo ``.nemo`` by :func:`speechtrain.asr.nemo_import.read_nemo`)."""
    suffix = Path(path).suffix
    if suffix not in MODEL_FILE_READERS and suffix in FOREIGN_FORMATS:
        importlib.import_module(FOREIGN_FORMATS[suffix])
    if suffix in MODEL_FILE_READERS:
        return MODEL_FILE_READERS[suffix](path)
    return read_archive(path)
