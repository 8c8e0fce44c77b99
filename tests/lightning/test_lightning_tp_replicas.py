"""Replicated parameters under tensor parallelism (norms, biases of row-parallel layers, ...: every parameter each TP
rank holds whole) stay equal on the TP ranks although one rank's gradients of them are disturbed before every
step's reduction, as non-deterministic GPU kernels disturb them: the bridge averages their gradients over the TP
group. Without that average (the control) the copies drift apart. Real processes: torchrun, TP=2, gloo."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

JOB = Path(__file__).with_name("tp_replica_job.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(out: Path, *args: str) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
               str(JOB), "--out", str(out), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.multiprocess
def test_replicated_parameters_stay_equal_on_tp_peers_whose_gradients_differ(tmp_path):
    rank0, rank1 = _run(tmp_path / "averaged")
    names = rank0["names"]
    assert names == rank1["names"]
    # Norms and the biases of row-parallel layers are replicated; the split weights are not among them.
    assert any("norm" in n for n in names) and any(n.endswith("bias") for n in names), names
    assert not set(names) & set(rank0["sharded"])
    for name in names:
        assert torch.equal(rank0["params"][name], rank1["params"][name]), name
    assert rank0["losses"] == rank1["losses"] and len(rank0["losses"]) == 6


@pytest.mark.slow
@pytest.mark.multiprocess
def test_without_the_average_the_disturbed_copies_drift_apart(tmp_path):
    """The control: the disturbance is large enough to show, and the test above would see it."""
    rank0, rank1 = _run(tmp_path / "control", "--no-average")
    drifted = [n for n in rank0["names"] if not torch.equal(rank0["params"][n], rank1["params"][n])]
    assert len(drifted) == len(rank0["names"]), drifted
