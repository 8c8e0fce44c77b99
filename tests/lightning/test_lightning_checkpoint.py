import json

import pytest
import torch

from speechtrain.lightning import checkpoint


def test_single_file_checkpoint_is_written_atomically_and_replaces_the_old_one(tmp_path):
    path = tmp_path / "last.ckpt"
    checkpoint.save_checkpoint({"step": 1}, path)
    checkpoint.save_checkpoint({"step": 2}, path)
    assert checkpoint.load_checkpoint(path) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_interrupted_sharded_save_is_not_mistaken_for_a_checkpoint(tmp_path):
    folder = tmp_path / "step=4.ckpt"
    folder.mkdir()
    torch.save({"step": 4}, folder / "tp00_pp000.ckpt")
    with pytest.raises(ValueError, match="incomplete.*interrupted"):
        checkpoint.load_checkpoint(folder)
    (folder / "metadata.json").write_text(
        json.dumps({"format": checkpoint.FORMAT, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1})
    )
    with pytest.raises(ValueError, match="saved with tensor_model_parallel_size=2.*this run uses 1"):
        checkpoint.load_checkpoint(folder)


def test_remove_checkpoint_handles_files_and_folders(tmp_path):
    (tmp_path / "a.ckpt").write_bytes(b"x")
    (tmp_path / "b.ckpt").mkdir()
    checkpoint.remove_checkpoint(tmp_path / "a.ckpt")
    checkpoint.remove_checkpoint(tmp_path / "b.ckpt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_failed_write_on_rank_0_stops_every_rank_at_once(tmp_path, tp):
    """Rank 0's checkpoint write fails (a real EFBIG): every rank raises within seconds, the others told that
    another rank failed, instead of waiting in a barrier for a rank that has gone."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    job = Path(__file__).with_name("save_failure_job.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", str(job),
               "--out", str(tmp_path), "--tp", str(tp)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    # a rank left in a barrier would wait for gloo's 30-minute timeout: the run's own timeout catches that
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    zero, one = (tmp_path / "rank0.txt").read_text(), (tmp_path / "rank1.txt").read_text()
    assert zero.startswith("CheckpointWriteError") and "another rank" not in zero, zero  # its own error
    assert "another rank failed" in one, one
    assert not (tmp_path / "last.ckpt").exists()
