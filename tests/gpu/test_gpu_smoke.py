"""GPU smoke suite (``make gpu-check``): the bridge on CUDA with NCCL, skipped without CUDA.

Each test launches real processes (one GPU each) with the same jobs the CPU suite runs on gloo: DP=2 and TP=2
parity with the CPU reference, bf16-mixed and 16-mixed training of the demo ASR model, an empty batch and a
text-only SALM batch on one rank, the distributed optimizer with a kill and resume, and a preemption signal.
Under 5 minutes on one 8-GPU node; tests that need two GPUs skip on a single-GPU machine.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
LIGHTNING = ROOT / "tests" / "lightning"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA device")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "4", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def _torchrun(nproc: int, script: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}", str(script), *args]  # fmt: skip
    return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)


def _losses(out: Path) -> list[float]:
    records = [torch.load(p, weights_only=False) for p in sorted(out.glob("rank*.pt"))]
    return records[0]["losses"]


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu")
    result = subprocess.run([sys.executable, str(LIGHTNING / "parallel_job.py"), "--plain", "--out", str(out)],
                            env=_env(), capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return _losses(out)


@two_gpus
@pytest.mark.parametrize(
    "layout",
    [["--devices", "2"], ["--devices", "2", "--tp", "2"], ["--devices", "2", "--distributed-optimizer"]],
    ids=["dp2", "tp2", "distopt"],
)
def test_toy_transformer_on_gpus_matches_the_cpu_reference(layout, cpu_reference, tmp_path):
    result = _torchrun(2, LIGHTNING / "parallel_job.py", "--accelerator", "gpu", "--out", str(tmp_path), *layout)
    assert result.returncode == 0, result.stderr[-4000:]
    torch.testing.assert_close(torch.tensor(_losses(tmp_path)), torch.tensor(cpu_reference), rtol=1e-4, atol=0)


@two_gpus
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_on_gpus_stays_close_to_fp32(precision, cpu_reference, tmp_path):
    result = _torchrun(2, LIGHTNING / "parallel_job.py", "--accelerator", "gpu", "--devices", "2", "--precision",
                       precision, "--out", str(tmp_path))  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    torch.testing.assert_close(torch.tensor(_losses(tmp_path)), torch.tensor(cpu_reference), rtol=5e-2, atol=0)


@two_gpus
@pytest.mark.parametrize("case", ["empty", "text-only"])
def test_uneven_batches_under_nccl_finish_with_the_reference_gradients(case, tmp_path):
    out = tmp_path / "result.json"
    result = _torchrun(2, LIGHTNING / "engine_job.py", "--case", case, "--device", "cuda", "--out", str(out),
                       timeout=180)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["max_difference"] < 1e-4, report


@two_gpus
def test_distributed_optimizer_killed_and_resumed_on_gpus_equals_the_uninterrupted_run(tmp_path):
    common = ["--accelerator", "gpu", "--devices", "2", "--distributed-optimizer", "--global-batch", "16",
              "--steps", "6"]  # fmt: skip
    straight = _torchrun(2, LIGHTNING / "parallel_job.py", *common, "--out", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-4000:]
    ckpt = tmp_path / "ckpt"
    killed = _torchrun(2, LIGHTNING / "parallel_job.py", *common, "--ckpt-dir", str(ckpt), "--save-every", "4",
                       "--kill-at", "4", "--out", str(tmp_path / "killed"))  # fmt: skip
    assert killed.returncode != 0
    resumed = _torchrun(2, LIGHTNING / "parallel_job.py", *common, "--resume", str(ckpt / "step=4.ckpt"),
                        "--out", str(tmp_path / "resumed"))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")[4:]


def _asr_command(tmp_path: Path, manifest: Path, devices: int, *extra: str) -> list[str]:
    from speechtrain.asr.tokenizers import CharTokenizer

    tokenizer = tmp_path / "digits.json"
    CharTokenizer([" ", *"0123456789"]).save(tokenizer)
    return [sys.executable, str(ROOT / "examples" / "asr_train.py"), f"trainer.devices={devices}",
            "trainer.accelerator=gpu", "trainer.max_time=null", "trainer.max_steps=20", "trainer.limit_val_batches=2",
            "trainer.enable_progress_bar=false", f"exp_manager.exp_dir={tmp_path / 'exp'}",
            f"model.train_ds.manifest_filepath={manifest}", f"model.validation_ds.manifest_filepath={manifest}",
            f"model.tokenizer.path={tokenizer}", "model.decoding.strategy=greedy",
            "model.train_ds.batch_duration=null", "model.train_ds.batch_size=16",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def dtmf(tmp_path_factory):
    from speechtrain.data.synthetic import make_dtmf_corpus

    return make_dtmf_corpus(tmp_path_factory.mktemp("dtmf"), 128, seed=7)


@two_gpus
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_demo_asr_model_trains_20_steps_at_dp2_in_mixed_precision(precision, dtmf, tmp_path):
    result = subprocess.run(_asr_command(tmp_path, dtmf, 2, f"trainer.precision={precision}"), env=_env(),
                            capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Final:" in result.stdout


def test_preemption_signal_on_a_gpu_saves_and_exits_75(dtmf, tmp_path):
    command = _asr_command(tmp_path, dtmf, 1, "trainer.max_steps=100000")
    process = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(60)  # start-up and some steps
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr[-4000:]
    assert list((tmp_path / "exp").rglob("*last.ckpt"))
