"""The batch convention shared by the datasets (which produce batches) and the models (which step on them): an
empty batch, and the error when a whole epoch or validation set had no usable utterance."""

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def is_empty_batch(batch: Any) -> bool:
    """True for a batch with no usable utterance (every one was skipped): None, or a mapping whose ``ids`` are
    empty (a batch without ``ids``, e.g. of token tensors, is never empty)."""
    return batch is None or (isinstance(batch, Mapping) and "ids" in batch and not batch["ids"])


class NoUsableDataError(ValueError):
    """A training epoch or a validation set without a single usable utterance."""


def _manifests(manifests: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    return [Path(manifests)] if isinstance(manifests, str | os.PathLike) else [Path(m) for m in manifests]


def resolution_note(manifests: str | os.PathLike | Sequence[str | os.PathLike]) -> str:
    """Where relative audio paths of ``manifests`` point: ``relative audio_filepath values are resolved against
    the manifest's folder <folder>`` ("" for names such as ``builtin:...``)."""
    paths = [m for m in _manifests(manifests) if not str(m).startswith("builtin:")]
    folders = sorted({str(m.expanduser().resolve().parent) for m in paths})
    return (
        f"relative audio_filepath values are resolved against the manifest's folder {', '.join(folders)}"
        if folders
        else ""
    )


def no_usable_data_message(
    what: str, key: str, manifests: str | Sequence[str], skipped: Mapping[str, int], examples: Mapping[str, str]
) -> str:
    """The error for ``what`` (e.g. ``epoch 0``) that yielded no usable utterance of ``key=manifests``: the skip
    reasons with an example path each, and where relative paths were resolved."""
    shown = manifests if isinstance(manifests, str) else ",".join(map(str, manifests))
    if skipped:
        reasons = ", ".join(f"{r}={n} (e.g. {examples.get(r, '?')})" for r, n in sorted(skipped.items()))
        detail = f"all {sum(skipped.values())} utterances were skipped: {reasons}"
    else:
        detail = "it yielded no utterance (too short or long for min_duration / max_duration, or empty?)"
    note = resolution_note(manifests) if skipped else ""
    return f"No usable utterance in {what} of {key}={shown}: {detail}{'; ' + note if note else ''}."
