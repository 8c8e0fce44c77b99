"""Fault injection: NaN losses, preemption signals, SIGKILL, a full disk, corrupt checkpoints, a crashing rank,
hostile files; and determinism. Each test records its faults for the summary table (see conftest.py)."""

import hashlib
import io
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import example_job, example_main, example_overrides, final_weights, run_folder

from speechtrain.core.archive import ArchiveError, read_archive, write_archive
from speechtrain.data.manifest import ManifestError, read_nemo_manifest
from speechtrain.lightning import BaseCallback, CallbackGroup, checkpoint
from speechtrain.lightning.fault_tolerance import PREEMPTED_EXIT_CODE, NonFiniteLossError
from speechtrain.lightning.launch import fresh_launch_env

JOB = Path(__file__).with_name("fault_job.py")
ROOT = Path(__file__).resolve().parents[2]


class _Poison(BaseCallback):
    """Makes the CTC loss NaN on the given global steps and records whether each step changed the weights."""

    def __init__(self, steps) -> None:
        self.steps, self.changed, self.initial = set(steps), {}, None

    def on_train_start(self, trainer, pl_module):
        self.initial = {k: v.detach().clone() for k, v in pl_module.named_parameters()}
        original = pl_module.ctc_losses

        def poisoned(log_probs, lengths, batch):
            losses = original(log_probs, lengths, batch)
            return losses * float("nan") if trainer.global_step in self.steps else losses

        pl_module.ctc_losses = poisoned

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = [p.detach().clone() for p in pl_module.parameters()]
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.changed[self._step] = any(not torch.equal(a, p) for a, p in zip(self._before, pl_module.parameters()))


def _with(callback):
    CallbackGroup.get_instance().register(callback)
    return callback


def test_nan_loss_steps_are_skipped_counted_and_named(tmp_path, dtmf_manifest, caplog, fault):
    record = fault("NaN loss on 2 steps", injected=2)
    poison = _with(_Poison(steps=[2, 3]))
    with caplog.at_level(logging.WARNING, logger="speechtrain"):
        example_main()(example_job(tmp_path, dtmf_manifest, "trainer.max_epochs=1", "model.decoding.strategy=greedy"))
    assert poison.changed == {s: s not in (2, 3) for s in range(10)}  # one epoch of 10 batches
    warnings = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warnings) == 2 and "Step 2:" in warnings[0] and "(2 in a row, 2 in this run)" in warnings[1]
    assert "dtmf-" in warnings[0]  # the cut IDs of the batch
    weights = final_weights(tmp_path)
    assert all(torch.isfinite(w).all() for w in weights.values())
    record.survive(steps_lost=2)


def test_consecutive_nan_steps_stop_the_run_with_the_last_good_state_saved(tmp_path, dtmf_manifest, fault):
    record = fault("NaN loss on every step (patience 3)")
    poison = _with(_Poison(steps=range(100)))
    patience = "trainer.strategy.max_consecutive_nonfinite_steps=3"
    job = example_job(tmp_path, dtmf_manifest, "trainer.max_epochs=1", patience)
    with pytest.raises(NonFiniteLossError, match=r"3 consecutive steps .*cuts in this rank's batch: dtmf-.*saved in"):
        example_main()(job)
    (saved,) = (run_folder(tmp_path) / "checkpoints").glob("*last.ckpt")
    state = checkpoint.load_checkpoint(saved)["state_dict"]
    for key, value in poison.initial.items():  # no optimizer update ever happened (norm statistics still move)
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    assert not (run_folder(tmp_path) / "asr_demo.stm").exists()
    record.survive(steps_lost=3)


class _NanAudio(BaseCallback):
    """Puts NaN into the first utterance's audio at one step: NaN activations, loss and gradients."""

    def __init__(self, step: int) -> None:
        self.step, self.stats = step, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            batch["audio"][0, :1000] = float("nan")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        norms = [m for m in pl_module.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]
        self.stats[trainer.global_step] = all(torch.isfinite(m.running_mean).all() for m in norms) and norms != []


def test_nan_audio_skips_the_step_without_poisoning_batch_norm_statistics(tmp_path, dtmf_manifest, fault):
    record = fault("NaN in a batch's audio")
    nan = _with(_NanAudio(step=3))
    example_main()(example_job(tmp_path, dtmf_manifest, "trainer.max_epochs=1", "model.decoding.strategy=greedy"))
    assert all(nan.stats.values()) and len(nan.stats) == 10
    assert all(torch.isfinite(w).all() for w in final_weights(tmp_path).values())
    record.survive(steps_lost=1)


def test_an_archive_with_a_path_traversal_member_is_refused(tmp_path, fault):
    record = fault("archive with a ../ member")
    info = tarfile.TarInfo("../../escape.txt")
    info.size = 3
    with tarfile.open(tmp_path / "evil.stm", "w") as tar:
        tar.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(ArchiveError, match="unsafe path '../../escape.txt'"):
        read_archive(tmp_path / "evil.stm")
    assert not (tmp_path.parent.parent / "escape.txt").exists()
    record.survive(steps_lost=0)


