import json
import logging
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from speechtrain.lightning import CallbackGroup, TelemetryCallback, Trainer
from speechtrain.lightning.telemetry import infer_config

_RANK_VARS = ("RANK", "SLURM_PROCID", "EXP_NAME", "SLURM_JOB_NAME", "PERF_VERSION_TAG", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in _RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPEECHTRAIN_TELEMETRY", "1")
    TelemetryCallback.reset()
    yield
    TelemetryCallback.reset()


def _trainer(world=1, tp=1, pp=1, max_steps=100, micro=None, **extra):
    strategy = SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, micro_batch_size=micro)
    fields = {"world_size": world, "strategy": strategy, "max_steps": max_steps, "log_every_n_steps": 10,
              "val_check_interval": 1.0, "limit_val_batches": 1.0, "check_val_every_n_epoch": 1,
              "checkpoint_callbacks": [], "global_rank": 0, "loggers": [], **extra}  # fmt: skip
    return SimpleNamespace(**fields)


def _model(train_ds, d_model=144):
    cfg = OmegaConf.create({"sample_rate": 16000, "encoder": {"d_model": d_model}, "train_ds": train_ds})
    return SimpleNamespace(cfg=cfg)


# ----------------------------------------------------------------------------------------- config inference
def test_fixed_batch_size_times_data_parallel_size(monkeypatch):
    monkeypatch.setenv("EXP_NAME", "asr_exp")
    monkeypatch.setenv("PERF_VERSION_TAG", "1.2.0")
    config = infer_config(_trainer(world=4, max_steps=1000), _model({"batch_size": 8, "use_bucketing": False}))
    assert config["global_batch_size"] == 32 and config["micro_batch_size"] == 8
    assert config["data_parallel_size"] == 4 and config["world_size"] == 4
    assert config["seq_length"] == 144  # the encoder width, as NeMo's telemetry reports it
    assert config["train_iterations_target"] == 1000 and config["train_samples_target"] == 32_000
    assert config["perf_tag"] == "asr_exp_1.2.0_bf32_se144_ws4"
    assert config["batching"] == "batch_size"


def test_bucketed_batch_is_the_mean_bucket_batch_size_times_data_parallel_size():
    train_ds = {"use_bucketing": True, "bucket_batch_size": [10, 20, 35], "batch_size": None}
    config = infer_config(_trainer(world=2), _model(train_ds))
    assert config["global_batch_size"] == 21 * 2  # int(mean(10, 20, 35)) = 21
    assert config["batching"] == "bucket_batch_size"


@pytest.mark.parametrize(
    "train_ds",
    [
        {"batch_size": None, "bucket_batch_size": None, "batch_duration": 30.0},  # null keys (upstream crashed)
        {"batch_duration": 30.0},  # missing keys
        {"bucket_batch_size": [], "batch_size": None},
        None,
    ],
)
def test_null_or_missing_batch_keys_fall_back_to_an_unknown_global_batch(train_ds):
    config = infer_config(_trainer(world=2, max_steps=50), _model(train_ds))
    assert config["global_batch_size"] is None and config["train_samples_target"] is None
    assert config["micro_batch_size"] is None
    assert config["perf_tag"] == "speechtrain_0.0.0_bf0_se144_ws2"


def test_data_parallel_size_is_world_size_over_the_model_parallel_size():
    config = infer_config(_trainer(world=4, tp=2, micro=2), _model({"batch_size": 8}))
    assert config["world_size"] == 4 and config["tensor_parallel_size"] == 2 and config["data_parallel_size"] == 2
    assert config["global_batch_size"] == 16  # 8 per data-parallel rank, 2 data-parallel ranks (not 4)
    assert config["micro_batch_size"] == 2  # the strategy's pipeline micro-batch wins
    assert config["perf_tag"].endswith("_bf16_se144_ws4")


