import os
import subprocess
import sys

# Builds a Trainer (which applies the mode), then multiplies denormals on two intra-op threads; prints the nonzero
# results and what the products of a confident model's log-space backward (exp(-90)) become.
PROBE = """
import torch
torch.set_num_threads(2)
from speechtrain.lightning import Trainer
Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
x = torch.full((1 << 20,), 1.0e-39)
print(int((x * 1.0 != 0).sum()), float(torch.tensor(-90.0).exp()))
"""


def _probe(**env: str) -> tuple[int, float]:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **env},
                         capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    return int(out[0]), float(out[1])


def test_the_trainer_flushes_denormals_on_every_thread_and_not_when_turned_off():
    nonzero, tiny = _probe()
    assert nonzero == 0 and tiny == 0.0  # both intra-op threads flush (they start after the Trainer)
    nonzero, tiny = _probe(SPEECHTRAIN_FLUSH_DENORMALS="0")
    assert nonzero == 1 << 20 and 0.0 < tiny < 1.2e-38  # the CPU's default: IEEE denormals
