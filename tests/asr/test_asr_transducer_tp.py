import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

JOB = Path(__file__).with_name("transducer_tp_job.py")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # (the TP encoder and NeMo TP fine-tuning stay in the default suite)
@pytest.mark.multiprocess
def test_tensor_parallel_transducer_equals_single_process(tmp_path):
    """TP=2 (encoder split, prediction network and joint replicated) gives TP=1's loss and gradients, and both
    ranks hold the same gradients of the replicated layers."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    single, parallel = tmp_path / "tp1.pt", tmp_path / "tp2.pt"
    commands = [
        [sys.executable, str(JOB), "--out", str(single), "--hybrid"],
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
         str(JOB), "--out", str(parallel), "--hybrid"],
    ]  # fmt: skip
    for command in commands:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    a = torch.load(f"{single}.rank0", weights_only=False)
    ranks = [torch.load(f"{parallel}.rank{r}", weights_only=False) for r in range(2)]
    for b in ranks:
        torch.testing.assert_close(b["loss"], a["loss"], atol=1e-5, rtol=1e-6)
        assert int(b["count"]) == int(a["count"])
        assert b["grads"].keys() == a["grads"].keys()
        for name, grad in a["grads"].items():
            torch.testing.assert_close(b["grads"][name], grad, atol=1e-5, rtol=1e-5, msg=name)
    for name, grad in ranks[0]["grads"].items():
        if name.startswith(("prediction.", "joint.", "decoder.")):
            assert torch.equal(ranks[1]["grads"][name], grad), name
