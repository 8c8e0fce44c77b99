"""Requeue decided by the marker the saving rank writes, not by srun's exit status: examples/slurm/asr_train.sbatch
run by bash with stand-ins for ``srun`` (the command as two tasks on this machine, ``--kill-on-bad-exit=1``
emulated: when a task exits non-zero the others are killed and srun reports 137; SIGUSR1 to every task, as
``#SBATCH --signal=USR1@180`` does) and ``scontrol`` (records its arguments). The tasks run the script's real
command line, examples/asr_train.py with its FastConformer recipe shrunk by overrides, on CPU."""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import example_job, example_main, example_overrides, run_folder

from speechtrain.lightning import BaseCallback, CallbackGroup, checkpoint
from speechtrain.lightning.fault_tolerance import PREEMPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "asr_train.sbatch"
LAUNCHER = ("SLURM_", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC",
            "SPEECHTRAIN_", "PL_")  # fmt: skip

FAKE_SRUN = '''#!{python}
import glob, os, signal, subprocess, sys, time
args = sys.argv[1:]
kill_on_bad_exit = "--kill-on-bad-exit=1" in args
while args and args[0].startswith("--"):
    args.pop(0)
if os.environ.get("FAKE_SRUN_EXIT"):  # a crash before any checkpoint: nothing runs
    sys.exit(int(os.environ["FAKE_SRUN_EXIT"]))
if args[0] == ".venv/bin/python":
    args[0] = {python!r}
tasks = [subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}})
         for r in range(int(os.environ["SLURM_NTASKS"]))]
signalled = killed = False
while any(t.poll() is None for t in tasks):
    if not signalled and glob.glob(os.environ["FAKE_SRUN_SIGNAL_WHEN"], recursive=True):
        for t in tasks:
            t.send_signal(signal.SIGUSR1)
        signalled = True
    if kill_on_bad_exit and any(t.poll() not in (None, 0) for t in tasks):
        for t in tasks:
            if t.poll() is None:
                t.kill()
                killed = True
    time.sleep(0.05)
codes = [t.wait() for t in tasks]
print("srun (stand-in): task exit codes", codes, flush=True)
sys.exit(137 if killed or min(codes) < 0 else max(codes))
'''
FAKE_SCONTROL = '#!/bin/sh\necho "$@" >> "$FAKE_SCONTROL_LOG"\n'


def _sbatch(tmp_path: Path, overrides: list[str], **extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job_id = str(random.randint(20000, 29999))  # Lightning's SLURM port: 10000 + the job id's last 4 digits
    marker = tmp_path / f".requeue-{job_id}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER)}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE",
               SPEECHTRAIN_TELEMETRY="0", SPEECHTRAIN_DATASETS_CACHE=str(tmp_path / "cache"),
               SPEECHTRAIN_REQUEUE_MARKER=str(marker), FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"),
               FAKE_SRUN_SIGNAL_WHEN=str(tmp_path / "exp" / "**" / "*last.ckpt"), SLURM_SUBMIT_DIR=str(ROOT),
               SLURM_JOB_ID=job_id, SLURM_JOB_NAME="asr_train", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2",
               SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_NODELIST="localhost",
               SLURM_STEP_ID="0")  # fmt: skip
    env.update(extra)
    done = subprocess.run(["bash", str(SBATCH), *overrides], env=env, capture_output=True, text=True, timeout=400)
    return done, marker


