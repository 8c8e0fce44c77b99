import ctypes
import os
import subprocess
import sys

import pytest
import torch

from speechtrain import backends
from speechtrain.backends import cpu
from speechtrain.backends.cpu import keep_freed_memory

GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")

# Allocates a 64 MiB tensor and reports how many bytes glibc holds in mmapped blocks (mallinfo2's hblkhd) meanwhile.
PROBE = """
import ctypes, sys
import torch
from speechtrain import backends
from speechtrain.backends import cpu
from speechtrain.backends.cpu import keep_freed_memory

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


# Builds a Trainer (which applies the mode), then multiplies denormals on two intra-op threads; prints the nonzero
# results and what the products of a confident model's log-space backward (exp(-90)) become.
DENORMAL_PROBE = """
import torch
torch.set_num_threads(2)
from speechtrain.lightning import Trainer
Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
x = torch.full((1 << 20,), 1.0e-39)
print(int((x * 1.0 != 0).sum()), float(torch.tensor(-90.0).exp()))
"""


def _denormal_probe(**env: str) -> tuple[int, float]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **env}
    out = subprocess.run([sys.executable, "-c", DENORMAL_PROBE], env=env, capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    return int(out[0]), float(out[1])


@pytest.mark.slow
def test_the_trainer_flushes_denormals_on_every_thread_and_not_when_turned_off():
    nonzero, tiny = _denormal_probe()
    assert nonzero == 0 and tiny == 0.0  # both intra-op threads flush (they start after the Trainer)
    nonzero, tiny = _denormal_probe(SPEECHTRAIN_FLUSH_DENORMALS="0")
    assert nonzero == 1 << 20 and 0.0 < tiny < 1.2e-38  # the CPU's default: IEEE denormals


@pytest.mark.parametrize("bias, frozen", [(True, False), (False, False), (True, True)])
def test_cpu_convolution_with_contiguous_weight_gradient_equals_conv2d(bias, frozen):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(6, 6, 3, stride=2, padding=1, bias=bias).requires_grad_(not frozen)
    x = torch.randn(2, 6, 11, 8).contiguous(memory_format=torch.channels_last).requires_grad_()
    grad = torch.randn(2, 6, 6, 4)
    results = []
    for run in (cpu.conv2d, lambda c, t: c(t)):
        out = run(conv, x)
        inputs = [x] + ([] if frozen else [p for p in conv.parameters()])
        results.append([out, *torch.autograd.grad(out, inputs, grad)])
    for fast, plain in zip(*results, strict=True):
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_a_strided_depthwise_convolution_under_bf16_autocast_equals_fp32():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 4, 9, 1), torch.randn(4, 1, 3, 1), torch.randn(4)
    reference = torch.nn.functional.conv2d(x, weight, bias, stride=(2, 1), padding=(1, 0), groups=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = backends.depthwise_conv2d(x, weight, bias, (2, 1), (1, 0))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference)


def test_only_a_cpu_run_gets_the_cpu_process_settings(monkeypatch):
    monkeypatch.setenv("SPEECHTRAIN_KEEP_FREED_MEMORY", "0")
    monkeypatch.setenv("SPEECHTRAIN_FLUSH_DENORMALS", "0")
    assert backends.configure_process("cuda") == [] and backends.configure_process("cpu") == []
    calls = []
    monkeypatch.setattr(cpu, "keep_freed_memory", lambda: calls.append("memory") or True)
    monkeypatch.setattr(cpu, "flush_denormals", lambda: calls.append("denormals") or True)
    assert backends.configure_process("cuda") == [] and calls == []
    assert backends.configure_process("cpu") == ["keep_freed_memory", "flush_denormals"]
    assert backends.device_type_of("cpu") == "cpu" and backends.device_type_of("gpu") in ("cuda", "cpu")
