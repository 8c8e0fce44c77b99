"""Runs whose output is not a terminal show progress lines, and a newcomer's log starts short: the other ranks'
INFO lines, Megatron's chatter and torch's CUDA-runtime warning stay out of it."""

import subprocess
import sys
from pathlib import Path

import pytest

from speechtrain.common.progress import Progress, format_duration
from speechtrain.lightning.launch import fresh_launch_env

ROOT = Path(__file__).resolve().parents[2]


def test_progress_reports_every_interval_with_done_total_and_time_left():
    now = [0.0]
    lines = []
    progress = Progress("synthesising", 100, "utterances", every_s=30, emit=lines.append, clock=lambda: now[0])
    for _ in range(10):
        now[0] += 10.0
        progress.update(5)
    progress.close()
    assert lines[0] == "synthesising: 100 utterances"
    assert lines[1] == "synthesising: 15/100 utterances (15%), 0.5/s, 0:30 elapsed, 2:50 left"
    assert len(lines) == 1 + 3 + 1 and lines[-1] == "synthesising: done, 50 utterances in 1:40"
    assert format_duration(3725) == "1:02:05"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_rank_run_written_to_a_file_logs_progress_and_starts_short(tmp_path, dtmf_manifest):
    """What `make demo > log` shows: progress lines during training, and few lines before the first one."""
    data = (
        f"model.train_ds.manifest_filepath={dtmf_manifest}",
        f"model.validation_ds.manifest_filepath={dtmf_manifest}",
    )
    command = [sys.executable, str(ROOT / "examples" / "asr_train.py"), "model.size=debug", "trainer.devices=2", *data,
               "model.tokenizer.vocab=['0','1','2','3','4','5','6','7','8','9',' ']", "trainer.max_steps=6",
               "trainer.max_time=null", "model.decoding.strategy=greedy", f"exp_manager.exp_dir={tmp_path}",
               "model.train_ds.batch_duration=8"]  # fmt: skip
    env = fresh_launch_env(OMP_WAIT_POLICY="PASSIVE", SPEECHTRAIN_PROGRESS_S="0")
    env.pop("SPEECHTRAIN_ENGINE_LOG", None)
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    log = (out.stdout + out.stderr).splitlines()
    assert out.returncode == 0, "\n".join(log[-30:])
    first = next(i for i, line in enumerate(log) if "training: step" in line)
    assert first < 40, "\n".join(log[:first])
    assert any("parameters (" in line for line in log[:first])  # the summary, in one line
    assert sum("training: step" in line for line in log) >= 3
    text = "\n".join(log)
    for noise in ("No CUDA runtime is found", "Params for bucket", "megatron_fsdp", "dp 1)"):
        assert noise not in text, noise
