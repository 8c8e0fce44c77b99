"""W&B and MLflow loggers from NeMo's exp_manager keys, tested offline (W&B offline mode, MLflow file store): the
logged metrics, the job config and the final archive path arrive."""

import importlib.util

import pytest
from conftest import example_job, example_main, run_folder

from speechtrain.core.exp_manager import ExpManagerConfig, tracker_loggers

HAVE_WANDB = importlib.util.find_spec("wandb") is not None
HAVE_MLFLOW = importlib.util.find_spec("mlflow") is not None


@pytest.mark.skipif(not (HAVE_WANDB or HAVE_MLFLOW), reason="neither wandb nor mlflow is installed")
def test_offline_trackers_receive_metrics_config_and_final_archive(tmp_path, dtmf_manifest, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    overrides = ["trainer.max_epochs=1", f"exp_manager.create_wandb_logger={HAVE_WANDB}",
                 "exp_manager.wandb_logger_kwargs={project: speechtrain-test, offline: true}",
                 f"exp_manager.create_mlflow_logger={HAVE_MLFLOW}"]  # fmt: skip
    example_main()(example_job(tmp_path, dtmf_manifest, *overrides))
    archive = str(run_folder(tmp_path) / "asr_demo.stm")
    if HAVE_WANDB:
        import wandb

        run = wandb.run
        assert run.summary["val_wer"] >= 0 and run.config["model"]["encoder"]["d_model"] == 16
        assert run.config["final_archive"] == archive
        wandb.finish()
        wandb.teardown()  # stops the W&B service, which writes the run file
        # The offline run file (what `wandb sync` uploads) holds them: W&B's records are uncompressed protobuf.
        (record,) = (run_folder(tmp_path) / "wandb").glob("offline-run-*/run-*.wandb")
        data = record.read_bytes()
        assert b"val_wer" in data and b"final_archive" in data and archive.encode() in data
    if HAVE_MLFLOW:
        (run_dir,) = [p for p in (tmp_path / "exp" / "mlruns").glob("*/*") if (p / "params").is_dir()]
        assert (run_dir / "metrics" / "val_wer").is_file() and (run_dir / "metrics" / "val_loss").is_file()
        assert (run_dir / "params" / "model" / "encoder" / "d_model").read_text() == "16"
        assert (run_dir / "params" / "final_archive").read_text() == archive
        assert (run_dir / "tags" / "mlflow.runName").read_text() == run_folder(tmp_path).name


def test_a_missing_tracker_package_is_named(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    message = r"create_wandb_logger=true needs the wandb package: pip install 'speechtrain\[trackers\]'"
    with pytest.raises(ImportError, match=message):
        tracker_loggers(ExpManagerConfig(create_wandb_logger=True), tmp_path, "n", "v", tmp_path)
