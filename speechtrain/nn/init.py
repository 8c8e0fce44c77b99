"""Seeded weight initialisation: every model family draws its initial weights from its own streams."""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Build layers on the CPU and draw their initial weights from a fresh CPU stream seeded with ``seed``, leaving
    every global stream (CPU and CUDA) untouched.

    The layers are made on the CPU whatever device the caller's context names: Lightning builds ``configure_model``
    under the GPU's device context, where ``torch.nn.Linear(...)`` would draw from the GPU's generator (other
    numbers than the CPU's for the same seed) and ``torch.manual_seed`` would re-seed the GPU's global stream (the
    dropout and SpecAugment draws). Here the same seed gives the same weights on a laptop's CPU and on any GPU, and
    the strategy moves the model to its device afterwards. Initialise an existing (GPU) tensor inside from values
    drawn on the CPU (``tensor.copy_(torch.randn(..., device="cpu"))``), not in place.
    """
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.random.default_generator.manual_seed(seed)
        yield
