"""Seeded weight initialisation: every model family draws its initial weights from its own streams."""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Draw initial weights from a fresh CPU stream seeded with ``seed``, leaving the global stream untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
