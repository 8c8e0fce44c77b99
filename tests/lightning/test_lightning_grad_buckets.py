import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_lightning_megatron_parity import _env, _free_port

from speechtrain.lightning.grad_buckets import GradientBuckets


@pytest.mark.multiprocess
def test_buckets_overlap_backward_and_sum_exactly_over_two_ranks():
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
        str(Path(__file__).with_name("buckets_job.py")),
    ]  # fmt: skip
    result = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


def test_single_process_only_divides_and_fills_missing_gradients():
    model = torch.nn.Linear(2, 2)
    buckets = GradientBuckets(model, None)
    model.weight.grad = torch.ones(2, 2)
    buckets.finish(torch.tensor(2.0))
    torch.testing.assert_close(model.weight.grad, torch.full((2, 2), 0.5))
    torch.testing.assert_close(model.bias.grad, torch.zeros(2))  # no gradient: reduced as zeros
    buckets.remove()
    assert not buckets._hooks
