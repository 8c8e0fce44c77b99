"""NeMo data as lazy lhotse cut sources: JSON-lines manifests and tarred audio datasets.

Both are lhotse lazy iterators (wrap them in ``lhotse.CutSet``): nothing is read until the sampler asks for the
next cut, so a 10-million-line manifest starts training in seconds and memory does not grow with its length.

lhotse 1.33 reads its own formats (cuts, Shar) lazily but has no reader for NeMo's formats (NeMo keeps its
adapters in NeMo, which speechtrain does not import); these two are written here on lhotse's building blocks
(``Dillable``, ``Recording.from_bytes``, ``MonoCut``).

**NeMo tarred datasets** (``is_tarred: true``): audio files packed into tar shards (``audio_{0..127}.tar``),
described by one manifest per shard (``manifest_{0..127}.json``, paired by position) or by one manifest whose
entries carry ``shard_id``. Each manifest entry's ``audio_filepath`` names a tar member (by its base name).

Nothing in these files stops a run: up to ``skip_bad_lines`` bad manifest lines per pass, tar members that are
missing, larger than ``max_tar_member_bytes`` or not decodable audio, and the rest of a truncated or corrupt shard
become placeholder cuts (:func:`~speechtrain.data.audio_text.unusable_cut`) that the datasets count as skipped
utterances, by reason, with the file (and line, or member) named.

Sharding: the shard list is permuted once per pass over the data with ``seed + pass`` (the same permutation on
every rank) and data-parallel rank ``r`` of ``W`` reads shards ``perm[r::W]``: within a pass every shard is read
by exactly one rank, once. Tars are read sequentially in the rank's main process (the sampler's side) and the
audio bytes travel with the cuts to the loader workers, which decode them: so no shard is opened by two workers
either. Passes follow each other without end (tarred data has no epochs, as in NeMo): the training length is
``trainer.max_steps`` and the epoch length ``trainer.limit_train_batches``.
"""

import io
import logging
import lzma
import os
import random
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lhotse import Recording, SupervisionSegment
from lhotse.audio import AudioSource
from lhotse.cut import MonoCut
from lhotse.lazy import Dillable

from speechtrain.data.audio_text import unusable_cut
from speechtrain.data.manifest import DEFAULT_SKIP_BAD_LINES, BadLine, ManifestError, iter_manifest_entries

# The largest audio file a NeMo tarred shard may hand over (one member is held in memory while it is decoded).
DEFAULT_MAX_TAR_MEMBER_BYTES = 2**30

logger = logging.getLogger("speechtrain.data")

_KNOWN = ("audio_filepath", "offset", "duration", "text", "lang", "speaker")


def _source_tag(path: str | os.PathLike) -> str:
    # The manifest's path is part of every cut ID: corpora whose files share names stay distinct when blended.
    return f"{zlib.crc32(str(Path(path).resolve()).encode()):08x}"


def manifest_cut_ids(path: str | os.PathLike, records: list[dict[str, Any]]) -> list[str]:
    """The cut ID of each line of the NeMo manifest at ``path`` (:class:`LazyNeMoManifest`'s)."""
    tag = _source_tag(path)
    return [_cut_id(record, tag, index) for index, record in enumerate(records)]


def _cut_id(record: dict[str, Any], tag: str, index: int) -> str:
    return f"{Path(record['audio_filepath']).stem}-{tag}-{index}"


def cut_from_record(record: dict[str, Any], cut_id: str, sample_rate: int, recording: Recording | None = None) -> Any:
    """A lhotse ``MonoCut`` for one NeMo manifest record (metadata only unless ``recording`` holds the audio).

    Extra manifest keys are kept as the cut's custom fields; ``lang`` and ``speaker`` become the supervision's
    language and speaker.
    """
    offset, duration = record["offset"], record["duration"]
    if recording is None:
        rate = int(record.get("sampling_rate", sample_rate))
        recording = Recording(
            id=cut_id,
            sources=[AudioSource(type="file", channels=[0], source=record["audio_filepath"])],
            sampling_rate=rate,
            num_samples=round((offset + duration) * rate),
            duration=offset + duration,
        )
    supervision = SupervisionSegment(
        id=cut_id, recording_id=recording.id, start=offset, duration=duration, channel=0, text=record["text"],
        language=record.get("lang"), speaker=None if record.get("speaker") is None else str(record["speaker"]),
    )  # fmt: skip
    custom = {k: v for k, v in record.items() if k not in _KNOWN}
    return MonoCut(id=cut_id, start=offset, duration=duration, channel=0, recording=recording,
                   supervisions=[supervision], custom=custom or None)  # fmt: skip


