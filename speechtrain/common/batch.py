"""The batch convention shared by the datasets (which produce batches) and the models (which step on them)."""

from typing import Any


def is_empty_batch(batch: dict[str, Any] | None) -> bool:
    """True for a batch with no usable utterance (every one was skipped): None, or ``ids`` empty."""
    return batch is None or not batch.get("ids")
