"""Map-style dataset of (audio, transcript tokens) pairs read from a NeMo manifest, and its collator.

Audio stored at another sample rate is resampled on the fly (or, with ``resample=False``, skipped as
``wrong_sample_rate``). Bad utterances (missing or unreadable audio, empty or non-finite audio, empty or
untokenizable transcript) do not stop training: ``__getitem__`` returns None, counts the reason in
``skipped`` and logs one warning per reason per process; :func:`collate_audio_text` drops them.

Files from strangers are read defensively: a lhotse cut whose audio would come from anything but a file or memory
(lhotse runs a ``command`` source through a shell and fetches a ``url``) is refused before any audio is read
(:func:`check_audio_sources`), and audio much longer than its manifest says is read only up to the stated duration
(counted as ``longer_than_manifest``).
"""

import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import soundfile as sf
import torch
from torch.utils.data import Dataset

from speechtrain.data.manifest import read_nemo_manifest

logger = logging.getLogger("speechtrain.data")

# Reasons an utterance is skipped, in the order they are checked.
SKIP_REASONS = (
    "empty_text",
    "unencodable_text",
    "missing_audio",
    "unreadable_audio",
    "wrong_sample_rate",
    "empty_audio",
    "non_finite_audio",
)
# Reasons the readers of lazy manifests and NeMo tarred shards put on the entries they could not use (see
# :func:`unusable_cut`).
UNUSABLE_ENTRY_REASONS = ("bad_manifest_line", "missing_audio", "oversized_audio", "unreadable_audio")
# Utterances used, but read only in part: counted beside the skips.
PARTLY_READ_REASONS = ("longer_than_manifest",)

# Where lhotse may read a cut's audio from: a local file, or bytes already in memory (lhotse Shar and NeMo tarred
# shards deliver their audio so; ``shar`` is Shar's placeholder for them). lhotse would also run a ``command``
# source through a shell and fetch a ``url``: a cuts file from elsewhere must never do either.
ALLOWED_AUDIO_SOURCES = ("file", "memory", "shar")

# The custom field of a cut that stands for an entry that could not be used (a bad manifest line, a tar member that
# is missing, too large or corrupt): ``[reason, detail]``. Datasets count it as a skipped utterance.
UNUSABLE_FIELD = "speechtrain_unusable"

# Reasons already warned about in this process: a corrupt corpus should not flood the log.
_warned_reasons: set[str] = set()


class UnsafeAudioSourceError(ValueError):
    """A cut whose audio would be read by running a command or fetching a URL: refused, never read."""


def _recordings(cut: Any) -> Any:
    """(cut ID, recording) of every recording whose audio reading ``cut`` could trigger: its own, its tracks' (a
    mix), custom ones."""
    tracks = getattr(cut, "tracks", None)
    if tracks is not None:
        for track in tracks:
            yield from _recordings(track.cut)
        return
    if getattr(cut, "recording", None) is not None:
        yield cut.id, cut.recording
    from lhotse import Recording

    custom = (getattr(cut, "custom", None) or {}).values()
    yield from ((cut.id, value) for value in custom if isinstance(value, Recording))


def check_audio_sources(cut: Any) -> Any:
    """Return ``cut`` when all its audio comes from files or memory (:data:`ALLOWED_AUDIO_SOURCES`).

    Raises:
        UnsafeAudioSourceError: naming the cut and the source type (``command``, ``url``, ...), before any audio
            of it is read.
    """
    for owner, recording in _recordings(cut):
        for source in recording.sources:
            if source.type not in ALLOWED_AUDIO_SOURCES:
                which = repr(cut.id) if owner == cut.id else f"{cut.id!r} (its track {owner!r})"
                raise UnsafeAudioSourceError(
                    f"cut {which}: its audio source is of type {source.type!r} ({str(source.source)[:80]!r}); "
                    f"speechtrain reads audio only from {', '.join(ALLOWED_AUDIO_SOURCES)} sources and never runs "
                    "a command or fetches a URL named in a data file. Refused."
                )
    return cut