class LazyNeMoManifest(Dillable):
    """The cuts of a NeMo JSON-lines manifest, read line by line on each iteration.

    Cut IDs are ``<audio file stem>-<hash of the manifest path>-<line index>``. Up to ``skip_bad_lines`` bad lines
    per pass are logged and stand as placeholder cuts (``bad_manifest_line``, file and line named) that the
    datasets count as skipped; one more stops the iteration with a
    :class:`~speechtrain.data.manifest.ManifestError` naming the file and line.

    :param path: the manifest.
    :param sample_rate: the rate assumed for entries without ``sampling_rate`` (only used for sample counts; the
        reader takes the file's own rate).
    :param skip_bad_lines: bad lines tolerated per pass.
    """

    def __init__(
        self, path: str | os.PathLike, sample_rate: int = 16000, skip_bad_lines: int = DEFAULT_SKIP_BAD_LINES
    ) -> None:
        self.path = str(path)
        self.sample_rate = sample_rate
        self.skip_bad_lines = skip_bad_lines
        if not Path(self.path).is_file():
            raise FileNotFoundError(f"manifest not found: {self.path}")

    def __iter__(self) -> Iterator[Any]:
        tag = _source_tag(self.path)
        for index, entry in enumerate(iter_manifest_entries(self.path, self.skip_bad_lines)):
            if isinstance(entry, BadLine):
                logger.warning("%s; skipped and counted (skip_bad_lines=%d)", entry.problem, self.skip_bad_lines)
                yield unusable_cut(f"badline-{tag}-{index}", "bad_manifest_line", entry.problem)
            else:
                yield cut_from_record(entry, _cut_id(entry, tag, index), self.sample_rate)

    def __len__(self) -> int:
        return sum(1 for _ in iter_manifest_entries(self.path, self.skip_bad_lines))


def expand_paths(value: Any, what: str) -> list[str]:
    """``value`` (a path, a brace pattern ``audio_{0..127}.tar``, NeMo's CLI spelling ``audio__OP_0..127_CL_.tar``,
    or a list of those) as a flat list of paths, in order."""
    from braceexpand import braceexpand

    if value is None:
        return []
    items = [value] if isinstance(value, str | os.PathLike) else list(value)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str | os.PathLike):
            raise ValueError(f"{what}: expected a path or a list of paths, got {item!r}")
        out += list(braceexpand(str(item).replace("_OP_", "{").replace("_CL_", "}")))
    return out