class _Signal(BaseCallback):
    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_preemption_signal_saves_at_the_step_boundary_and_the_rerun_ends_identical(tmp_path, dtmf_manifest, name,
                                                                                 fault):  # fmt: skip
    record = fault(f"{name} mid-epoch (preemption)")
    every4 = "+exp_manager.checkpoint_callback_params.every_n_train_steps=4"
    common = ["trainer.max_epochs=2", every4, "model.optim.sched.name=constant", "model.decoding.strategy=greedy"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    example_main()(example_job(straight, dtmf_manifest, *common))
    stop = _with(_Signal(step=6, signum=getattr(signal, name)))
    with pytest.raises(SystemExit) as exit_info:
        example_main()(example_job(split, dtmf_manifest, *common))
    assert exit_info.value.code == PREEMPTED_EXIT_CODE
    CallbackGroup.get_instance().unregister(stop)
    assert signal.getsignal(signal.SIGTERM) is not None  # handlers restored after fit
    (last,) = (run_folder(split) / "checkpoints").glob("*last.ckpt")
    assert checkpoint.load_checkpoint(last)["global_step"] == 7  # step 6 finished, then saved
    assert not (run_folder(split) / "asr_demo.stm").exists()  # not mistaken for a finished run
    example_main()(example_job(split, dtmf_manifest, *common, "exp_manager.resume_if_exists=true"))
    expected, resumed = final_weights(straight), final_weights(split)
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=0, atol=0)
    record.survive(steps_lost=0)


