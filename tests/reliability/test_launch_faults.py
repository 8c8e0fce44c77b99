"""Faults at launch, with real processes: a quick torchrun relaunch on the same port, a torchrun restart, two runs
started in the same second, and rank 0's tokenizer build failing while the other rank waits for it. Ranks agree on
the run folder through the launch's own rendezvous store (speechtrain.lightning.launch), never a file an earlier
launch left; run folders are created atomically; a failed build reaches the waiting ranks through a failure marker
that names its launch."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("launch_job.py")
LAUNCHER = ("SLURM_", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC",
            "SPEECHTRAIN_", "PL_")  # fmt: skip


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER)}
    return {**env, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", **extra}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(port: int, *args: str, restarts: int = 0, **env: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
               f"--max-restarts={restarts}", str(JOB), *args]  # fmt: skip
    return subprocess.run(command, env=_clean_env(**env), capture_output=True, text=True, timeout=180, check=False)


def _names(out: Path) -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(out.glob("*.txt"))}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_quick_torchrun_relaunch_on_the_same_port_never_joins_the_previous_run(tmp_path, fault):
    """Rank 0 names the run and hands the name to the other ranks through the launch's own rendezvous store: a
    second launch seconds later, on the same port, gets its own folder (a handshake file younger than 120 s used
    to hand it the first launch's), and no file is shared between the ranks."""
    record = fault("torchrun relaunched on the same port seconds later: its own run folder, agreed by its ranks")
    port = _free_port()
    for launch_no in (1, 2):
        done = _torchrun(port, "name", str(tmp_path / "exp"), str(tmp_path / f"out{launch_no}"))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    first, second = _names(tmp_path / "out1"), _names(tmp_path / "out2")
    assert set(first) == set(second) == {"attempt0-rank0", "attempt0-rank1"}
    assert len(set(first.values())) == 1 and len(set(second.values())) == 1  # each launch: one folder, every rank
    assert set(first.values()) != set(second.values())
    assert sorted(p.name for p in (tmp_path / "exp" / "run").iterdir()) == sorted(
        Path(v).name for v in {*first.values(), *second.values()}
    )  # no handshake file, no third folder
    record.survive()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_torchrun_restart_names_a_new_run_that_all_its_ranks_share(tmp_path, fault):
    """--max-restarts: the restarted workers are a new attempt; their run folder is a new one, agreed on afresh
    (exp_manager.resume_if_exists is what continues a run)."""
    record = fault("torchrun --max-restarts restart: a new run folder, agreed afresh")
    done = _torchrun(_free_port(), "name", str(tmp_path / "exp"), str(tmp_path / "out"), restarts=1,
                     FAIL_FIRST_ATTEMPT="1")  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    names = _names(tmp_path / "out")
    assert set(names) == {"attempt0-rank0", "attempt0-rank1", "attempt1-rank0", "attempt1-rank1"}
    assert names["attempt0-rank0"] == names["attempt0-rank1"] != names["attempt1-rank0"] == names["attempt1-rank1"]
    record.survive()


def test_two_runs_started_in_the_same_second_get_two_folders(tmp_path, fault):
    """Two processes, each a launch of its own, start together (the same timestamp, as a rule): mkdir without
    exist_ok, and the next suffix for the one that comes second."""
    record = fault("two runs of one name started in the same second: two run folders")
    script = ("import sys; from pathlib import Path; from speechtrain.core.exp_manager import _new_version; "
              "print(_new_version(Path(sys.argv[1])))")  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "run")], env=_clean_env(),
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    names = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert len(set(names)) == 2 and all((tmp_path / "run" / n).is_dir() for n in names), names
    record.survive()


def _by_hand(kind: str, rank: int, port: int) -> dict[str, str]:
    if kind == "srun":  # srun without --kill-on-bad-exit: nothing stops the other task when rank 0 fails
        return {"SLURM_JOB_ID": str(port), "SLURM_JOB_NAME": "prepare", "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank), "SLURM_STEP_ID": "0"}  # fmt: skip
    return {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["srun", "env"])
def test_rank_zero_failing_to_build_the_tokenizer_stops_the_other_rank_within_seconds(tmp_path, kind, fault):
    """Two ranks that no launcher stops for each other: rank 0's build raises; rank 1, polling for the file, reads
    the failure marker of its own launch and stops with rank 0's error (it used to wait an hour)."""
    record = fault(f"rank 0's tokenizer build failing, 2 ranks ({kind}): both stop within 30 s")
    target, port = tmp_path / "tok" / "tokenizer.model", _free_port()
    target.parent.mkdir()
    # A marker an earlier launch left (another launch id): not this launch's failure.
    target.with_name("tokenizer.model.failed").write_text("an-earlier-launch\nValueError: old\n")
    procs = [subprocess.Popen([sys.executable, str(JOB), "build", str(target), "fail"],
                              env=_clean_env(**_by_hand(kind, rank, port)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]  # fmt: skip
    outputs = [procs[0].communicate(timeout=300)[0]]
    start = time.monotonic()  # rank 0 has failed (and exited): from here, not from the imports of a loaded machine
    outputs.append(procs[1].communicate(timeout=120)[0])
    assert procs[0].returncode != 0 and "injected: no transcripts" in outputs[0], outputs[0][-2000:]
    assert procs[1].returncode != 0, outputs[1][-2000:]
    assert "Global rank 0 failed to build the tokenizer" in outputs[1], outputs[1][-2000:]
    assert "injected: no transcripts" in outputs[1] and "ValueError: old" not in outputs[1]
    assert time.monotonic() - start < 30
    record.survive()


@pytest.mark.slow  # (the other launch-failure tests stay in the default suite)
@pytest.mark.multiprocess
def test_a_rank_that_starts_after_rank_zero_failed_and_exited_stops_at_once(tmp_path):
    """Rank 1 slower to start than rank 0 is to fail (a loaded node): by the time it asks, rank 0 and its store are
    gone, so the failure marker is told to be this launch's by its time (written after rank 1's process began)."""
    target, port = tmp_path / "tok" / "tokenizer.model", _free_port()
    target.parent.mkdir()
    marker = target.with_name("tokenizer.model.failed")
    late = [{}, {"START_AFTER_FILE": str(marker)}]
    procs = [subprocess.Popen([sys.executable, str(JOB), "build", str(target), "fail"],
                              env=_clean_env(**_by_hand("env", rank, port), **late[rank]), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]  # fmt: skip
    zero = procs[0].communicate(timeout=300)[0]
    assert procs[0].returncode != 0 and "injected: no transcripts" in zero, zero[-2000:]
    start = time.monotonic()
    one = procs[1].communicate(timeout=120)[0]
    assert procs[1].returncode != 0 and "Global rank 0 failed to build the tokenizer" in one, one[-2000:]
    assert time.monotonic() - start < 30


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_failure_marker_of_an_earlier_launch_does_not_stop_the_next_one(tmp_path):
    target, port = tmp_path / "tokenizer.model", _free_port()
    target.with_name("tokenizer.model.failed").write_text("an-earlier-launch\nValueError: old\n")
    procs = [subprocess.Popen([sys.executable, str(JOB), "build", str(target), "ok"],
                              env=_clean_env(**_by_hand("env", rank, port)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]  # fmt: skip
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("done built" in out for out in outputs)
    assert not target.with_name("tokenizer.model.failed").exists()  # rank 0 cleared it before building
