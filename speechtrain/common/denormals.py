"""Host floating point: flush denormal (subnormal) fp32 values to zero on the CPU.

x86 CPUs compute with denormal operands (magnitudes below 1.2e-38) in microcode, tens of times slower than with
normal ones. A transducer loss runs its lattice recursion in log space; once a model is confident, many cells hold
log-probabilities around -90 whose ``exp`` in the backward pass of ``logsumexp`` is denormal. Measured on the TDT
demo (``asr_train_tdt.yaml``, 2 DP processes, 60 steps from its own 17-minute archive): 66.6 audio-s/s without,
105.3 with (+58%); an untrained model ran at ~97, so without the flush the run slowed down as it learned. The CTC
demo is unaffected (159.5 vs 153.0 in the same test: noise). GPUs already run fp32 at full speed on denormals.

The mode is per thread, and threads copy it from the thread that creates them. :class:`speechtrain.lightning.Trainer`
applies it when it is built: in the scripts under ``examples/`` that is before the model, so before torch starts its
intra-op threads (every data-parallel process runs the script from the top; a test checks two threads).
``SPEECHTRAIN_FLUSH_DENORMALS=0`` turns it off. Written here because torch leaves the CPU's default (IEEE
denormals) in place and exposes the switch only as :func:`torch.set_flush_denormal`.
"""

import os

import torch


def flush_denormals() -> bool:
    """Treat denormal fp32/fp64 inputs and results as zero on this thread (and the threads it creates from now on);
    True when applied (a CPU with the SSE3 modes, and not turned off by ``SPEECHTRAIN_FLUSH_DENORMALS=0``)."""
    if os.environ.get("SPEECHTRAIN_FLUSH_DENORMALS", "1") == "0":
        return False
    return bool(torch.set_flush_denormal(True))
