"""Launches under srun: ranks that see only SLURM's variables share one run folder, and the tokenizer and LM are
built once, by global rank 0, while the other rank waits for them. (Relaunches, restarts, runs started in the same
second and a failing build on rank 0, with real processes: tests/reliability/test_launch_faults.py.)"""

import os
import random
import subprocess
import sys

import pytest
from conftest import EXAMPLES, example_overrides

from speechtrain.lightning import launch


def test_rank_and_job_version_from_slurm_variables(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_NAME", "asr_train")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_PROCID", "9")
    assert launch.env_global_rank() == 9 and not launch.is_global_rank_zero()
    assert launch.job_version() == "job4242"
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert launch.is_global_rank_zero()
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")  # an interactive allocation: the shell is not a task of a launch
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert launch.is_global_rank_zero() and launch.job_version() is None


def test_build_on_rank_zero_waits_on_other_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(launch.BUILD_TIMEOUT_ENV, "0.2")
    target = tmp_path / "tok.model"
    with pytest.raises(TimeoutError, match="global rank 0 to build the tokenizer"):
        launch.build_on_rank_zero(target, lambda: pytest.fail("rank 1 must not build"), "the tokenizer")
    target.write_text("x")
    launch.build_on_rank_zero(target, lambda: pytest.fail("nothing to build"), "the tokenizer")


def test_a_waiting_rank_stops_on_rank_zeros_failure_marker_of_its_own_launch_only(tmp_path, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("SLURM_JOB_NAME", "train"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_ID", "77"),
                        ("SLURM_STEP_ID", "0"), ("SLURM_PROCID", "1"), (launch.BUILD_TIMEOUT_ENV, "1")):  # fmt: skip
        monkeypatch.setenv(name, value)
    target = tmp_path / "tokenizer.model"
    marker = tmp_path / "tokenizer.model.failed"
    marker.write_text("77.0.1\nValueError: an earlier start of this job (requeued since)\n")
    with pytest.raises(TimeoutError):  # not this launch's failure: waited out
        launch.build_on_rank_zero(target, lambda: pytest.fail("rank 1 must not build"), "the tokenizer")
    marker.write_text(f"{launch.launch_nonce()}\nValueError: no transcripts\n")
    with pytest.raises(RuntimeError, match="Global rank 0 failed to build the tokenizer.*ValueError: no transcripts"):
        launch.build_on_rank_zero(target, lambda: pytest.fail("rank 1 must not build"), "the tokenizer")


@pytest.mark.slow
def test_two_srun_tasks_share_one_run_folder_and_build_the_tokenizer_and_lm_once(tmp_path, dtmf_manifest):
    overrides = [o for o in example_overrides(tmp_path, dtmf_manifest) if not o.startswith("model.tokenizer.path")]
    overrides += ["model.tokenizer.path=null", "model.tokenizer.type=unigram", "model.tokenizer.vocab_size=14",
                  "model.decoding.strategy=beam", "model.decoding.lm_path=null", "model.decoding.lm_order=2",
                  "trainer.devices=2", "trainer.accelerator=cpu", "trainer.max_steps=2", "trainer.max_epochs=1",
                  "+trainer.limit_val_batches=1", "trainer.val_check_interval=2",
                  "trainer.check_val_every_n_epoch=null",
                  "exp_manager.create_tensorboard_logger=false"]  # fmt: skip
    job_id = str(random.randint(20000, 29999))  # Lightning's SLURM port: 10000 + the job id's last 4 digits
    launcher = ("SLURM_", "RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC", "SPEECHTRAIN_")
    keep = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    keep.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", SPEECHTRAIN_DATASETS_CACHE=str(tmp_path / "cache"),
                SPEECHTRAIN_TELEMETRY="0")  # fmt: skip
    procs = []
    for rank in (0, 1):
        env = {**keep, "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "asr_train", "SLURM_NTASKS": "2",
               "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
               "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODELIST": "localhost",
               "SLURM_STEP_ID": "0"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(EXAMPLES / "asr_train.py"), *overrides], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    log = "\n".join(outputs)
    assert log.count("Trained a unigram tokenizer") == 1, log[-4000:]
    assert log.count("-gram word LM") == 1, log[-4000:]
    assert [f.name for f in (tmp_path / "exp" / "asr_demo").iterdir()] == [f"job{job_id}"]
    run = tmp_path / "exp" / "asr_demo" / f"job{job_id}"
    assert (run / "asr_demo.stm").is_file() and (run / "train.log").is_file()
    assert "Final:" in (run / "train.log").read_text()


def test_outside_a_multi_process_launch_the_name_is_made_here_and_torchrun_ids_name_no_folder(monkeypatch):
    """Under torchrun, rank 0 names the run and hands the name over through the launch's store (real processes:
    tests/reliability/test_launch_faults.py); a rendezvous id no longer names the folder, so a relaunch or a restart
    with the same id never joins an earlier run."""
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert launch.launch_store() is None
    assert launch.shared_name(lambda: "2026-12-01_10-00-00") == "2026-12-01_10-00-00"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("RANK", "0")
    assert launch.job_version() is None


def test_a_fresh_launch_environment_drops_what_an_earlier_launch_left(monkeypatch):
    from speechtrain.lightning.launch import fresh_launch_env

    for name, value in (("MASTER_PORT", "29511"), ("RANK", "1"), ("LOCAL_WORLD_SIZE", "2"), ("PL_GLOBAL_SEED", "7"),
                        ("SPEECHTRAIN_EXP_VERSION", "v1"), ("KEEP_ME", "yes")):  # fmt: skip
        monkeypatch.setenv(name, value)
    env = fresh_launch_env(OMP_NUM_THREADS="1")
    assert env["KEEP_ME"] == "yes" and env["OMP_NUM_THREADS"] == "1"
    assert not {"MASTER_PORT", "RANK", "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED", "SPEECHTRAIN_EXP_VERSION"} & set(env)
