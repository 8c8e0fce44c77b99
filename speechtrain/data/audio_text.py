"""Map-style dataset of (audio, transcript tokens) pairs read from a NeMo manifest, and its collator.

Bad utterances (missing or unreadable audio, empty or non-finite audio, wrong sample rate, empty or
untokenizable transcript) do not stop training: ``__getitem__`` returns None, counts the reason in
``skipped`` and logs one warning per reason per process; :func:`collate_audio_text` drops them.
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

# Reasons already warned about in this process: a corrupt corpus should not flood the log.
_warned_reasons: set[str] = set()


class TextEncoder(Protocol):
    """Anything that turns a transcript into token ids (e.g. :class:`speechtrain.asr.tokenizers.CharTokenizer`)."""

    def encode(self, text: str) -> list[int]: ...


class UtteranceReader:
    """Reads and checks one utterance: audio from its file (mono, at the expected rate) and encoded transcript.

    Args:
        tokenizer: Encodes transcripts; must raise ``ValueError`` on text it cannot encode.
        sample_rate: Expected sample rate in Hz (files at another rate are skipped).

    Attributes:
        skipped: Counts of bad utterances by reason (see ``SKIP_REASONS``).
        examples: The first culprit's path for each reason.
    """

    def __init__(self, tokenizer: TextEncoder, sample_rate: int) -> None:
        self.tokenizer = tokenizer
        self.sample_rate = sample_rate
        self.skipped: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def take_summary(self) -> str | None:
        """A line about the utterances skipped since the last call (None if there were none); counts restart."""
        if not self.skipped:
            return None
        parts = [f"{reason}={count} (e.g. {self.examples[reason]})" for reason, count in sorted(self.skipped.items())]
        line = f"skipped {sum(self.skipped.values())} utterances: " + ", ".join(parts)
        self.skipped.clear()
        self.examples.clear()
        return line

    def read(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """Load the utterance of a manifest record (``audio_filepath``, ``offset``, ``duration``, ``text``).

        Returns:
            ``{"id": str, "audio": FloatTensor (T,), "tokens": LongTensor (U,)}``, or None if the utterance
            is bad (the reason is counted in ``skipped`` and warned about once per process).
        """
        path = record["audio_filepath"]
        text = record["text"]
        if not text.strip():
            return self._skip("empty_text", path, "the transcript is empty")
        try:
            tokens = self.tokenizer.encode(text)
        except ValueError as e:
            return self._skip("unencodable_text", path, str(e))
        if not os.path.isfile(path):
            return self._skip("missing_audio", path, "the audio file does not exist")
        try:
            with sf.SoundFile(path) as f:
                if f.samplerate != self.sample_rate:
                    return self._skip(
                        "wrong_sample_rate", path, f"sample rate {f.samplerate} Hz, expected {self.sample_rate} Hz"
                    )
                frames = -1
                if record["offset"] > 0:
                    f.seek(min(round(record["offset"] * f.samplerate), f.frames))
                    frames = round(record["duration"] * f.samplerate)
                audio = f.read(frames, dtype="float32", always_2d=True)
        except (RuntimeError, OSError, ValueError) as e:
            return self._skip("unreadable_audio", path, f"{type(e).__name__}: {e}")
        if audio.shape[0] == 0:
            return self._skip("empty_audio", path, "the audio has no samples")
        audio = audio.mean(axis=1)  # (T, C) -> (T,)
        if not np.isfinite(audio).all():
            return self._skip("non_finite_audio", path, "the audio holds NaN or infinite samples")
        return {
            "id": _utterance_id(record),
            "audio": torch.from_numpy(audio),
            "tokens": torch.tensor(tokens, dtype=torch.long),
        }

    def _skip(self, reason: str, path: str, detail: str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, path)
        if reason not in _warned_reasons:
            _warned_reasons.add(reason)
            logger.warning(
                "skipping utterance %s (%s: %s); further '%s' skips are counted silently, see summary()",
                path,
                reason,
                detail,
                reason,
            )
        return None


class AudioTextDataset(Dataset):
    """Utterances of a NeMo manifest as waveforms and token ids.

    Audio is read with ``soundfile``, averaged to mono and never resampled: a file at another rate is skipped.
    A record with ``offset > 0`` reads ``duration`` seconds from ``offset``; otherwise the whole file is read.

    Args:
        manifest_filepath: NeMo JSON-lines manifest (see :func:`speechtrain.data.manifest.read_nemo_manifest`).
        tokenizer: Encodes transcripts; must raise ``ValueError`` on text it cannot encode.
        sample_rate: Expected sample rate in Hz.
        max_duration: Drop records longer than this many seconds (None: no limit).
        min_duration: Drop records shorter than this many seconds (None: no limit).

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
    ) -> None:
        if sample_rate <= 0:
            raise ValueError(f"AudioTextDataset: sample_rate must be > 0, got {sample_rate}")
        if min_duration is not None and max_duration is not None and min_duration > max_duration:
            raise ValueError(
                f"AudioTextDataset: min_duration={min_duration} is larger than max_duration={max_duration}"
            )
        self.manifest_filepath = Path(manifest_filepath)
        self.reader = UtteranceReader(tokenizer, sample_rate)
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
