"""No kill, crash or failed write loses a checkpoint: SIGKILL at random and at named points inside checkpoint writes
(real processes, forked), a write that fails on the process's file-size limit (EFBIG), a truncated or bit-flipped
``last.ckpt`` beside an older good one; and a training run killed inside its checkpoint write that resumes to the
weights of an uninterrupted run. Each test records its faults for the summary table (see conftest.py)."""

import errno
import json
import logging
import os
import random
import resource
import select
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import example_job, example_main, example_overrides, final_weights, run_folder
from test_faults import _run_job

from speechtrain.core.exp_manager import find_last_checkpoint
from speechtrain.lightning import checkpoint

RANDOM_KILLS = 20


def _payload(step: int) -> dict:
    return {"global_step": step, "tag": torch.tensor([step]), "w": WEIGHTS}


WEIGHTS = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB: a write takes long enough to be hit inside


def _fork(body) -> tuple[int, int]:
    """Run ``body(write_fd)`` in a forked child (which never returns); the parent gets (pid, read_fd)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery past this point
        os.close(read_fd)
        try:
            body(write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    return pid, read_fd


def _saving_loop(path: Path, first_step: int, kill_at: str | None = None):
    """A child that saves checkpoints of steps first_step, first_step + 1, ... and reports each one done; with
    ``kill_at``, it SIGKILLs itself at that named point of its first save."""

    def body(report: int) -> None:
        if kill_at is not None:
            _arm(kill_at)
        os.write(report, b"r")
        step = first_step
        while True:
            os.write(report, b"b,")  # a write begins
            checkpoint.save_checkpoint(_payload(step), path)
            os.write(report, f"{step},".encode())
            step += 1

    return body


def _arm(point: str) -> None:
    """Make this (child) process SIGKILL itself at a named point of the next checkpoint write."""
    die = lambda *_: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if point == "inside torch.save":
        write = checkpoint._FileSink.write
        checkpoint._FileSink.write = lambda self, data: die() if self.position > 1 << 20 else write(self, data)
    elif point == "written, before fsync":
        checkpoint.os.fsync = die
    elif point in ("fsynced, before the rename", "between the two renames of a folder"):
        replace = os.replace
        calls = []

        def replace_then_die(src, dst):
            calls.append(dst)
            if point == "fsynced, before the rename" or len(calls) == 2:
                die()
            replace(src, dst)

        checkpoint.os.replace = replace_then_die
    elif point == "renamed, before the folder fsync":
        replace = os.replace

        def replaced_then_die(src, dst):
            replace(src, dst)
            die()

        checkpoint.os.replace = replaced_then_die


def _reports(read_fd: int, wait_for_ready: bool = False) -> list[str]:
    """What the child reported: ``b`` when a write began, the step when it ended."""
    data = b""
    while select.select([read_fd], [], [], 10 if wait_for_ready and not data else 0)[0]:
        chunk = os.read(read_fd, 4096)
        if not chunk:
            break
        data += chunk
        if wait_for_ready and b"b" in data:  # the child's first write has begun
            break
    return [s for s in data.decode().lstrip("r").split(",") if s]


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _check_survived(path: Path, reports: list[str], before: int) -> int:
    """The folder holds a loadable checkpoint at ``path``: the last save reported done (or the one after it, killed
    after its rename), or the one from ``before`` the child started (or the one after it) when none was."""
    (found,) = checkpoint.checkpoint_candidates(path)[:1]
    state = checkpoint.load_checkpoint(found)
    assert int(state["tag"]) == state["global_step"] and torch.equal(state["w"], WEIGHTS)
    done = [int(r) for r in reports if r != "b"]
    last_done = done[-1] if done else before
    assert state["global_step"] in (last_done, last_done + 1), (state["global_step"], reports, before)
    checkpoint.clean_leftovers(path.parent)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # nothing left over after the clean-up
    return state["global_step"]


def test_sigkill_at_random_and_named_points_of_checkpoint_writes_never_loses_the_last_checkpoint(tmp_path, fault):
    named = ["inside torch.save", "written, before fsync", "fsynced, before the rename",
             "renamed, before the folder fsync"]  # fmt: skip
    record = fault(f"SIGKILL inside a checkpoint write ({RANDOM_KILLS} random points, {len(named)} named)",
                   injected=RANDOM_KILLS + len(named))  # fmt: skip
    path = tmp_path / "checkpoints" / "run--last.ckpt"
    checkpoint.save_checkpoint(_payload(0), path)
    start = time.perf_counter()
    checkpoint.save_checkpoint(_payload(0), path)
    save_seconds = time.perf_counter() - start
    rng = random.Random(61)
    step, inside = 0, 0
    for _ in range(RANDOM_KILLS):
        pid, reports = _fork(_saving_loop(path, step + 1))
        done = _reports(reports, wait_for_ready=True)
        time.sleep(rng.uniform(0.0, 3 * save_seconds))  # somewhere in the 1st to 3rd write of this child
        _kill(pid)
        done += _reports(reports)
        inside += done[-1] == "b"  # killed inside save_checkpoint
        step = _check_survived(path, done, step)
        os.close(reports)
    assert inside >= RANDOM_KILLS * 3 // 4, f"only {inside} of {RANDOM_KILLS} kills fell inside a write"
    for point in named:
        pid, reports = _fork(_saving_loop(path, step + 1, kill_at=point))
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status), f"the child was not killed at {point!r}"
        expected = step + 1 if point == "renamed, before the folder fsync" else step
        assert _check_survived(path, _reports(reports), step) == expected, point
        step = expected
        os.close(reports)
    record.survive(steps_lost=0)


def _sharded_folder(path: Path, step: int) -> None:
    """A complete sharded checkpoint folder of 2 tensor-parallel shards, as save_checkpoint writes it."""
    path.mkdir(parents=True)
    sizes = {}
    for rank in range(2):
        torch.save({"global_step": step, "rank": rank}, path / f"tp0{rank}_pp000.ckpt")
        sizes[f"tp0{rank}_pp000.ckpt"] = (path / f"tp0{rank}_pp000.ckpt").stat().st_size
    metadata = {"format": checkpoint.FORMAT, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                "shard_bytes": sizes}  # fmt: skip
    (path / checkpoint.METADATA).write_text(json.dumps(metadata))


def test_a_kill_between_the_two_renames_of_a_sharded_folder_leaves_the_new_checkpoint_findable(tmp_path, fault):
    record = fault("SIGKILL between the two renames of a sharded checkpoint folder")
    root = tmp_path / "run"
    folder = root / "2024-01-01_00-00-00" / "checkpoints"
    path = folder / "run--last.ckpt"
    _sharded_folder(path, 4)
    _sharded_folder(path.with_name(path.name + checkpoint.PARTIAL), 8)

    def body(report: int) -> None:
        _arm("between the two renames of a folder")
        checkpoint._replace(path.with_name(path.name + checkpoint.PARTIAL), path)

    pid, reports = _fork(body)
    _, status = os.waitpid(pid, 0)
    os.close(reports)
    assert os.WIFSIGNALED(status) and not path.exists()  # killed with the old folder moved aside
    (best, older) = checkpoint.checkpoint_candidates(path)
    assert best.name.endswith(checkpoint.PARTIAL) and older.name.endswith(checkpoint.OLD)
    assert find_last_checkpoint(root) == best
    checkpoint.clean_leftovers(folder)
    assert sorted(p.name for p in folder.iterdir()) == [best.name]  # the only copy of step 8 is kept
    assert torch.load(best / "tp00_pp000.ckpt")["global_step"] == 8
    record.survive(steps_lost=0)


def test_a_checkpoint_moved_aside_by_an_older_interrupted_save_is_still_found(tmp_path):
    """Earlier versions renamed the old file to ``.old`` before putting the new one in place: killed in between,
    the ``.old`` file is the checkpoint."""
    folder = tmp_path / "run" / "2024-01-01_00-00-00" / "checkpoints"
    checkpoint.save_checkpoint({"global_step": 4}, folder / "run--last.ckpt.old")
    (folder / "run--last.ckpt.partial").write_bytes(b"PK\x03\x04 half a file")
    assert find_last_checkpoint(tmp_path / "run") == folder / "run--last.ckpt.old"
    checkpoint.clean_leftovers(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["run--last.ckpt.old"]


def test_a_write_that_fails_on_the_file_size_limit_is_named_and_the_previous_checkpoint_survives(tmp_path, fault):
    record = fault("checkpoint write failing with EFBIG (the process's RLIMIT_FSIZE)")
    path = tmp_path / "last.ckpt"
    checkpoint.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)

    def body(report: int) -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            checkpoint.save_checkpoint({"global_step": 2, "w": WEIGHTS}, path)
        except checkpoint.CheckpointWriteError as error:
            os.write(report, f"{error.errno}|{error}".encode())

    pid, reports = _fork(body)
    os.waitpid(pid, 0)
    code, message = os.read(reports, 65536).decode().split("|", 1)
    os.close(reports)
    assert int(code) == errno.EFBIG
    assert f"Could not write checkpoint {path}: the file would exceed the size limit" in message
    assert "EFBIG" in message and f"the previous checkpoint at {path} is intact" in message
    assert checkpoint.load_checkpoint(path)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no partial file left
    record.survive(steps_lost=0)


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0x01  # one bit inside the tensor data: torch alone would load a wrong number
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "bit-flipped"])
def test_resume_falls_back_to_the_previous_good_checkpoint_of_the_same_run_and_says_so(tmp_path, how, caplog, fault):
    record = fault(f"{how} last.ckpt with an older good checkpoint beside it")
    root = tmp_path / "exp" / "run"
    other = root / "2024-01-01_00-00-00" / "checkpoints"  # an earlier run of the same name: never a candidate
    checkpoint.save_checkpoint({"global_step": 99, "w": WEIGHTS}, other / "run--last.ckpt")
    time.sleep(0.05)
    folder = root / "2024-01-02_00-00-00" / "checkpoints"
    checkpoint.save_checkpoint({"global_step": 4, "w": WEIGHTS}, folder / "run--val_loss=1.0-epoch=0.ckpt")
    checkpoint.save_checkpoint({"global_step": 6, "w": WEIGHTS}, folder / "run--last.ckpt")
    os.utime(other / "run--last.ckpt")  # the newest file of all, in the other run
    _damage(folder / "run--last.ckpt", how)
    with caplog.at_level(logging.WARNING, logger="speechtrain"):
        found = find_last_checkpoint(root)
    assert found == folder / "run--val_loss=1.0-epoch=0.ckpt"
    assert checkpoint.load_checkpoint(found)["global_step"] == 4
    (line,) = [r.getMessage() for r in caplog.records if "Not resuming from" in r.getMessage()]
    assert "run--last.ckpt: Checkpoint" in line and ("truncated or corrupt" in line or "checksum" in line)
    assert f"resuming from the previous good checkpoint {found} instead" in line
    assert find_last_checkpoint(root, version="2024-01-01_00-00-00") == other / "run--last.ckpt"  # asked for by name
    record.survive(steps_lost=2)


@pytest.mark.slow  # (25 s: three runs; the default suite resumes after a SIGKILL in test_faults.py)
@pytest.mark.multiprocess
def test_a_run_killed_inside_its_checkpoint_write_resumes_equal_to_an_uninterrupted_one(tmp_path, dtmf_manifest,
                                                                                          fault):  # fmt: skip
    record = fault("SIGKILL inside the write of last.ckpt during training, then resume")
    every4 = "+exp_manager.checkpoint_callback_params.every_n_train_steps=4"
    common = ["trainer.max_epochs=2", every4, "model.decoding.strategy=greedy", "trainer.accelerator=cpu"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    done = _run_job([*example_overrides(straight, dtmf_manifest), *common], {})
    assert done.returncode == 0, done.stderr[-3000:]
    killed = _run_job([*example_overrides(split, dtmf_manifest), *common],
                      {"FAULT": "kill_in_save", "FAULT_STEP": "8"})  # fmt: skip
    assert killed.returncode == -signal.SIGKILL
    folder = run_folder(split) / "checkpoints"
    assert (folder / "asr_demo--last.ckpt.partial").is_file()  # killed with the new file complete, not renamed
    assert checkpoint.load_checkpoint(folder / "asr_demo--last.ckpt")["global_step"] == 4
    resumed = _run_job([*example_overrides(split, dtmf_manifest), *common, "exp_manager.resume_if_exists=true"], {})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list(folder.glob("*.partial"))  # cleaned at start
    expected, got = final_weights(straight), final_weights(split)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
    record.survive(steps_lost=8 - 4)


def test_a_damaged_last_checkpoint_in_a_real_run_is_passed_over_on_resume(tmp_path, dtmf_manifest, caplog, fault):
    """Also: what killed saves leave behind (a checkpoint's ``.partial`` and ``.old``, an archive's temporary file)
    is removed when the run resumes."""
    record = fault("truncated last.ckpt of a real run, resumed in process")
    job = example_job(tmp_path, dtmf_manifest, "trainer.max_epochs=1", "model.decoding.strategy=greedy",
                      "exp_manager.save_archive_on_train_end=false")  # fmt: skip
    example_main()(job)
    folder = run_folder(tmp_path) / "checkpoints"
    (last,) = folder.glob("*last.ckpt")
    (best,) = [p for p in folder.glob("*.ckpt") if p != last]
    _damage(last, "truncated")
    leftovers = [last.with_name(last.name + ".partial"), best.with_name(best.name + ".old"),
                 run_folder(tmp_path) / ".asr_demo.stm.k3j2.tmp"]  # fmt: skip
    for leftover in leftovers:
        leftover.write_bytes(b"PK\x03\x04 half a file")
    resume = example_job(tmp_path, dtmf_manifest, "trainer.max_epochs=2", "model.decoding.strategy=greedy",
                         "exp_manager.resume_if_exists=true")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="speechtrain"):
        example_main()(resume)
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"resuming from the previous good checkpoint {best} instead" in m for m in messages)
    assert any(m == f"Resuming from {best}" for m in messages)
    assert checkpoint.load_checkpoint(last)["epoch"] == 1  # the run went on and wrote a good last.ckpt
    assert last.with_name(last.name + ".corrupt").is_file()  # the damaged one, set aside
    assert not any(leftover.exists() for leftover in leftovers)
    assert all(torch.isfinite(w).all() for w in final_weights(tmp_path).values())
    record.survive(steps_lost=0)