class LazyNeMoTarredIterator(Dillable):
    """The cuts of a NeMo tarred dataset for one data-parallel rank, pass after pass (see module docstring).

    :param manifests: one manifest per tar (paired by position), or one manifest with ``shard_id`` entries.
    :param tars: the tar shards (already expanded: see :func:`expand_paths`).
    :param sample_rate: not used for decoding (the file's own rate is read); kept for parity with the manifests.
    :param dp_rank: this process's data-parallel rank.
    :param dp_world_size: the number of data-parallel ranks.
    :param seed: seeds the shard order of each pass (``seed + pass``); the same on every rank.
    :param shuffle_shards: permute the shards every pass (training); False reads them in order.
    :param max_passes: stop after this many passes over the shards (None: never).
    :param max_member_bytes: a larger tar member is not read (counted as ``oversized_audio``).
    :param skip_bad_lines: bad manifest lines tolerated per manifest and pass (see :class:`LazyNeMoManifest`).
    """

    def __init__(
        self,
        manifests: list[str],
        tars: list[str],
        sample_rate: int = 16000,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        seed: int = 0,
        shuffle_shards: bool = True,
        max_passes: int | None = None,
        max_member_bytes: int = DEFAULT_MAX_TAR_MEMBER_BYTES,
        skip_bad_lines: int = DEFAULT_SKIP_BAD_LINES,
    ) -> None:
        if not tars:
            raise ValueError("tarred_audio_filepaths names no tar file.")
        if len(manifests) != len(tars) and len(manifests) != 1:
            raise ValueError(
                f"tarred_audio_filepaths expands to {len(tars)} tar files but manifest_filepath to {len(manifests)} "
                "manifests: give one manifest per tar (same order, e.g. manifest_{0..N}.json with audio_{0..N}.tar) "
                "or a single manifest whose entries carry shard_id."
            )
        missing = [p for p in [*manifests, *tars] if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"NeMo tarred dataset: {len(missing)} file(s) not found: {', '.join(missing[:3])}")
        if len(tars) < dp_world_size:
            raise ValueError(
                f"NeMo tarred dataset: {len(tars)} tar shard(s) for {dp_world_size} data-parallel ranks; every rank "
                "needs at least one shard (re-shard the data into more tars)."
            )
        self.manifests, self.tars = [str(m) for m in manifests], [str(t) for t in tars]
        self.sample_rate = sample_rate
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seed, self.shuffle_shards, self.max_passes = seed, shuffle_shards, max_passes
        self.max_member_bytes, self.skip_bad_lines = max_member_bytes, skip_bad_lines
        self._tags: dict[str, str] = {}

    def shards(self, pass_index: int) -> list[int]:
        """Indices of the shards this rank reads in pass ``pass_index``, in reading order."""
        order = list(range(len(self.tars)))
        if self.shuffle_shards:
            random.Random(self.seed + pass_index).shuffle(order)
        return order[self.dp_rank :: self.dp_world_size]

    def _entries(self, shard: int) -> Iterator[tuple[int, dict[str, Any] | BadLine, str]]:
        """(line index, record or bad line, manifest path) of the entries of ``shard``."""
        if len(self.manifests) == len(self.tars):
            path = self.manifests[shard]
            for index, entry in enumerate(iter_manifest_entries(path, self.skip_bad_lines)):
                yield index, entry, path
            return
        path = self.manifests[0]
        for index, entry in enumerate(iter_manifest_entries(path, self.skip_bad_lines)):
            if isinstance(entry, BadLine):  # no shard_id to read: counted by one shard, once per pass
                if index % len(self.tars) == shard:
                    yield index, entry, path
                continue
            if "shard_id" not in entry:
                raise ManifestError(f"{path}:{index + 1}: a single manifest for {len(self.tars)} tars needs shard_id")
            if int(entry["shard_id"]) == shard:
                yield index, entry, path

    def read_shard(self, shard: int, with_audio: bool = True) -> Iterator[Any]:
        """The cuts of one shard, in tar order (audio bytes attached when ``with_audio``), then placeholders
        (:func:`~speechtrain.data.audio_text.unusable_cut`) for the entries whose audio could not be used."""
        by_name: dict[str, list[tuple[int, dict[str, Any], str]]] = {}
        bad_lines: list[tuple[int, BadLine, str]] = []
        for index, entry, path in self._entries(shard):
            if isinstance(entry, BadLine):
                bad_lines.append((index, entry, path))
            else:
                by_name.setdefault(os.path.basename(entry["audio_filepath"]), []).append((index, entry, path))
        tar_path = self.tars[shard]
        if not with_audio:  # metadata only (bucket bins): the manifest alone
            for entries in by_name.values():
                yield from (self._cut(shard, index, record, path, None) for index, record, path in entries)
            return
        for index, line, path in bad_lines:
            logger.warning("%s; skipped and counted (skip_bad_lines=%d)", line.problem, self.skip_bad_lines)
            yield unusable_cut(f"badline-{self._tag(path)}-{index}", "bad_manifest_line", line.problem)
        found: set[str] = set()
        failure = None
        try:
            with tarfile.open(tar_path, mode="r|*") as tar:  # streaming: one sequential read of the shard
                for member in tar:
                    name = os.path.basename(member.name)
                    entries = by_name.get(name) if member.isfile() else None
                    if not entries or name in found:
                        continue
                    cuts = list(self._member_cuts(shard, tar, member, entries))  # reads the member: may fail
                    found.add(name)
                    yield from cuts
        except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as error:
            failure = f"{type(error).__name__}: {error}"
            logger.warning("NeMo tarred dataset: shard %s is truncated or corrupt (%s); its %d entries not read by "
                           "then are skipped and counted", tar_path, failure,
                           sum(len(v) for k, v in by_name.items() if k not in found))  # fmt: skip
        for name, entries in by_name.items():
            if name in found:
                continue
            reason = "unreadable_audio" if failure else "missing_audio"
            detail = f"{tar_path}: {failure}" if failure else f"{tar_path} has no member {name!r}"
            for index, record, path in entries:
                yield self._unusable(index, record, path, reason, f"{detail} ({path}:{index + 1})")

    def _member_cuts(self, shard: int, tar: tarfile.TarFile, member: tarfile.TarInfo,
                     entries: list[tuple[int, dict[str, Any], str]]) -> Iterator[Any]:  # fmt: skip
        """The cuts of the manifest entries of one tar member, or placeholders when it is too large or not audio."""
        where = f"{self.tars[shard]}:{member.name}"
        if member.size > self.max_member_bytes:
            detail = f"{where}: {member.size} bytes, over max_tar_member_bytes={self.max_member_bytes}"
            yield from (self._unusable(i, r, p, "oversized_audio", detail) for i, r, p in entries)
            return
        data = tar.extractfile(member).read()
        try:
            recording = Recording.from_bytes(data, recording_id=f"{self.tars[shard]}/{member.name}")
        except Exception as error:  # noqa: BLE001 - any decoder failure is a bad file, not a dead run
            detail = f"{where}: {type(error).__name__}: {error}"
            yield from (self._unusable(i, r, p, "unreadable_audio", detail) for i, r, p in entries)
            return
        yield from (self._cut(shard, index, record, path, recording) for index, record, path in entries)

    def _tag(self, path: str) -> str:
        if path not in self._tags:
            self._tags[path] = _source_tag(path)
        return self._tags[path]

    def _unusable(self, index: int, record: dict[str, Any], path: str, reason: str, detail: str) -> Any:
        return unusable_cut(_cut_id(record, self._tag(path), index), reason, detail, record["duration"])

    def _cut(self, shard: int, index: int, record: dict[str, Any], path: str, recording: Recording | None) -> Any:
        cut_id = _cut_id(record, self._tag(path), index)
        if recording is None:
            # Metadata only: a placeholder recording long enough for the segment (never read).
            end = record["offset"] + record["duration"]
            recording = Recording(id=cut_id, sources=[AudioSource(type="memory", channels=[0], source=b"")],
                                  sampling_rate=self.sample_rate, num_samples=round(end * self.sample_rate),
                                  duration=end)  # fmt: skip
        cut = cut_from_record(record, cut_id, self.sample_rate, recording)
        cut.shard_origin = self.tars[shard]
        return cut

    def iter_metadata(self, limit: int) -> Iterator[Any]:
        """Up to ``limit`` cuts of this rank's first pass, from the manifests only (no tar is opened)."""
        count = 0
        for shard in self.shards(0):
            for cut in self.read_shard(shard, with_audio=False):
                yield cut
                count += 1
                if count >= limit:
                    return

    def __iter__(self) -> Iterator[Any]:
        pass_index = 0
        while self.max_passes is None or pass_index < self.max_passes:
            for shard in self.shards(pass_index):
                yield from self.read_shard(shard)
            pass_index += 1


def write_tarred_dataset(
    records: list[dict[str, Any]], out_dir: str | os.PathLike, num_shards: int
) -> tuple[str, str]:
    """Pack the audio of NeMo manifest ``records`` into ``num_shards`` tars with one manifest per shard, NeMo's
    layout (``audio_<i>.tar``, ``manifest_<i>.json``; entries name their tar member and carry ``shard_id``).

    Returns:
        The brace patterns ``(manifest_filepath, tarred_audio_filepaths)`` of the dataset.
    """
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for shard in range(num_shards):
        part = records[shard::num_shards]
        with tarfile.open(out / f"audio_{shard}.tar", "w") as tar, open(out / f"manifest_{shard}.json", "w") as f:
            for index, record in enumerate(part):
                data = Path(record["audio_filepath"]).read_bytes()
                name = f"{Path(record['audio_filepath']).stem}-{shard}-{index}{Path(record['audio_filepath']).suffix}"
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                f.write(json.dumps({**record, "audio_filepath": name, "shard_id": shard}) + "\n")
    return str(out / f"manifest_{{0..{num_shards - 1}}}.json"), str(out / f"audio_{{0..{num_shards - 1}}}.tar")