def test_session_tag_prefers_exp_name_then_the_slurm_job_name(monkeypatch):
    model = _model({"batch_size": 1})
    assert infer_config(_trainer(), model)["session_tag"] == "speechtrain"
    monkeypatch.setenv("SLURM_JOB_NAME", "slurm_job")
    assert infer_config(_trainer(), model)["session_tag"] == "slurm_job"
    monkeypatch.setenv("EXP_NAME", "exp")
    assert infer_config(_trainer(), model)["session_tag"] == "exp"


def test_validation_checkpointing_and_async_saves_are_read_from_the_trainer():
    model = _model({"batch_size": 1})
    config = infer_config(_trainer(), model)
    assert config["validation_enabled"] and not config["checkpointing_enabled"]
    assert config["checkpoint_strategy"] == "sync"
    asynchronous = SimpleNamespace(async_save=True)
    by_steps = infer_config(_trainer(val_check_interval=100, check_val_every_n_epoch=None), model)
    assert by_steps["validation_enabled"]
    config = infer_config(_trainer(limit_val_batches=0, checkpoint_callbacks=[asynchronous]), model)
    assert not config["validation_enabled"] and config["checkpointing_enabled"]
    assert config["checkpoint_strategy"] == "async"


# ---------------------------------------------------------------------------------------------- rank gating
@pytest.mark.parametrize(
    ("var", "value", "enabled"),
    [("RANK", "0", True), ("RANK", "3", False), ("SLURM_PROCID", "0", True), ("SLURM_PROCID", "1", False)],
)
def test_rank_gating_from_the_environment(monkeypatch, var, value, enabled):
    monkeypatch.setenv(var, value)
    telemetry = TelemetryCallback()
    telemetry.on_app_start()
    telemetry.update_config(trainer=_trainer(global_rank=0), model=_model({"batch_size": 4}))
    assert telemetry.enabled is enabled
    assert [r["event"] for r in telemetry.records()] == (["app_start", "config"] if enabled else [])


@pytest.mark.parametrize(("rank", "expected"), [(0, ["app_start", "config"]), (1, [])])
def test_without_rank_variables_the_trainer_decides_and_earlier_records_wait(rank, expected, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # an earlier test's group may linger
    telemetry = TelemetryCallback()
    telemetry.on_app_start()
    assert telemetry.enabled is None and telemetry.records() == []  # held back until the rank is known
    telemetry.update_config(trainer=_trainer(global_rank=rank), model=_model({"batch_size": 4}))
    assert [r["event"] for r in telemetry.records()] == expected


# ------------------------------------------------------------------------------------- singleton and app end
def test_the_callback_is_a_singleton_that_initialises_once_and_is_registered_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    first = TelemetryCallback()
    first.on_app_start()
    second = TelemetryCallback(output_dir=tmp_path)
    assert second is first and TelemetryCallback.get_instance() is first
    assert [r["event"] for r in second.records()] == ["app_start"]  # not re-initialised
    assert any(cb is first for cb in CallbackGroup.get_instance().callbacks)


def test_telemetry_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SPEECHTRAIN_TELEMETRY", "0")
    CallbackGroup.reset()
    assert not any(isinstance(cb, TelemetryCallback) for cb in CallbackGroup.get_instance().callbacks)


def test_app_end_is_recorded_once_with_the_job_duration_and_closes_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    telemetry = TelemetryCallback(output_dir=tmp_path)
    telemetry.on_app_start()
    telemetry.on_app_end()
    telemetry.on_app_end()
    lines = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert [r["event"] for r in lines] == ["app_start", "app_end"]
    assert lines[1]["duration_s"] >= 0


def test_a_failing_exporter_is_reported_once_and_dropped(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "0")

    class Broken:
        name = "broken"
        calls = 0

        def export(self, record):
            Broken.calls += 1
            raise OSError("disk full")

        def close(self):
            pass

    telemetry = TelemetryCallback(exporters=[Broken()])
    with caplog.at_level(logging.WARNING, logger="speechtrain.lightning.telemetry"):
        for _ in range(3):
            telemetry.on_model_init_start()
    assert Broken.calls == 1 and len(telemetry.records()) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "Telemetry exporter broken failed (OSError: disk full); it is switched off."
    ]


