"""NeMo training YAMLs (CTC, and the transducers: RNN-T, TDT, hybrid) are translated key by key (never imported) and
build our model."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speechtrain.asr.ctc import ConformerCTCConfig, ConformerCTCModel
from speechtrain.asr.nemo_config import is_nemo_config, translate_if_nemo, translate_nemo_config
from speechtrain.asr.transducer import ConformerTransducerConfig, ConformerTransducerModel
from speechtrain.common.config import ConfigError
from speechtrain.common.tokenizers import train_sentencepiece
from speechtrain.core.hydra_runner import compose_config
from speechtrain.core.job import train_job_schema
from speechtrain.core.model import SpeechModel

CONF = Path(__file__).parent / "nemo_conf"
NAME = "fast-conformer_ctc_bpe"
SCHEMA = train_job_schema(ConformerCTCConfig)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    texts = [f"the {w} sat on the mat number {i}" for i, w in enumerate(["cat", "dog", "bird", "fish"] * 20)]
    train_sentencepiece(texts, out, vocab_size=40)
    return out


def test_the_published_fast_conformer_yaml_composes_translates_and_builds_on_meta(tokenizer_dir, caplog):
    overrides = [f"model.tokenizer.dir={tokenizer_dir}", "model.train_ds.manifest_filepath=train.json",
                 "model.validation_ds.manifest_filepath=dev.json", "model.optim.sched.name=NoamAnnealing",
                 "model.optim.sched.warmup_steps=null", "model.optim.sched.warmup_ratio=0.05",
                 "model.interctc.loss_weights=[0.3]", "model.interctc.apply_at_layers=[8]"]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="speechtrain.asr.nemo_config"):
        cfg = compose_config(CONF, NAME, overrides, SCHEMA, translate_if_nemo)
    assert (cfg.model.interctc.loss_weights, cfg.model.interctc.apply_at_layers) == ([0.3], [8])  # at layer 8
    enc = cfg.model.encoder
    assert (enc.num_layers, enc.d_model, enc.num_heads, enc.subsampling, enc.subsampling_factor) == (
        18, 512, 8, "dw_striding", 8)  # fmt: skip
    assert enc.xscaling is True and enc.conv_kernel_size == 9 and cfg.model.preprocessor.n_mels == 80
    assert cfg.model.tokenizer.path == str(tokenizer_dir / "tokenizer.model")
    assert cfg.model.optim.sched.name == "NoamAnnealing" and cfg.model.optim.sched.warmup_ratio == 0.05
    assert cfg.model.optim.sched.min_lr == 1e-4 and cfg.model.optim.betas == [0.9, 0.98]
    assert cfg.model.train_ds.batch_size == 16 and cfg.model.train_ds.shuffle_buffer_size == 2048
    assert cfg.model.train_ds.manifest_filepath == "train.json" and cfg.model.train_ds.max_duration == 16.7
    assert cfg.trainer.strategy == {} and cfg.trainer.sync_batchnorm is False and cfg.trainer.devices == -1
    assert cfg.exp_manager.checkpoint_callback_params.save_top_k == 5 and cfg.name == "FastConformer-CTC-BPE"
    lines = [r.getMessage() for r in caplog.records]
    assert "nemo: model.encoder.n_layers=18 -> model.encoder.num_layers=18" in lines
    assert "nemo: model.encoder.n_heads=8 -> model.encoder.num_heads=8" in lines
    assert any(line.startswith("nemo: trainer.strategy=ddp -> trainer.strategy={}") for line in lines)
    assert any(line.startswith("nemo: model.encoder._target_=nemo.collections.asr.modules.ConformerEncoder") for line
               in lines)  # fmt: skip
    model = ConformerCTCModel(cfg.model)  # the tokenizer and config; the layers are built by configure_model
    with torch.device("meta"):  # the weights (the log-mel front end has none, and torchaudio needs real tensors)
        encoder, width = model.build_encoder()
        head = torch.nn.Linear(width, model.tokenizer.vocab_size + 1)
    assert all(p.is_meta for p in encoder.parameters())
    parameters = sum(p.numel() for p in [*encoder.parameters(), *head.parameters()])
    # NeMo's FastConformer-CTC large is ~115M parameters (its 1024-piece vocabulary adds 0.5M to the head).
    assert 100e6 < parameters < 120e6, parameters


def test_values_that_cannot_be_honoured_are_all_refused_by_name(tokenizer_dir):
    overrides = [f"model.tokenizer.dir={tokenizer_dir}", "model.encoder.self_attention_model=abs_pos",
                 "model.optim.name=novograd", "model.tokenizer.type=wpe", "trainer.strategy=fsdp",
                 "model.encoder.stochastic_depth_drop_prob=0.1", "+model.encoder.n_layerz=3"]  # fmt: skip
    with pytest.raises(ConfigError) as error:
        compose_config(CONF, NAME, overrides, SCHEMA, translate_if_nemo)
    message = str(error.value)
    for culprit in ("model.encoder.self_attention_model=abs_pos", "model.optim.name=novograd",
                    "model.tokenizer.type=wpe", "trainer.strategy=fsdp", "model.encoder.stochastic_depth_drop_prob",
                    "model.encoder.n_layerz=3: no speechtrain equivalent"):  # fmt: skip
        assert culprit in message
    assert "6 setting(s)" in message or "7 setting(s)" in message


def test_nemo_ema_keys_map_and_cpu_offload_is_refused(tokenizer_dir):
    base = [f"model.tokenizer.dir={tokenizer_dir}", "+exp_manager.ema.enable=true", "+exp_manager.ema.decay=0.99",
            "+exp_manager.ema.validate_original_weights=false"]  # fmt: skip
    cfg = compose_config(CONF, NAME, [*base, "+exp_manager.ema.cpu_offload=false"], SCHEMA, translate_if_nemo)
    ema = cfg.exp_manager.ema
    assert (ema.enable, ema.decay, ema.every_n_steps, ema.validate_original_weights) == (True, 0.99, 1, False)
    with pytest.raises(ConfigError, match=r"exp_manager\.ema=.*weights' device"):
        compose_config(CONF, NAME, [*base, "+exp_manager.ema.cpu_offload=true"], SCHEMA, translate_if_nemo)


def test_another_nemo_class_is_refused_and_never_imported():
    cfg = {"model": {"encoder": {"_target_": "nemo.collections.asr.modules.ConvASREncoder", "jasper": []}}}
    assert is_nemo_config(cfg) and not is_nemo_config({"model": {"encoder": {"d_model": 3}}})
    with pytest.raises(ConfigError, match="has no ConvASREncoder encoder"):
        translate_nemo_config(cfg)
    assert "nemo" not in sys.modules


@pytest.mark.parametrize(
    ("name", "override", "printed", "absent", "logged"),
    [
        (NAME, "model.encoder.n_layers=2", ["num_layers: 2"], "n_layers",
         "nemo: model.encoder.n_layers=2 -> model.encoder.num_layers=2"),
        # a transducer YAML: its model.loss makes the script pick the transducer's schema
        ("fastconformer_hybrid_tdt_ctc_bpe", "model.decoder.prednet.pred_rnn_layers=2", ["loss: tdt",
         "pred_rnn_layers: 2"], "prednet", "nemo: model.decoder.prednet.pred_rnn_layers=2 -> "
         "model.prediction.pred_rnn_layers=2"),
    ],
)  # fmt: skip
def test_the_training_script_takes_a_nemo_yaml_and_prints_the_translated_config(
    tokenizer_dir, name, override, printed, absent, logged
):
    script = Path(__file__).parents[2] / "examples" / "asr_train.py"
    result = subprocess.run(
        [sys.executable, str(script), "--config-path", str(CONF), "--config-name", name, "--cfg",
         f"model.tokenizer.dir={tokenizer_dir}", override],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert all(line in result.stdout for line in printed) and absent not in result.stdout
    assert logged in result.stderr


# ------------------------------------------------------------------------------------------------ transducers
HYBRID_TDT = "fastconformer_hybrid_tdt_ctc_bpe"
TRANSDUCER_SCHEMA = train_job_schema(ConformerTransducerConfig)


def test_the_published_hybrid_tdt_ctc_yaml_translates_into_a_transducer(tokenizer_dir, caplog):
    overrides = [f"model.tokenizer.dir={tokenizer_dir}", "model.train_ds.manifest_filepath=train.json",
                 "model.validation_ds.manifest_filepath=dev.json",
                 # keys of NeMo's newer YAMLs (fast-conformer_transducer_bpe.yaml)
                 "+model.encoder.use_pytorch_sdpa=false", "+model.encoder.use_pytorch_sdpa_backends=[]"]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="speechtrain.asr.nemo_config"):
        cfg = compose_config(CONF, HYBRID_TDT, overrides, TRANSDUCER_SCHEMA, translate_if_nemo)
    model = cfg.model
    assert (model.loss, model.durations, model.sigma, model.omega) == ("tdt", [0, 1, 2, 3, 4], 0.02, 0.1)
    assert model.hybrid is True and model.ctc_loss_weight == 0.3 and model.ctc_reduction == "mean_batch"
    assert (model.prediction.pred_hidden, model.prediction.pred_rnn_layers, model.prediction.dropout) == (640, 1, 0.2)
    joint = model.joint
    assert (joint.joint_hidden, joint.activation, joint.dropout, joint.fused_batch_size, joint.frame_stack) == (
        640, "relu", 0.2, 4, 1)  # fmt: skip
    assert (model.decoding.strategy, model.decoding.max_symbols, model.decoding.beam_size) == ("greedy", 10, 2)
    assert model.encoder.num_layers == 17 and model.preprocessor.n_mels == 128
    assert cfg.trainer.strategy == {} and cfg.name == "FastConformer-Hybrid-TDT-CTC-BPE"
    lines = [r.getMessage() for r in caplog.records]
    assert "nemo: model.loss.loss_name=tdt -> model.loss=tdt" in lines
    assert "nemo: model.decoder.prednet.pred_hidden=640 -> model.prediction.pred_hidden=640" in lines
    assert "nemo: model.joint.jointnet.joint_hidden=640 -> model.joint.joint_hidden=640" in lines
    assert any(line.startswith("nemo: model.aux_ctc is set -> model.hybrid=True") for line in lines)
    assert any(line.startswith("nemo: trainer.strategy=ddp -> trainer.strategy={}") for line in lines)
    from speechtrain.asr.jobs import asr_model_class

    assert asr_model_class(model) is ConformerTransducerModel


def test_the_published_transducer_yaml_translates_into_an_rnnt(tokenizer_dir):
    cfg = compose_config(CONF, "fast-conformer_transducer_bpe", [f"model.tokenizer.dir={tokenizer_dir}"],
                         TRANSDUCER_SCHEMA, translate_if_nemo)  # fmt: skip
    model = cfg.model
    assert (model.loss, model.hybrid, model.ctc_reduction) == ("rnnt", False, "mean_volume")
    assert model.decoding.max_symbols == 10
    assert (model.prediction.pred_hidden, model.joint.joint_hidden, model.joint.fused_batch_size) == (640, 640, 4)
    assert model.encoder.num_layers == 17 and model.optim.sched.name == "CosineAnnealing"
    assert cfg.trainer.strategy == {} and cfg.trainer.gradient_clip_val == 0.0


def test_a_plain_rnnt_yaml_and_the_transducer_refusals(tokenizer_dir):
    base = [f"model.tokenizer.dir={tokenizer_dir}", "~model.aux_ctc", "model.loss.loss_name=default"]
    cfg = compose_config(CONF, HYBRID_TDT, base + ["~model.loss.tdt_kwargs", "~model.joint.num_extra_outputs",
                                                   "model.decoding.model_type=rnnt"], TRANSDUCER_SCHEMA,
                         translate_if_nemo)  # fmt: skip
    assert cfg.model.loss == "rnnt" and cfg.model.hybrid is False
    bad = [f"model.tokenizer.dir={tokenizer_dir}", "model.loss.tdt_kwargs.fastemit_lambda=0.001",
           "model.decoder.normalization_mode=layer", "model.joint.jointnet.activation=gelu",
           "+model.decoder.prednet.rnn_hidden_size=1024", "model.decoding.strategy=wfst"]  # fmt: skip
    with pytest.raises(ConfigError) as error:
        compose_config(CONF, HYBRID_TDT, bad, TRANSDUCER_SCHEMA, translate_if_nemo)
    message = str(error.value)
    for culprit in ("model.loss.tdt_kwargs.fastemit_lambda=0.001: FastEmit is not implemented",
                    "model.decoder.normalization_mode=layer", "model.joint.jointnet.activation=gelu",
                    "model.decoder.prednet.rnn_hidden_size=1024", "model.decoding.strategy=wfst"):  # fmt: skip
        assert culprit in message
    assert "5 setting(s)" in message
    with pytest.raises(ConfigError, match="model.loss.loss_name=multiblank_rnnt"):
        compose_config(CONF, HYBRID_TDT, [f"model.tokenizer.dir={tokenizer_dir}",
                                          "model.loss.loss_name=multiblank_rnnt"], TRANSDUCER_SCHEMA,
                       translate_if_nemo)  # fmt: skip


def test_a_nemo_hybrid_tdt_yaml_trains_and_writes_a_transducer_archive(tmp_path, dtmf_manifest):
    """The translated YAML is a job the training script runs: 3 steps on DTMF, shrunk with NeMo's own key names."""
    import json

    from conftest import example_main

    texts = [json.loads(line)["text"] for line in Path(dtmf_manifest).read_text().splitlines()]
    train_sentencepiece(texts * 4, tmp_path / "tok", vocab_size=14)
    overrides = [
        f"model.tokenizer.dir={tmp_path / 'tok'}", f"model.train_ds.manifest_filepath={dtmf_manifest}",
        f"model.validation_ds.manifest_filepath={dtmf_manifest}", "model.encoder.n_layers=1",
        "model.encoder.d_model=16", "model.encoder.n_heads=2", "model.encoder.subsampling=striding",
        "model.encoder.subsampling_factor=2", "model.encoder.subsampling_conv_channels=8",
        "model.encoder.conv_kernel_size=3", "model.preprocessor.features=16", "model.spec_augment.time_masks=1",
        "model.model_defaults.pred_hidden=16", "model.model_defaults.joint_hidden=16",
        "model.train_ds.batch_size=8", "model.train_ds.num_workers=0", "model.validation_ds.num_workers=0",
        "model.optim.sched.warmup_steps=1", "trainer.max_steps=3", "trainer.val_check_interval=3",
        "trainer.check_val_every_n_epoch=null", "trainer.devices=1", "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"exp_manager.exp_dir={tmp_path}",
        "exp_manager.create_tensorboard_logger=false",
    ]  # fmt: skip
    cfg = compose_config(CONF, HYBRID_TDT, overrides, TRANSDUCER_SCHEMA, translate_if_nemo)
    model = example_main()(cfg)
    assert isinstance(model, ConformerTransducerModel) and model.trainer.global_step == 3
    assert model.cfg.loss == "tdt" and model.cfg.hybrid and model.joint.out.out_features == 14 + 1 + 5
    (archive,) = tmp_path.rglob("FastConformer-Hybrid-TDT-CTC-BPE.stm")
    assert type(SpeechModel.restore_from(archive)) is ConformerTransducerModel
