"""Stop at start a run whose manifest names no existing audio file (e.g. a manifest copied elsewhere with ``head``
keeps relative paths that no longer point at its audio). Epochs and validation sets in which every utterance was
skipped are stopped by the models (:mod:`speechtrain.common.batch`)."""

import json
import os
from pathlib import Path

from speechtrain.common.batch import NoUsableDataError, resolution_note


def check_audio_exists(key: str, manifest: str | os.PathLike, shown: str | None = None) -> None:
    """Raise :class:`NoUsableDataError` when not one ``audio_filepath`` of the NeMo manifest ``manifest`` names an
    existing file (stops at the first one that does: cheap for a good manifest).

    Args:
        key: the config key that named the manifest (``model.train_ds.manifest_filepath``).
        manifest: the manifest file.
        shown: how the user wrote it (e.g. a ``builtin:`` name); default the path.
    """
    path = Path(manifest)
    if path.suffix.lower() not in (".json", ".jsonl") or not path.is_file():
        return
    count, first = 0, None
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                return  # a malformed line is the manifest reader's to report, with its line number
            audio = row.get("audio_filepath") if isinstance(row, dict) else None
            if not isinstance(audio, str) or not audio:
                continue
            resolved = audio if os.path.isabs(audio) else str(path.parent / audio)
            if os.path.exists(resolved):
                return
            count += 1
            first = first or (audio, resolved)
    if first is None:
        return
    audio, resolved = first
    where = f" ('{audio}' is relative: {resolution_note(path)})" if not os.path.isabs(audio) else ""
    raise NoUsableDataError(
        f"{key}={shown or manifest}: no usable utterance, none of its {count} audio files exists (e.g. {resolved}"
        f"{where}). Fix the audio_filepath values (absolute paths, or the manifest beside its audio)."
    )
