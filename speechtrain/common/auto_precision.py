"""``trainer.precision=auto``: bf16 autocast where this machine computes it faster than fp32, else fp32.

On a GPU that supports bf16 the answer is always ``bf16-mixed``. On a CPU it depends on the CPU, and no flag that can
be read tells: on some CPUs with bf16 instructions a bf16 matrix product of the demo encoder's feed-forward shape is
slower than fp32 and so is the demo's step; on others it is several times as fast and the demo trains more audio per
second (the rest of its step, the transducer loss among it, stays fp32; ``benchmarks/cpu_bf16.py`` times it). So
``auto`` times that product in both dtypes when the run starts (well under a second) and takes ``bf16-mixed`` when
bf16 is at least :data:`MIN_SPEEDUP` times as fast.
Features, losses and the optimizer stay fp32 under ``bf16-mixed`` (:mod:`speechtrain.lightning.precision`).

Every data-parallel rank must train in the same precision. The process that resolves ``auto`` first writes its
answer to ``SPEECHTRAIN_AUTO_PRECISION``; the ranks Lightning starts inherit the environment and read it instead
of measuring. Ranks started by another launcher (``WORLD_SIZE`` > 1 with no answer in the environment) cannot
agree on a timing, so on a CPU they train in fp32 and say so; setting ``SPEECHTRAIN_AUTO_PRECISION`` (or
``trainer.precision``) for the launcher chooses for all of them.
"""

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

ENV = "SPEECHTRAIN_AUTO_PRECISION"
CHOICES = ("32-true", "bf16-mixed")
MIN_SPEEDUP = 1.5  # bf16 autocast also casts every weight and activation it multiplies: it must win clearly
_SHAPE = (3000, 144, 576)


def _uses_cuda(accelerator: object) -> bool:
    name = str(accelerator if accelerator is not None else "auto").lower()
    if name in ("gpu", "cuda"):
        return True
    return name == "auto" and torch.cuda.is_available()


def _operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rows, inner, cols = _SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=generator, device="cpu").to(dtype)
    b = torch.randn(inner, cols, generator=generator, device="cpu").to(dtype)
    a @ b  # warm-up: the first product may pick kernels
    return a, b


def _seconds(a: torch.Tensor, b: torch.Tensor, products: int) -> float:
    start = time.perf_counter()
    for _ in range(products):
        a @ b
    return time.perf_counter() - start


def _gflops(seconds: float, products: int) -> float:
    rows, inner, cols = _SHAPE
    return 2 * rows * inner * cols * products / seconds / 1e9


def product_gflops(dtype: torch.dtype, repeats: int = 5, products: int = 4) -> float:
    """GFLOP/s of the demo-shaped matrix product in ``dtype`` on the CPU, this process's threads (best of ``repeats``
    timings of ``products`` products). The CPU on purpose: only a CPU run asks (a GPU's answer needs no timing)."""
    a, b = _operands(dtype)
    return _gflops(min(_seconds(a, b, products) for _ in range(repeats)), products)


def bf16_speedup(repeats: int = 12, products: int = 4) -> float:
    """fp32 time / bf16 time of the demo-shaped matrix product on this CPU: the best of ``repeats`` timings of
    ``products`` products in each dtype, the two dtypes taking turns. Taking turns matters: another process that
    wakes up for a moment then slows both dtypes' timings alike, where one timing per dtype, the first after the
    other, can read far below the true ratio (and a demo then trains in fp32, with fewer steps)."""
    fp32, bf16 = _operands(torch.float32), _operands(torch.bfloat16)
    best_fp32 = best_bf16 = float("inf")
    for _ in range(repeats):
        best_fp32 = min(best_fp32, _seconds(*fp32, products))
        best_bf16 = min(best_bf16, _seconds(*bf16, products))
    return best_fp32 / best_bf16


def resolve_auto_precision(accelerator: object = "auto") -> str:
    """The precision ``auto`` means for a run on ``accelerator`` (module docstring), recorded in the environment for
    the data-parallel ranks this process starts."""
    if _uses_cuda(accelerator):
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32-true"
    chosen = os.environ.get(ENV)
    if chosen is not None:
        if chosen not in CHOICES:
            raise ValueError(f"{ENV}={chosen!r}: choose one of {', '.join(CHOICES)} (or unset it to measure).")
        return chosen
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logger.warning(
            "trainer.precision=auto: ranks started by an outside launcher cannot agree on a timing; training in fp32. "
            "Set %s=bf16-mixed (or trainer.precision) to choose for every rank.",
            ENV,
        )
        return "32-true"
    speedup = bf16_speedup()
    chosen = "bf16-mixed" if speedup >= MIN_SPEEDUP else "32-true"
    logger.info(
        "trainer.precision=auto: %s (a bf16 matrix product runs %.2fx as fast as fp32 on this CPU; bf16 needs %.1fx)",
        chosen, speedup, MIN_SPEEDUP,
    )  # fmt: skip
    os.environ[ENV] = chosen
    return chosen