def unusable_cut(cut_id: str, reason: str, detail: str, duration: float = 0.0) -> Any:
    """A cut without audio that stands for an entry the reader could not use (``reason`` from
    :data:`UNUSABLE_ENTRY_REASONS`, ``detail`` naming the file and the problem): datasets count it like a bad
    file."""
    from lhotse.cut import MonoCut

    assert reason in UNUSABLE_ENTRY_REASONS, reason
    return MonoCut(id=cut_id, start=0.0, duration=duration, channel=0, custom={UNUSABLE_FIELD: [reason, detail]})


def unusable_reason(cut: Any) -> tuple[str, str] | None:
    """``(reason, detail)`` of a cut made by :func:`unusable_cut`, else None."""
    custom = getattr(cut, "custom", None) or {}
    value = custom.get(UNUSABLE_FIELD)
    return (str(value[0]), str(value[1])) if value else None


class TextEncoder(Protocol):
    """Anything that turns a transcript into token ids (e.g. :class:`speechtrain.common.tokenizers.CharTokenizer`)."""

    def encode(self, text: str) -> list[int]: ...


class SkipTally:
    """Counts of skipped utterances by reason, with the first culprit's path for each reason.

    Loader workers each count in their own process; batches carry their counts (``batch["skipped"]``,
    ``batch["skip_examples"]``), and the training process adds them up with :meth:`add_batch`.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def add(self, reason: str, path: str, count: int = 1) -> None:
        self.counts[reason] += count
        self.examples.setdefault(reason, path)

    def add_batch(self, batch: dict[str, Any] | None) -> None:
        """Add the skips a collated batch reports (no-op for batches without them)."""
        if not batch:
            return
        examples = batch.get("skip_examples", {})
        for reason, count in batch.get("skipped", {}).items():
            self.add(reason, examples.get(reason, "?"), count)

    def take_summary(self) -> str | None:
        """A line about the utterances skipped (and read in part) since the last call (None if there were none);
        counts restart."""
        if not self.counts:
            return None
        lines = []
        for title, partly in (("skipped", False), ("read in part", True)):
            counts = {r: c for r, c in sorted(self.counts.items()) if (r in PARTLY_READ_REASONS) == partly}
            if counts:
                parts = [f"{reason}={count} (e.g. {self.examples[reason]})" for reason, count in counts.items()]
                lines.append(f"{title} {sum(counts.values())} utterances: " + ", ".join(parts))
        self.counts.clear()
        self.examples.clear()
        return "; ".join(lines)


class UtteranceReader:
    """Reads and checks one utterance: audio (mono, at the expected rate) and its encoded transcript.

    Args:
        tokenizer: Encodes transcripts; must raise ``ValueError`` on text it cannot encode.
        sample_rate: Expected sample rate in Hz.
        resample: Resample audio stored at another rate (True, the default); False skips such files.
        duration_tolerance: Seconds by which a file read whole may exceed its manifest ``duration``; longer audio
            is read only up to the stated duration and counted (``longer_than_manifest``).

    Attributes:
        tally: Bad utterances by reason (see ``SKIP_REASONS``) with example paths.
        last_skip: ``(reason, path)`` of the latest skipped utterance.
        events: ``(reason, path)`` of every skip and partial read since the caller last cleared it (a dataset
            reports a batch's).
    """

    def __init__(
        self, tokenizer: TextEncoder, sample_rate: int, resample: bool = True, duration_tolerance: float = 1.0
    ) -> None:
        self.tokenizer = tokenizer
        self.sample_rate = sample_rate
        self.resample = resample
        self.duration_tolerance = duration_tolerance
        self.tally = SkipTally()
        self.last_skip: tuple[str, str] | None = None
        self.events: list[tuple[str, str]] = []

    @property
    def skipped(self) -> Counter[str]:
        return self.tally.counts

    @property
    def examples(self) -> dict[str, str]:
        return self.tally.examples

    def take_summary(self) -> str | None:
        """A line about the utterances skipped since the last call (None if there were none); counts restart."""
        return self.tally.take_summary()

    def read(self, record: dict[str, Any], load_audio: bool = True) -> dict[str, Any] | None:
        """Load the utterance of a manifest record (``audio_filepath``, ``offset``, ``duration``, ``text``; a ``text``
        of None reads the audio only).

        ``offset > 0`` (or ``segment: True``) reads ``duration`` seconds from ``offset``; otherwise the whole file,
        but no more than ``duration`` seconds when the file is longer than that by over ``duration_tolerance``.

        Returns:
            ``{"id": str, "audio": FloatTensor (T,), "tokens": LongTensor (U,), "text": str}`` (no ``audio`` when
            ``load_audio`` is False), or None if the utterance is bad (the reason is counted and warned about once
            per process).
        """
        path = record["audio_filepath"]
        item = {"id": _utterance_id(record), "text": record["text"]}
        if record["text"] is not None:  # None: audio only (e.g. a reference voice), no transcript to check
            item["tokens"] = self._encode(record["text"], path)
            if item["tokens"] is None:
                return None
        if not load_audio:
            return item
        if not os.path.isfile(path):
            return self.skip("missing_audio", path, "the audio file does not exist")
        try:
            with sf.SoundFile(path) as f:
                rate = f.samplerate
                if rate != self.sample_rate and not self.resample:
                    detail = f"sample rate {rate} Hz, expected {self.sample_rate} Hz"
                    return self.skip("wrong_sample_rate", path, detail)
                frames = -1
                if record["offset"] > 0 or record.get("segment"):
                    f.seek(min(round(record["offset"] * rate), f.frames))
                    frames = round(record["duration"] * rate)
                elif self._longer_than_stated(f.frames / rate, record.get("duration")):
                    frames = round(record["duration"] * rate)  # the manifest's duration bounds what is read
                    self.note("longer_than_manifest", path, f"the audio lasts {f.frames / rate:.1f} s, the manifest "
                              f"says {record['duration']:.1f} s; read up to the manifest's duration")  # fmt: skip
                if f.subtype == "PCM_16":  # 16-bit samples / 32768, as libsndfile scales them, but faster
                    audio = f.read(frames, dtype="int16", always_2d=True).astype(np.float32) * np.float32(1 / 32768)
                else:
                    audio = f.read(frames, dtype="float32", always_2d=True)
        except (RuntimeError, OSError, ValueError) as e:
            return self.skip("unreadable_audio", path, f"{type(e).__name__}: {e}")
        audio = self._check_audio(audio, rate, path)
        if audio is None:
            return None
        item["audio"] = audio
        return item

    def read_cut(self, cut: Any, load_audio: bool = True) -> dict[str, Any] | None:
        """Like :meth:`read` for a lhotse cut: file-backed cuts are read directly, others (Shar, in-memory) through
        lhotse. The item's ``id`` is the cut's ID.

        Raises:
            UnsafeAudioSourceError: the cut's audio would come from a command, a URL or any source but a file or
                memory (nothing is read).
        """
        check_audio_sources(cut)
        unusable = unusable_reason(cut)
        if unusable is not None:
            return self.skip(unusable[0], unusable[1], "the reader could not use this entry")
        text = " ".join(s.text or "" for s in cut.supervisions)
        source = cut.recording.sources[0] if cut.has_recording else None
        if source is not None and source.type == "file":
            record = {"audio_filepath": source.source, "offset": cut.start, "duration": cut.duration, "text": text,
                      "segment": cut.start > 0 or cut.duration < cut.recording.duration - 1e-3}  # fmt: skip
            item = self.read(record, load_audio)
            if item is not None:
                item["id"] = cut.id
            return item
        path = f"{cut.id} ({source.type if source is not None else 'no recording'})"
        tokens = self._encode(text, path)
        if tokens is None:
            return None
        item = {"id": cut.id, "tokens": tokens, "text": text}
        if not load_audio:
            return item
        if source is None:
            return self.skip("missing_audio", path, "the cut has no recording")
        try:
            audio = cut.load_audio()  # (C, T)
        except Exception as e:  # noqa: BLE001 - any decoder failure is a bad utterance, not a dead run
            return self.skip("unreadable_audio", path, f"{type(e).__name__}: {e}")
        audio = self._check_audio(np.asarray(audio, dtype=np.float32).T, cut.sampling_rate, path)
        if audio is None:
            return None
        item["audio"] = audio
        return item

    def _longer_than_stated(self, seconds: float, duration: float | None) -> bool:
        return duration is not None and seconds > duration + self.duration_tolerance

    def _encode(self, text: str, path: str) -> torch.Tensor | None:
        if not text.strip():
            return self.skip("empty_text", path, "the transcript is empty")
        try:
            return torch.tensor(self.tokenizer.encode(text), dtype=torch.long)
        except ValueError as e:
            return self.skip("unencodable_text", path, str(e))

    def _check_audio(self, audio: np.ndarray, rate: int, path: str) -> torch.Tensor | None:
        """(T, C) samples -> mono (T,) tensor at ``sample_rate``, or None (skipped) if empty or not finite."""
        if audio.shape[0] == 0:
            return self.skip("empty_audio", path, "the audio has no samples")
        audio = audio[:, 0] if audio.shape[1] == 1 else audio.mean(axis=1)
        if not np.isfinite(audio).all():
            return self.skip("non_finite_audio", path, "the audio holds NaN or infinite samples")
        waveform = torch.from_numpy(np.ascontiguousarray(audio))
        if rate != self.sample_rate:
            from speechtrain.data.augment import resample

            waveform = resample(waveform, rate, self.sample_rate)
        return waveform

    def skip(self, reason: str, path: str, detail: str) -> None:
        """Count a bad utterance (warning once per reason per process); returns None for ``return self.skip(...)``."""
        self.last_skip = (reason, path)
        self.note(reason, path, detail)

    def note(self, reason: str, path: str, detail: str) -> None:
        """Count an utterance by ``reason`` (a skip, or a partial read: :data:`PARTLY_READ_REASONS`), warning once
        per reason per process."""
        self.tally.add(reason, path)
        self.events.append((reason, path))
        if reason not in _warned_reasons:
            _warned_reasons.add(reason)
            what = "reading part of" if reason in PARTLY_READ_REASONS else "skipping"
            logger.warning("%s utterance %s (%s: %s); further '%s' cases are counted and summarised", what, path,
                           reason, detail, reason)  # fmt: skip


class AudioTextDataset(Dataset):
    """Utterances of a NeMo manifest as waveforms and token ids.

    Audio is read with ``soundfile``, averaged to mono and resampled to ``sample_rate`` when stored at another rate
    (``resample=False`` skips such files instead).
    A record with ``offset > 0`` reads ``duration`` seconds from ``offset``; otherwise the whole file is read.

    Args:
        manifest_filepath: NeMo JSON-lines manifest (see :func:`speechtrain.data.manifest.read_nemo_manifest`).
        tokenizer: Encodes transcripts; must raise ``ValueError`` on text it cannot encode.
        sample_rate: Expected sample rate in Hz.
        max_duration: Drop records longer than this many seconds (None: no limit).
        min_duration: Drop records shorter than this many seconds (None: no limit).
        resample: Resample files stored at another rate (default); False skips them as ``wrong_sample_rate``.

    Attributes:
        records: The kept manifest records.
        filtered: Counts of records dropped by duration at construction, keys ``too_short`` / ``too_long``.
        skipped: Counts of utterances returned as None by ``__getitem__`` in this process, by reason
            (see ``SKIP_REASONS``). DataLoader workers count in their own copies.

    Raises:
        FileNotFoundError, speechtrain.data.manifest.ManifestError: On a missing or invalid manifest.
        ValueError: On a non-positive sample rate or inconsistent duration limits.
    """

    def __init__(
        self,
        manifest_filepath: str | os.PathLike,
        tokenizer: TextEncoder,
        sample_rate: int = 16000,
        max_duration: float | None = None,
        min_duration: float | None = None,
        resample: bool = True,
    ) -> None:
        if sample_rate <= 0:
            raise ValueError(f"AudioTextDataset: sample_rate must be > 0, got {sample_rate}")
        if min_duration is not None and max_duration is not None and min_duration > max_duration:
            raise ValueError(
                f"AudioTextDataset: min_duration={min_duration} is larger than max_duration={max_duration}"
            )
        self.manifest_filepath = Path(manifest_filepath)
        self.reader = UtteranceReader(tokenizer, sample_rate, resample)
        self.filtered: Counter[str] = Counter()
        self.records: list[dict[str, Any]] = []
        for record in read_nemo_manifest(self.manifest_filepath):
            if min_duration is not None and record["duration"] < min_duration:
                self.filtered["too_short"] += 1
            elif max_duration is not None and record["duration"] > max_duration:
                self.filtered["too_long"] += 1
            else:
                self.records.append(record)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def durations(self) -> list[float]:
        """Manifest durations of the kept records in seconds, in index order (for bucketing samplers)."""
        return [record["duration"] for record in self.records]

    @property
    def skipped(self) -> Counter[str]:
        """Utterances returned as None in this process, by reason (see ``SKIP_REASONS``)."""
        return self.reader.skipped

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        """Load one utterance.

        Returns:
            ``{"id": str, "audio": FloatTensor (T,), "tokens": LongTensor (U,)}``, or None if the utterance
            is bad (the reason is counted in ``skipped`` and warned about once per process).
        """
        return self.reader.read(self.records[index])

    def summary(self) -> str:
        """One line: kept utterances and hours, records filtered by duration, utterances skipped by reason."""
        hours = sum(self.durations) / 3600.0
        parts = [f"{self.manifest_filepath}: {len(self.records)} utterances ({hours:.2f} h)"]
        parts.append(f"filtered by duration {sum(self.filtered.values())}{_counts(self.filtered)}")
        parts.append(f"skipped {sum(self.skipped.values())}{_counts(self.skipped)}")
        return "; ".join(parts)


def _counts(counter: Counter[str]) -> str:
    if not counter:
        return ""
    return " (" + ", ".join(f"{key}={value}" for key, value in sorted(counter.items())) + ")"


def _utterance_id(record: dict[str, Any]) -> str:
    stem = Path(record["audio_filepath"]).stem
    return stem if record["offset"] == 0 else f"{stem}@{record['offset']:.3f}"


def collate_audio_text(items: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Pad a list of :class:`AudioTextDataset` items into a batch, dropping the None (bad) ones.

    Args:
        items: Items of shapes audio (T_i,), tokens (U_i,), or None.

    Returns:
        None if every item was None, else a dict with ``ids`` (list of B str), ``audio`` FloatTensor
        (B, T_max) zero-padded, ``audio_lens`` LongTensor (B,), ``tokens`` LongTensor (B, U_max) padded with
        0, ``token_lens`` LongTensor (B,).
    """
    items = [item for item in items if item is not None]
    if not items:
        return None
    audio_lens = torch.tensor([item["audio"].shape[0] for item in items], dtype=torch.long)
    token_lens = torch.tensor([item["tokens"].shape[0] for item in items], dtype=torch.long)
    audio = torch.zeros(len(items), int(audio_lens.max()), dtype=torch.float32)
    tokens = torch.zeros(len(items), int(token_lens.max()), dtype=torch.long)
    for row, item in enumerate(items):
        audio[row, : audio_lens[row]] = item["audio"]
        tokens[row, : token_lens[row]] = item["tokens"]
    return {
        "ids": [item["id"] for item in items],
        "audio": audio,
        "audio_lens": audio_lens,
        "tokens": tokens,
        "token_lens": token_lens,
    }
