"""Seeded weight initialisation: every model family draws its initial weights from its own streams."""

import contextlib
from collections.abc import Iterator

import torch


def _building_on_meta() -> bool:
    """Whether the caller's device context is the meta device (shapes only, nothing drawn)."""
    try:
        return torch.get_default_device().type == "meta"
    except Exception:  # an accelerator context on a machine without one (it makes a tensor to read the index)
        return False


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Build layers on the CPU and draw their initial weights from a fresh CPU stream seeded with ``seed``, leaving
    every global stream (CPU and CUDA) untouched.

    The layers are made on the CPU whatever accelerator the caller's device context names: Lightning builds
    ``configure_model`` under the GPU's context, where ``torch.nn.Linear(...)`` would draw from the GPU's generator
    (other numbers than the CPU's for the same seed) and ``torch.manual_seed`` would re-seed the GPU's global stream
    (dropout, SpecAugment). Here the same seed gives the same weights on a laptop's CPU and on any GPU, and the
    strategy moves the model to its device afterwards. Under the meta device (shapes only) layers stay there.
    An existing (GPU) tensor is initialised inside by copying in values drawn on the CPU, not in place.
    """
    device = torch.device("meta" if _building_on_meta() else "cpu")
    with torch.random.fork_rng(devices=[]), device:
        torch.random.default_generator.manual_seed(seed)
        yield
