"""NeMo-style JSON-lines manifests: one utterance per line, ``{"audio_filepath", "duration", "text", ...}``."""

import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

# A real manifest line is a few hundred bytes; a longer one is a corrupt or hostile file.
MAX_LINE_BYTES = 1_000_000
REQUIRED_KEYS = ("audio_filepath", "duration", "text")
# Bad lines a lazily read manifest may hold before it is taken for something else than a manifest (per pass).
logger = logging.getLogger(__name__)
DEFAULT_SKIP_BAD_LINES = 10


class ManifestError(ValueError):
    """A manifest line that cannot be used; the message names the file, the 1-based line and the problem."""


def _non_negative_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _parse_record(line: bytes, where: str, folder: Path) -> dict[str, Any] | None:
    """Validate one manifest line; None for a blank line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{where}: not valid UTF-8 ({e})") from None
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{where}: invalid JSON: {e}") from None
    if not isinstance(record, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in REQUIRED_KEYS:
        if key not in record:
            raise ManifestError(f"{where}: missing required key {key!r} (a record needs {', '.join(REQUIRED_KEYS)})")
    audio = record["audio_filepath"]
    if not isinstance(audio, str) or not audio:
        raise ManifestError(f"{where}: 'audio_filepath' must be a non-empty string, got {audio!r}")
    if not _non_negative_number(record["duration"]):
        raise ManifestError(f"{where}: 'duration' must be a finite number >= 0, got {record['duration']!r}")
    if not isinstance(record["text"], str):
        raise ManifestError(f"{where}: 'text' must be a string, got {record['text']!r}")
    offset = record.get("offset", 0.0)
    if not _non_negative_number(offset):
        raise ManifestError(f"{where}: 'offset' must be a finite number >= 0, got {offset!r}")
    record["audio_filepath"] = audio if os.path.isabs(audio) else str(folder / audio)
    record["duration"] = float(record["duration"])
    record["offset"] = float(offset)
    return record


def read_nemo_manifest(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read and validate a whole NeMo JSON-lines manifest into memory (see :func:`iter_nemo_manifest`; the
    training loaders read manifests lazily, line by line)."""
    return list(iter_nemo_manifest(path))


def iter_nemo_manifest(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Read and validate a NeMo JSON-lines manifest one line at a time (memory does not grow with its length).

    Every non-blank line must be a JSON object with ``audio_filepath`` (str), ``duration`` (seconds, a finite
    number >= 0) and ``text`` (str, may be empty). ``offset`` (seconds) is optional. Other keys are kept.

    Args:
        path: Manifest file.

    Yields:
        One dict per utterance, in file order, with ``audio_filepath`` resolved against the manifest's folder
        when relative, ``duration`` and ``offset`` (default 0.0) as floats.

    Raises:
        FileNotFoundError: If the manifest does not exist.
        ManifestError: On the first bad line (longer than 1 MB, not UTF-8, not JSON, missing or invalid key),
            naming the file and the 1-based line number.
    """
    yield from iter_manifest_entries(path, skip_bad_lines=0)  # (with no bad line allowed, only records)


class BadLine(NamedTuple):
    """A manifest line that :func:`iter_manifest_entries` skipped; ``problem`` names the file and line."""

    line_number: int
    problem: str


def iter_manifest_entries(path: str | os.PathLike, skip_bad_lines: int) -> Iterator[dict[str, Any] | BadLine]:
    """Like :func:`iter_nemo_manifest`, but up to ``skip_bad_lines`` bad lines (not UTF-8, not JSON, longer than
    1 MB, missing or invalid keys) are yielded as :class:`BadLine` in their place instead of stopping the read.

    Raises:
        FileNotFoundError: If the manifest does not exist.
        ManifestError: On bad line number ``skip_bad_lines + 1``, naming the file, the line and the limit.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"manifest not found: {path}")
    folder = path.parent
    bad = 0
    with open(path, "rb") as f:
        line_number = 0
        while line := f.readline(MAX_LINE_BYTES + 2):
            line_number += 1
            where = f"{path}:{line_number}"
            try:
                if len(line.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                    while line and not line.endswith(b"\n"):  # the rest of the long line, in bounded pieces
                        line = f.readline(MAX_LINE_BYTES + 2)
                    raise ManifestError(f"{where}: line longer than {MAX_LINE_BYTES} bytes; is this a manifest?")
                if line_number == 1 and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]
                record = _parse_record(line, where, folder)
            except ManifestError as error:
                bad += 1
                if bad > skip_bad_lines:
                    if skip_bad_lines == 0:
                        raise
                    raise ManifestError(f"{error}; that is {bad} bad lines in {path}, more than skip_bad_lines="
                                        f"{skip_bad_lines}: is this a manifest?") from None  # fmt: skip
                yield BadLine(line_number, str(error))
                continue
            if record is not None:
                yield record


def scan_manifest(path: str | os.PathLike, skip_bad_lines: int) -> tuple[int, list[BadLine]]:
    """Read a whole manifest once, before a run uses it (a loader's ``scan_manifests: true``): its good entries and
    bad lines, logged in one line naming the first bad line. A manifest with more than ``skip_bad_lines`` bad lines
    fails here, at start, rather than hours into the run.

    Raises:
        FileNotFoundError, ManifestError: as :func:`iter_manifest_entries`.
    """
    good, bad = 0, []
    for entry in iter_manifest_entries(path, skip_bad_lines):
        if isinstance(entry, BadLine):
            bad.append(entry)
        else:
            good += 1
    if bad:
        logger.warning("Scanned %s: %d entries, %d bad lines (skipped and counted when read; first: %s).", path,
                       good, len(bad), bad[0].problem)  # fmt: skip
    else:
        logger.info("Scanned %s: %d entries, no bad lines.", path, good)
    return good, bad