def _run_job(args, env_extra, timeout=240):
    # A fresh process group: nothing of an earlier in-process run's rendezvous (MASTER_PORT, RANK, ...) is inherited.
    env = fresh_launch_env(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", SPEECHTRAIN_TELEMETRY="0",
                           PYTHONPATH=str(ROOT), **env_extra)  # fmt: skip
    return subprocess.run([sys.executable, str(JOB), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.multiprocess
def test_sigkill_mid_epoch_then_the_same_command_with_resume_ends_identical(tmp_path, dtmf_manifest, fault):
    record = fault("SIGKILL mid-epoch (checkpoint every 4 steps)")
    every4 = "+exp_manager.checkpoint_callback_params.every_n_train_steps=4"
    common = ["trainer.max_epochs=2", every4, "model.decoding.strategy=greedy", "trainer.accelerator=cpu"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    done = _run_job([*example_overrides(straight, dtmf_manifest), *common], {})
    assert done.returncode == 0, done.stderr[-3000:]
    killed = _run_job([*example_overrides(split, dtmf_manifest), *common], {"FAULT": "kill", "FAULT_STEP": "6"})
    assert killed.returncode == -signal.SIGKILL
    (last,) = (run_folder(split) / "checkpoints").glob("*last.ckpt")
    saved_step = checkpoint.load_checkpoint(last)["global_step"]
    resumed = _run_job([*example_overrides(split, dtmf_manifest), *common, "exp_manager.resume_if_exists=true"], {})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = final_weights(straight), final_weights(split)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
    record.survive(steps_lost=6 - saved_step)


@pytest.mark.slow  # (55 s; the default suite kills and resumes a TP=2 run: test_lightning_megatron_parity)
@pytest.mark.multiprocess
def test_dp2_with_dither_specaugment_and_dropout_killed_mid_epoch_resumes_bit_identical(tmp_path, dtmf_manifest,
                                                                                          fault):  # fmt: skip
    """Each data-parallel rank draws its own dither, SpecAugment masks and dropout: the checkpoint keeps every
    rank's random streams (it used to restore rank 0's on every rank, and the runs diverged)."""
    record = fault("SIGKILL mid-epoch at DP=2 with dither, SpecAugment and dropout")
    every2 = "+exp_manager.checkpoint_callback_params.every_n_train_steps=2"
    common = ["trainer.max_epochs=2", every2, "model.decoding.strategy=greedy", "trainer.accelerator=cpu",
              "trainer.devices=2", "model.preprocessor.dither=1.0e-2", "model.spec_augment.freq_masks=1",
              "model.spec_augment.time_masks=2", "model.encoder.dropout=0.2"]  # fmt: skip
    straight, split = tmp_path / "straight", tmp_path / "split"
    overrides = lambda folder: [o for o in example_overrides(folder, dtmf_manifest) if "dropout" not in o]  # noqa: E731
    done = _run_job([*overrides(straight), *common], {})
    assert done.returncode == 0, done.stderr[-3000:]
    killed = _run_job([*overrides(split), *common], {"FAULT": "kill", "FAULT_STEP": "5", "FAULT_RANK": "0"})
    assert killed.returncode == -signal.SIGKILL
    (last,) = (run_folder(split) / "checkpoints").glob("*last.ckpt")
    saved_step = checkpoint.load_checkpoint(last)["global_step"]
    assert 3 < saved_step <= 5  # inside the second epoch (3 batches per rank and epoch)
    resumed = _run_job([*overrides(split), *common, "exp_manager.resume_if_exists=true"], {})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = final_weights(straight), final_weights(split)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
    record.survive(steps_lost=5 - saved_step)


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank", [pytest.param(1, marks=pytest.mark.slow), 0])
def test_when_one_rank_raises_every_rank_exits_promptly_with_the_error_shown(tmp_path, dtmf_manifest, rank, fault):
    record = fault(f"exception on rank {rank} of 2 (DP)")
    marker = f"faultjob{uuid.uuid4().hex[:8]}"
    args = [*example_overrides(tmp_path, dtmf_manifest), f"name={marker}", "trainer.devices=2",
            "trainer.accelerator=cpu", "trainer.max_epochs=3", "model.decoding.strategy=greedy"]  # fmt: skip
    start = time.monotonic()
    result = _run_job(args, {"FAULT": "raise", "FAULT_STEP": "2", "FAULT_RANK": str(rank)}, timeout=180)
    seconds = time.monotonic() - start
    assert result.returncode != 0
    assert f"injected failure on rank {rank}" in result.stderr
    time.sleep(1.0)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes still running: {left}"
    assert seconds < 120
    record.survive(steps_lost=2)


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "empty"])
def test_a_damaged_checkpoint_is_refused_with_its_name(tmp_path, damage, fault):
    record = fault(f"{damage} checkpoint file")
    path = tmp_path / "last.ckpt"
    checkpoint.save_checkpoint({"step": 1, "w": torch.randn(1000)}, path)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "flipped byte":
        data[len(data) // 3] ^= 0xFF  # inside the tensor's bytes: torch alone would load wrong numbers
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"Checkpoint .*last.ckpt is (truncated or corrupt|corrupt)"):
        checkpoint.load_checkpoint(path)
    record.survive(steps_lost=0)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/speechtrain-pwned",))


def test_pickle_payloads_in_checkpoints_and_archives_are_refused(tmp_path, fault):
    record = fault("pickle payload in a checkpoint / an archive", injected=2)
    marker = Path("/tmp/speechtrain-pwned")
    marker.unlink(missing_ok=True)
    ckpt = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": _Payload()}, ckpt)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        checkpoint.load_checkpoint(ckpt)
    # An archive whose weights member is a pickle, with a manifest that vouches for it.
    good = write_archive(tmp_path / "good.stm", {"x": 1}, {"w": torch.ones(2)})
    members = {}
    with tarfile.open(good) as tar:
        for info in tar:
            members[info.name] = tar.extractfile(info).read()
    payload = io.BytesIO()
    torch.save({"w": _Payload()}, payload)
    members["model_weights.safetensors"] = payload.getvalue()
    manifest = json.loads(members["manifest.json"])
    data = payload.getvalue()
    manifest["members"]["model_weights.safetensors"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    members["manifest.json"] = json.dumps(manifest).encode()
    with tarfile.open(tmp_path / "evil.stm", "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ArchiveError, match="not a safetensors file.*never unpickled"):
        read_archive(tmp_path / "evil.stm")
    assert not marker.exists()
    record.survive(steps_lost=0)


def test_hostile_manifests_fail_cleanly(tmp_path, fault):
    record = fault("manifest with a 3 MiB line")
    huge = tmp_path / "huge.json"
    huge.write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "' + "a" * (3 << 20) + '"}\n')
    with pytest.raises(ManifestError, match=r"huge.json:1: line longer than"):
        list(read_nemo_manifest(huge))
    record.survive(steps_lost=0)


def test_a_config_cannot_make_the_trainer_import_a_class(tmp_path, dtmf_manifest, fault):
    record = fault("config naming a class (_target_) to import")
    job = example_job(tmp_path, dtmf_manifest, '+trainer.callbacks=[{_target_: os.system, command: "touch /tmp/x"}]')
    with pytest.raises(ValueError, match=r"trainer.callbacks\[0\].*_target_.*os.system.*not instantiated"):
        example_main()(job)
    record.survive(steps_lost=0)


def _losses(path):
    return [json.loads(line)["loss"] for line in Path(path).read_text().splitlines()]


@pytest.mark.multiprocess
@pytest.mark.slow  # (the default suite's resume tests compare a resumed run with an uninterrupted one)
@pytest.mark.parametrize("devices", [1, 2])
def test_the_same_seed_and_config_give_the_same_loss_curve(tmp_path, dtmf_manifest, devices):
    curves = []
    for attempt in range(2):
        folder = tmp_path / f"run{attempt}"
        args = [*example_overrides(folder, dtmf_manifest), f"trainer.devices={devices}", "trainer.accelerator=cpu",
                "trainer.max_steps=6", "model.decoding.strategy=greedy", "trainer.val_check_interval=6",
                "trainer.check_val_every_n_epoch=null"]  # fmt: skip
        result = _run_job(args, {"LOSS_LOG": str(folder / "losses.jsonl")})
        assert result.returncode == 0, result.stderr[-3000:]
        curves.append(_losses(folder / "losses.jsonl"))
    assert len(curves[0]) == 6 and curves[0] == curves[1]