# ------------------------------------------------------------------------------------------ a real ASR run
def test_a_real_asr_training_run_writes_a_readable_telemetry_file(tmp_path, dtmf_manifest):
    from speechtrain.asr.conv_ctc import ConvCTCModel
    from speechtrain.core.exp_manager import exp_manager
    from tests.conftest import tiny_ctc_config

    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=6, log_every_n_steps=3, enable_progress_bar=False,
        enable_model_summary=False, logger=False, num_sanity_val_steps=0, val_check_interval=3,
    )  # fmt: skip
    run_dir = exp_manager(
        trainer,
        {"exp_dir": str(tmp_path), "version": "v1", "create_tensorboard_logger": False, "create_csv_logger": True,
         "save_archive_on_train_end": False,
         "checkpoint_callback_params": {"monitor": "val_wer", "every_n_train_steps": 3, "save_top_k": 1}},
        name="tele",
    )  # fmt: skip
    model = ConvCTCModel(tiny_ctc_config(dtmf_manifest))
    trainer.fit(model)
    CallbackGroup.get_instance().on_app_end()

    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    events = [r["event"] for r in records]
    assert events[:8] == ["app_start", "model_init_start", "model_init_end", "config", "dataloader_init_start",
                          "dataloader_init_end", "optimizer_init_start", "optimizer_init_end"]  # fmt: skip
    assert events[-1] == "app_end"
    saves = [(r["event"], r["global_step"]) for r in records if r["event"].startswith("save_checkpoint")]
    assert saves[:3] == [("save_checkpoint_start", 3), ("save_checkpoint_success", 3), ("save_checkpoint_end", 3)]
    assert all(r["duration_s"] >= 0 for r in records if r["event"].endswith("_end"))

    config = records[3]
    assert config["global_batch_size"] == 8 and config["seq_length"] == 16 and config["world_size"] == 1
    assert config["checkpointing_enabled"] and config["validation_enabled"]

    intervals = [r for r in records if r["event"] == "train_interval"]
    # Every 3 steps, and what is left when training ends; steps after a validation restart the clock.
    assert intervals[0]["steps"] == 3 and intervals[-1]["step"] == 6
    last = intervals[0]
    assert 1 <= last["measured_global_batch_size"] <= 8  # at most batch_size; the 40 s duration cap may close sooner
    assert last["audio_s_per_s"] > 0 and last["tokens_per_s"] > 0 and 0 <= last["padding_ratio"] < 1
    assert last["iteration_time_s"] > 0 and last["mean_frames_per_sample"] > 10

    # The same figures reach the Lightning loggers (CSV here).
    csv_text = (run_dir / "metrics.csv").read_text()
    assert "telemetry/audio_s_per_s" in csv_text.splitlines()[0]


def test_conformer_flops_match_torch_flop_counter():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from speechtrain.asr.conformer import ConformerConfig, ConformerEncoder, conformer_forward_flops

    shapes = (("striding", 4, (-1, -1)), ("dw_striding", 8, (-1, -1)), ("striding", 4, (1, 2)))  # (1, 2): U-Net
    for subsampling, factor, unet in shapes:
        cfg = ConformerConfig(
            d_model=32, num_layers=2, num_heads=2, conv_kernel_size=5, subsampling=subsampling,
            subsampling_factor=factor, subsampling_conv_channels=16, dropout=0.0, dropout_att=0.0,
            time_reduce_idx=unet[0], time_recovery_idx=unet[1],
        )  # fmt: skip
        encoder = ConformerEncoder(cfg, n_mels=20, seed=0).eval()
        frames = torch.tensor([301])
        # The math kernel of scaled_dot_product_attention: the counter has no formula for the fused CPU kernel.
        with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            encoder(torch.randn(1, 20, 301), frames)
        measured = counter.get_total_flops()
        estimate = float(conformer_forward_flops(cfg, 20, frames))
        assert estimate == pytest.approx(measured, rel=0.05), (subsampling, estimate, measured)


