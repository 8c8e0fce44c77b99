import ctypes
import os
import subprocess
import sys

import pytest

from speechtrain.common.memory import keep_freed_memory

GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")

# Allocates a 64 MiB tensor and reports how many bytes glibc holds in mmapped blocks (mallinfo2's hblkhd) meanwhile.
PROBE = """
import ctypes, sys
import torch
from speechtrain.common.memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
print(keep_freed_memory())
block = torch.empty(16 * 2**20)  # 64 MiB: above glibc's largest default mmap threshold (32 MiB)
print(libc.mallinfo2().hblkhd)
"""


def _probe(**env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_large_blocks_come_from_the_reusable_heap_once_applied_and_not_when_turned_off():
    applied, mmapped = _probe()
    assert applied == "True" and mmapped < 2**26  # the 64 MiB block is in the heap, not its own mapping
    applied, mmapped = _probe(SPEECHTRAIN_KEEP_FREED_MEMORY="0")
    assert applied == "False" and mmapped >= 2**26  # glibc's default: a mapping of its own, unmapped when freed


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPEECHTRAIN_KEEP_FREED_MEMORY", "0")
    assert keep_freed_memory() is False
