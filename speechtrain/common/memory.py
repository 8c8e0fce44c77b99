"""Host memory: keep the blocks a training step frees in the process, for the next step to reuse.

glibc's ``malloc`` serves every block above its mmap threshold (dynamic, at most 32 MiB) with a fresh ``mmap`` and
unmaps it when it is freed, and gives freed memory at the top of its heap back to the OS. A training step on the
CPU allocates and frees the same large activations every step, so it pays a page fault (and the kernel's zeroing)
for every 4 KiB of them, every step: measured on the FastConformer step of ``benchmarks/vs_nemo.py`` (90 MB
subsampling activations), 11% of the step; a matrix product into a fresh 90 MB output took 41 ms instead of 10 ms
into a reused one. Raising both thresholds keeps such blocks in the heap: the host counterpart of CUDA's caching
allocator, with the same cost (resident memory stays at the run's high-water mark).

:class:`speechtrain.lightning.Trainer` applies it when it is built (in every rank, before data workers fork);
``SPEECHTRAIN_KEEP_FREED_MEMORY=0`` turns it off. Written here because neither torch (its CPU caching allocator is
for mobile builds) nor the pinned packages offer it; jemalloc or tcmalloc through ``LD_PRELOAD`` do the same job
where installed.
"""

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep freed blocks of up to 1 GiB for reuse; True when applied (glibc on Linux and
    not turned off by ``SPEECHTRAIN_KEEP_FREED_MEMORY=0``). Idempotent; affects the whole process."""
    if not sys.platform.startswith("linux") or os.environ.get("SPEECHTRAIN_KEEP_FREED_MEMORY", "1") == "0":
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # another C library (musl): its allocator has no such knobs
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))