def test_a_failing_step_hook_switches_the_records_off_and_training_goes_on(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    telemetry = TelemetryCallback()
    model = _model({"batch_size": 2})
    model.flops_per_batch = lambda batch: 1 / 0
    trainer = _trainer(log_every_n_steps=1, global_step=1)
    telemetry.update_config(trainer=trainer, model=model)
    batch = {
        "audio": torch.zeros(2, 1600),
        "audio_lens": torch.tensor([1600, 800]),
        "token_lens": torch.tensor([3, 2]),
    }
    with caplog.at_level(logging.WARNING, logger="speechtrain.lightning.telemetry"):
        for step in range(4):
            telemetry.on_train_batch_end(trainer, model, None, batch, step)
    assert [r.getMessage() for r in caplog.records] == [
        "Telemetry's per-step records failed (ZeroDivisionError: division by zero); they are off for this run."
    ]
    assert not [r for r in telemetry.records() if r["event"] == "train_interval"]


def _fake_one_logger(monkeypatch):
    """A stand-in for nv-one-logger 2.3 (its module paths and call signatures), recording what it is sent."""
    import sys
    import types

    calls = []
    callbacks = types.ModuleType("nv_one_logger.training_telemetry.api.callbacks")
    for name in ("on_app_start", "on_model_init_start", "on_model_init_end", "on_save_checkpoint_start",
                 "on_save_checkpoint_success", "on_save_checkpoint_end", "on_app_end"):  # fmt: skip
        setattr(callbacks, name, lambda _name=name, **kwargs: calls.append((_name, sorted(kwargs))))

    class Provider:
        one_logger_ready = False
        _instance = None

        @classmethod
        def instance(cls):
            cls._instance = cls._instance or cls()
            return cls._instance

        def with_base_config(self, config):
            calls.append(("base_config", config.kwargs["session_tag_or_fn"]))
            return self

        def configure_provider(self):
            Provider.one_logger_ready = True

        def set_training_telemetry_config(self, config):
            calls.append(("training_config", config.kwargs["perf_tag_or_fn"]))

    class Config:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    modules = {
        "nv_one_logger": {}, "nv_one_logger.api": {}, "nv_one_logger.api.config": {"OneLoggerConfig": Config},
        "nv_one_logger.training_telemetry": {}, "nv_one_logger.training_telemetry.api": {},
        "nv_one_logger.training_telemetry.api.checkpoint": {
            "CheckPointStrategy": types.SimpleNamespace(SYNC="sync", ASYNC="async")},
        "nv_one_logger.training_telemetry.api.config": {"TrainingTelemetryConfig": Config},
        "nv_one_logger.training_telemetry.api.training_telemetry_provider": {"TrainingTelemetryProvider": Provider},
    }  # fmt: skip
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, callbacks.__name__, callbacks)
    sys.modules["nv_one_logger.training_telemetry.api"].callbacks = callbacks
    return calls


def test_one_logger_gets_the_config_and_the_events_replayed_with_their_times(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("EXP_NAME", "job")
    calls = _fake_one_logger(monkeypatch)
    telemetry = TelemetryCallback()
    telemetry.on_app_start()
    telemetry.on_model_init_start()
    telemetry.on_model_init_end()
    telemetry.update_config(trainer=_trainer(world=2), model=_model({"batch_size": 4}))
    telemetry.on_save_checkpoint_start(global_step=5)
    telemetry.on_save_checkpoint_success(global_step=5)
    telemetry.on_save_checkpoint_end(global_step=5)
    telemetry.on_app_end()
    assert calls == [
        ("base_config", "job"),
        ("on_app_start", ["start_time_msec"]),
        ("training_config", "job_0.0.0_bf8_se144_ws2"),
        ("on_model_init_start", ["start_time_msec"]),
        ("on_model_init_end", ["finish_time_msec"]),
        ("on_save_checkpoint_start", ["global_step", "start_time_msec"]),
        ("on_save_checkpoint_success", ["global_step", "time_msec"]),
        ("on_save_checkpoint_end", ["finish_time_msec"]),
        ("on_app_end", ["finish_time_msec"]),
    ]
