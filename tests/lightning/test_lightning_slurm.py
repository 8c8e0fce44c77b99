import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.plugins.environments import slurm as lightning_slurm

import speechtrain.lightning  # noqa: F401  (importing applies the patch)
from speechtrain.lightning import is_slurm_interactive_mode, patch_slurm_interactive_mode


@pytest.fixture(autouse=True)
def no_slurm_variables(monkeypatch):
    for name in ("SLURM_JOB_NAME", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)


def test_import_installs_the_patch_in_lightning():
    assert lightning_slurm._is_slurm_interactive_mode is is_slurm_interactive_mode


@pytest.mark.parametrize("job_name", ["", None, "bash", "user-bash", "interactive", "my/interactive"])
def test_interactive_job_names(monkeypatch, job_name):
    if job_name is not None:
        monkeypatch.setenv("SLURM_JOB_NAME", job_name)
    assert lightning_slurm._is_slurm_interactive_mode() is True


@pytest.mark.parametrize("job_name", ["train_job", "bash_training", "interactive-asr", "train"])
def test_batch_job_names(monkeypatch, job_name):
    monkeypatch.setenv("SLURM_JOB_NAME", job_name)
    assert lightning_slurm._is_slurm_interactive_mode() is False


def test_lightning_does_not_take_an_interactive_allocation_for_an_srun_job(monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "user-bash")
    assert SLURMEnvironment.detect() is False
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert SLURMEnvironment.detect() is True


def test_interactive_allocation_gets_no_job_id_in_lightning(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NAME", "user-bash")
    assert SLURMEnvironment.job_id() is None
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert SLURMEnvironment.job_id() == 4242


def test_patch_is_idempotent():
    patch_slurm_interactive_mode()
    patch_slurm_interactive_mode()
    assert lightning_slurm._is_slurm_interactive_mode is is_slurm_interactive_mode