def _requeues(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_preempted_srun_job_is_requeued_by_its_marker_whatever_srun_reports(tmp_path, dtmf_manifest, fault):
    """SIGUSR1 reaches both tasks after the step-2 checkpoint; they agree at the next check, save ``last`` and
    stop; rank 0 writes the marker once the checkpoint is on disk and exits 75, the other task exits 0 or is
    killed by srun. The script requeues the job because the marker is there."""
    record = fault("SIGUSR1 under srun --kill-on-bad-exit=1 (2 tasks): requeued by the marker, not srun's status")
    overrides = [*example_overrides(tmp_path, dtmf_manifest), "trainer.accelerator=cpu", "trainer.max_steps=100000",
                 "model.train_ds.use_bucketing=false", "model.train_ds.pin_memory=false",
                 "model.validation_ds.num_workers=0", "model.validation_ds.pin_memory=false",
                 "model.validation_ds.batch_duration=null", "model.validation_ds.batch_size=8",
                 "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
                 "exp_manager.checkpoint_callback_params.monitor=val_loss",
                 "exp_manager.create_tensorboard_logger=false"]  # fmt: skip
    done, marker = _sbatch(tmp_path, overrides)
    output = done.stdout[-3000:] + done.stderr[-5000:]
    assert "srun (stand-in): task exit codes" in done.stdout, output
    assert "requeueing" in done.stdout, output
    job_id = marker.name.removeprefix(".requeue-")
    assert _requeues(tmp_path) == [f"requeue {job_id}"], output
    assert not marker.exists()  # the script removes it once acted upon
    (run,) = (tmp_path / "exp" / "fastconformer_ctc_large").iterdir()
    assert run.name == f"job{job_id}"
    fields = dict(line.split("=", 1) for line in (run / "requeue").read_text().splitlines())
    saved = Path(fields["checkpoint"])
    assert saved.parent == run / "checkpoints" and saved.is_file()
    assert checkpoint.load_checkpoint(saved)["global_step"] == int(fields["step"]) >= 2
    assert done.returncode != 0  # srun's own status (75 or 137): not what decides
    record.survive(steps_lost=0)


@pytest.mark.parametrize("status", ["137", "75", "0"])
def test_without_a_marker_srun_failing_or_succeeding_is_not_requeued(tmp_path, status):
    """A crash (srun 137), a 75 from anything but a saved preemption, or a finished run: no marker, no requeue,
    srun's status is the job's. A marker an earlier start of the job left is removed before srun runs."""
    stale = tmp_path / ".requeue-stale"
    stale.write_text("step=4\ncheckpoint=/nowhere\n")
    done, _ = _sbatch(tmp_path, ["unused=1"], FAKE_SRUN_EXIT=status, SPEECHTRAIN_REQUEUE_MARKER=str(stale))
    assert done.returncode == int(status), done.stdout + done.stderr
    assert _requeues(tmp_path) == [] and not stale.exists()


class _Usr1(BaseCallback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)


def _fields(marker: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in marker.read_text().splitlines())


def test_the_saving_rank_writes_the_marker_after_the_checkpoint_and_the_resumed_run_clears_it(
    tmp_path, dtmf_manifest, monkeypatch
):
    """In the run folder and at $SPEECHTRAIN_REQUEUE_MARKER: the step and the checkpoint, which is on disk and
    holds that step. The resumed start removes the marker (it finishes: nothing to requeue)."""
    elsewhere = tmp_path / "job" / ".requeue-42"
    monkeypatch.setenv("SPEECHTRAIN_REQUEUE_MARKER", str(elsewhere))
    common = ["trainer.max_epochs=2", "model.decoding.strategy=greedy"]
    signal_at_step_3 = _Usr1()
    CallbackGroup.get_instance().register(signal_at_step_3)
    with pytest.raises(SystemExit) as exit_info:
        example_main()(example_job(tmp_path, dtmf_manifest, *common))
    assert exit_info.value.code == PREEMPTED_EXIT_CODE
    run = run_folder(tmp_path)
    for marker in (run / "requeue", elsewhere):
        fields = _fields(marker)
        assert fields["step"] == "4" and Path(fields["checkpoint"]).parent == run / "checkpoints"
        assert checkpoint.load_checkpoint(fields["checkpoint"])["global_step"] == 4
    CallbackGroup.get_instance().unregister(signal_at_step_3)
    example_main()(example_job(tmp_path, dtmf_manifest, *common, "exp_manager.resume_if_exists=true"))
    assert not (run / "requeue").exists() and not elsewhere.exists()
    assert (run / "asr_demo.stm").is_file()
