"""Generation under tensor parallelism: every TP rank samples the same tokens and leaves the loop at the same step,
even when their random streams differ (issue 26). A regression fails on the timeout instead of hanging CI."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speechtrain.lightning.launch import fresh_launch_env

JOB = Path(__file__).with_name("generation_tp_job.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multiprocess
def test_tp_ranks_with_different_random_streams_generate_the_same_and_stop_together(tmp_path, dtmf_manifest):
    from speechtrain.speechlm.prompts import get_template
    from speechtrain.speechlm.tokenizer import train_bpe_tokenizer

    texts = ["1 2 3 4 5 6 7 8 9 0", "Transcribe the audio.", "What is the last digit?", "0 9 8 7 6 5 4 3 2 1"] * 20
    train_bpe_tokenizer(texts, 300, get_template("llama3").special_tokens).save(tmp_path / "tok")
    env = fresh_launch_env(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    out = tmp_path / "generated"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
               str(JOB), "--out", str(out), "--manifest", str(dtmf_manifest),
               "--tokenizer", str(tmp_path / "tok" / "tokenizer.json")]  # fmt: skip
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=150, check=False)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"TP ranks left a generation loop at different steps and hung: {error}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    a, b = (torch.load(f"{out}.{rank}", weights_only=False) for rank in (0, 1))
    assert a["steps"] == b["steps"] and torch.equal(a["codes"], b["codes"])
    assert a["answers"] == b["answers"] and any(a["answers"])
