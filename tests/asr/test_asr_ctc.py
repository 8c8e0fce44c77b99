import dataclasses
import importlib.util
import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from speechtrain.asr.ctc import MODEL_SIZES, ConformerCTCModel, validation_set_name
from speechtrain.common.config import ConfigError
from speechtrain.common.tokenizers import CharTokenizer, train_sentencepiece
from speechtrain.core.model import SpeechModel, check_validation_schedule
from speechtrain.data.cut_datasets import AsrCutDataset
from speechtrain.data.lhotse_loader import CutBatch, LoaderConfig, read_cuts
from speechtrain.lightning import MegatronStrategy, Trainer

DIGITS = [" ", *"0123456789"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _config(manifest=None, tokenizer=None, **extra):
    return {
        "size": "debug",
        "tokenizer": {"path": str(tokenizer)} if tokenizer else {"vocab": DIGITS},
        "preprocessor": {"n_mels": 16, "dither": 0.0},
        "spec_augment": None,
        "encoder": {"d_model": 16, "num_heads": 2, "num_layers": 1, "subsampling_conv_channels": 8,
                    "subsampling_factor": 2, "dropout": 0.0, "dropout_att": 0.0},
        "train_ds": {"manifest_filepath": str(manifest) if manifest else None, "batch_size": 8,
                     "batch_duration": None, "num_workers": 0},
        "validation_ds": {"manifest_filepath": str(manifest) if manifest else None, "batch_size": 16,
                          "batch_duration": None},
        "optim": {"lr": 3e-3, "sched": {"name": "cosine", "warmup_steps": 2, "min_lr": 1e-5}},
        **extra,
    }  # fmt: skip


def _batch(manifest, model, count=6):
    cuts = read_cuts(LoaderConfig(manifest_filepath=str(manifest))).subset(first=count)
    return AsrCutDataset(model.tokenizer)[CutBatch(cuts, 0)]


def test_a_deferred_pretrained_start_loads_the_self_conditioning_projection_too():
    """init_from_pretrained_when_built (examples/asr_finetune.py) loads every layer, the self-conditioning
    projection built after the CTC head included (it was left at its random initialisation)."""
    encoder = {**_config()["encoder"], "num_layers": 2}
    cfg = _config(encoder=encoder, interctc={"loss_weights": [0.3], "apply_at_layers": [0], "self_conditioning": True})
    torch.manual_seed(1)
    base = ConformerCTCModel(cfg)
    base.configure_model()
    torch.manual_seed(2)
    model = ConformerCTCModel(cfg)
    model.init_from_pretrained_when_built(base)
    model.configure_model()
    state, old = model.state_dict(), base.state_dict()
    assert state.keys() == old.keys() and any(k.startswith("conditioning.") for k in old)
    assert all(torch.equal(state[k], v) for k, v in old.items())


def test_sizes_fill_the_encoder_and_explicit_keys_win():
    model = ConformerCTCModel({"size": "small", "tokenizer": {"vocab": DIGITS}, "encoder": {"num_layers": 2}})
    assert model.cfg.encoder.d_model == MODEL_SIZES["small"]["d_model"] and model.cfg.encoder.num_layers == 2
    with pytest.raises(ValueError, match="Unknown model.size='huge'"):
        ConformerCTCModel({"size": "huge", "tokenizer": {"vocab": DIGITS}})


def _another_value(value, key=""):
    if key.startswith("time_re"):  # a layer index of the temporal U-Net: the next layer (still a valid span)
        return value + 1 if value >= 0 else value
    # The streaming keys: values valid beside every size (a limited context would clash with the demo's U-Net).
    streaming = {"att_context_size": [[-1, -1]], "att_context_probs": [1.0], "conv_context_size": "causal",
                 "att_context_style": "regular"}  # fmt: skip
    if key in streaming:
        return streaming[key]
    alternatives = {"batch_norm": "layer_norm", "layer_norm": "batch_norm", "striding": "dw_striding",
                    "dw_striding": "striding"}  # fmt: skip
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        return alternatives[value]
    return value * 2 + 1 if isinstance(value, int) else round(value + 0.25, 2)


@pytest.mark.parametrize("size", ["demo", "large"])
def test_every_explicit_encoder_key_wins_over_the_size_even_at_its_default(size):
    from speechtrain.asr.conformer import ConformerConfig
    from speechtrain.asr.ctc import ConformerCTCConfig
    from speechtrain.common.config import validate_config
    from speechtrain.core.job import train_job_schema

    schema = train_job_schema(ConformerCTCConfig)
    defaults = dataclasses.asdict(ConformerConfig())
    sized = {**defaults, **MODEL_SIZES[size]}
    for key, default in defaults.items():
        # (one end of the U-Net's span alone at its default -1 would be a half-configured U-Net: a clear error)
        spans = key.startswith("time_re") and sized[key] >= 0
        for value in (_another_value(sized[key], key),) if spans else (default, _another_value(sized[key], key)):
            job = validate_config({"model": {"size": size, "tokenizer": {"vocab": DIGITS},
                                             "encoder": {key: value}}}, schema)  # fmt: skip
            encoder = ConformerCTCModel(job.model).cfg.encoder
            assert encoder[key] == value, (size, key, value)
            assert {k: v for k, v in encoder.items() if k != key} == {k: v for k, v in sized.items() if k != key}
    # The command line of issue 19: model.size=demo model.encoder.dropout=0.1 trains with dropout 0.1.
    from speechtrain.core.hydra_runner import compose_config

    overrides = ["model.size=demo", "model.encoder.dropout=0.1", "model.tokenizer.vocab=[a,b]"]
    cfg = compose_config(EXAMPLES / "conf", "asr_train", overrides, schema)
    assert ConformerCTCModel(cfg.model).cfg.encoder.dropout == 0.1


@pytest.mark.parametrize("reduction", ["mean_volume", "mean_batch"])
def test_ctc_reductions(dtmf_manifest, reduction):
    torch.manual_seed(0)
    model = ConformerCTCModel(_config(ctc_reduction=reduction))
    batch = _batch(dtmf_manifest, model)
    log_probs, lengths = model.forward_step(batch)
    loss_sum, count = model.loss_step(batch, (log_probs, lengths))
    per_utterance = F.ctc_loss(log_probs.transpose(0, 1), batch["tokens"], lengths, batch["token_lens"],
                               blank=len(DIGITS), reduction="none")  # fmt: skip
    torch.testing.assert_close(loss_sum, per_utterance.sum())
    expected_count = batch["token_lens"].sum() if reduction == "mean_volume" else torch.tensor(6)
    assert int(count) == int(expected_count)
    assert log_probs.shape[-1] == len(DIGITS) + 1 and log_probs.dtype == torch.float32


def test_intermediate_ctc_weights_the_captured_layers_losses_like_nemo(dtmf_manifest):
    """model.interctc (NeMo's keys): in training the loss is (1 - sum w) * final + sum w_i * CTC(layer i's output
    through the same head), reduced like CTC; evaluation and decoding read the final layer only."""
    torch.manual_seed(0)
    encoder = {**_config()["encoder"], "num_layers": 3}
    model = ConformerCTCModel(_config(encoder=encoder, interctc={"loss_weights": [0.2, 0.3],
                                                                 "apply_at_layers": [1, 0]}))  # fmt: skip
    batch = _batch(dtmf_manifest, model)
    model.train()
    log_probs, lengths, captured = model.forward_step(batch)
    loss_sum, count = model.loss_step(batch, (log_probs, lengths, captured))
    layers = []
    hooks = [layer.register_forward_hook(lambda m, args, out: layers.append(out)) for layer in model.encoder.layers]
    with torch.no_grad():
        final, _ = model(batch["audio"], batch["audio_lens"])
    for hook in hooks:
        hook.remove()

    def ctc(lp):
        return F.ctc_loss(lp.transpose(0, 1), batch["tokens"], lengths, batch["token_lens"], blank=len(DIGITS),
                          reduction="none", zero_infinity=True)  # fmt: skip

    mask = (torch.arange(lengths.max())[None, :] < lengths[:, None])[:, :, None]
    expected = (
        0.5 * ctc(final) + 0.2 * ctc(model.log_probs(layers[1] * mask)) + 0.3 * ctc(model.log_probs(layers[0] * mask))
    )
    torch.testing.assert_close(loss_sum, expected.sum(), rtol=1e-5, atol=1e-5)
    assert int(count) == int(batch["token_lens"].sum())
    model.eval()
    assert len(model.forward_step(batch)) == 2  # validation: the final layer alone


def test_self_conditioned_ctc_feeds_the_captured_layers_distribution_forward_in_training_and_inference(
    tmp_path, dtmf_manifest
):
    """interctc.self_conditioning: layer i's CTC distribution, projected back, is added before layer i+1 reads it,
    in the forward of training, evaluation and the archive alike; with a zero projection it is the plain model."""
    torch.manual_seed(0)
    encoder = {**_config()["encoder"], "num_layers": 2, "conv_norm_type": "layer_norm"}  # train == eval numbers
    interctc = {"loss_weights": [0.3], "apply_at_layers": [0], "self_conditioning": True}
    model = ConformerCTCModel(_config(encoder=encoder, interctc=interctc))
    plain = ConformerCTCModel(_config(encoder=encoder))
    batch = _batch(dtmf_manifest, model)
    model.configure_model()
    plain.configure_model()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("conditioning.")})
    model.train()
    trained, lengths, (first,) = model.forward_step(batch)
    model.eval()
    with torch.no_grad():
        evaluated, _ = model(batch["audio"], batch["audio_lens"])
        unconditioned, _ = plain.eval()(batch["audio"], batch["audio_lens"])
    torch.testing.assert_close(trained.detach(), evaluated)
    assert not torch.allclose(evaluated, unconditioned, atol=1e-3)
    model.save_to(tmp_path / "model.stm")
    restored = SpeechModel.restore_from(tmp_path / "model.stm").eval()
    with torch.no_grad():
        torch.testing.assert_close(restored(batch["audio"], batch["audio_lens"])[0], evaluated)
        model.conditioning.weight.zero_()
        model.conditioning.bias.zero_()
        torch.testing.assert_close(model(batch["audio"], batch["audio_lens"])[0], unconditioned)
    with pytest.raises(ValueError, match="self-conditioned"):
        model.save_to(tmp_path / "model.nemo")
    with pytest.raises(ValueError, match="needs layers to condition on"):
        ConformerCTCModel(_config(interctc={"self_conditioning": True}))


@pytest.mark.parametrize(
    ("interctc", "message"),
    [({"loss_weights": [0.3], "apply_at_layers": []}, "same length"),
     ({"loss_weights": [0.6, 0.4], "apply_at_layers": [0, 0]}, "sum < 1"),
     ({"loss_weights": [0.3], "apply_at_layers": [1]}, "below model.encoder.num_layers=1")],
)  # fmt: skip
def test_intermediate_ctc_settings_that_cannot_work_are_refused_by_name(interctc, message):
    with pytest.raises(ValueError, match=message):
        ConformerCTCModel(_config(interctc=interctc))


def test_temporal_unet_with_self_conditioned_taps_on_half_rate_layers_trains_and_round_trips(tmp_path, dtmf_manifest):
    """The demo's shape in small: a tap inside the half-rate span gets the encoder output's frames (each half-rate
    frame twice), the loss reaches the U-Net's own weights, and the archive restores the same outputs; a span the
    encoder cannot hold is refused with the overrides that turn it off."""
    torch.manual_seed(0)
    encoder = {**_config()["encoder"], "num_layers": 3, "time_reduce_idx": 1, "time_recovery_idx": 3}
    interctc = {"loss_weights": [0.3], "apply_at_layers": [1], "self_conditioning": True}
    model = ConformerCTCModel(_config(encoder=encoder, interctc=interctc))
    batch = _batch(dtmf_manifest, model)
    model.train()
    log_probs, lengths, (tap,) = model.forward_step(batch)
    assert tap.shape == log_probs.shape
    loss_sum, count = model.loss_step(batch, (log_probs, lengths, [tap]))
    (loss_sum / count).backward()
    assert torch.isfinite(loss_sum) and model.encoder.time_reduction.depthwise.weight.grad.abs().sum() > 0
    assert model.encoder.time_recovery.weight.grad.abs().sum() > 0
    model.eval()
    model.save_to(tmp_path / "model.stm")
    with torch.no_grad():
        expected = model(batch["audio"], batch["audio_lens"])[0]
        torch.testing.assert_close(SpeechModel.restore_from(tmp_path / "model.stm").eval()(
            batch["audio"], batch["audio_lens"])[0], expected)  # fmt: skip
    with pytest.raises(ConfigError, match="time_recovery_idx=4.*num_layers=3.*time_reduce_idx=-1"):
        ConformerCTCModel(_config(encoder={**encoder, "time_recovery_idx": 4}))


def test_archive_round_trip_with_a_bpe_tokenizer_gives_identical_transcripts(tmp_path, dtmf_manifest):
    texts = [" ".join(str((i * 7 + j) % 10) for j in range(2 + i % 6)) for i in range(300)]
    bpe = train_sentencepiece(texts, tmp_path / "bpe", vocab_size=16)
    torch.manual_seed(0)
    model = ConformerCTCModel(_config(tokenizer=bpe))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # an untrained model would only say blank
    audio = [r.recording.sources[0].source for r in read_cuts(LoaderConfig(manifest_filepath=str(dtmf_manifest)))]
    before = model.transcribe(audio[:8])
    model.save_to(tmp_path / "model.stm")
    bpe.unlink()  # the archive carries its own copy of the tokenizer
    restored = SpeechModel.restore_from(tmp_path / "model.stm")
    assert type(restored.tokenizer).__name__ == "SentencePieceTokenizer" and restored.tokenizer.vocab_size == 16
    assert restored.transcribe(audio[:8]) == before and any(before)
    # Batching does not change what is heard: padded frames never reach valid outputs.
    assert restored.transcribe(audio[:8], batch_size=1) == before


def test_several_validation_sets_are_reported_by_name(tmp_path, dtmf_manifest):
    other = tmp_path / "other.json"
    lines = dtmf_manifest.read_text().splitlines(keepends=True)
    key = '"audio_filepath": "'
    good = "".join(lines[:10]).replace(key, f"{key}{dtmf_manifest.parent}/")
    other.write_text(good + "".join(lines[10:13]).replace(key, f"{key}{tmp_path}/gone/"))  # 3 missing files
    cfg = _config(dtmf_manifest)
    cfg["validation_ds"]["manifest_filepath"] = [str(dtmf_manifest), str(other)]
    model = ConformerCTCModel(cfg)
    trainer = Trainer(max_steps=2, strategy=MegatronStrategy(), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      use_distributed_sampler=False, val_check_interval=2, check_val_every_n_epoch=None)  # fmt: skip
    trainer.fit(model)
    metrics = trainer.callback_metrics
    name = validation_set_name(str(dtmf_manifest))
    for key in ("val_wer", "val_cer", "val_loss", f"val_wer_{name}", "val_wer_other", "val_cer_other"):
        assert key in metrics, key
    assert float(metrics["val_wer"]) == float(metrics[f"val_wer_{name}"])
    # Utterances that could not be scored are counted beside the WER, per set.
    assert float(metrics["val_skipped_other"]) == 3 and float(metrics[f"val_skipped_{name}"]) == 0


def test_validation_set_names():
    assert validation_set_name("builtin:espeak/dev") == "dev"
    assert validation_set_name("/data/corpus/test/manifest.json") == "test"
    assert validation_set_name("/data/other_clean.json") == "other_clean"


class _Sampler:
    def batches_per_epoch(self, limit=None):
        return 10 if limit is None else min(10, limit + 1)


class _Trainer:
    limit_val_batches = 1.0
    check_val_every_n_epoch = 1
    max_epochs = -1
    val_check_interval = 1.0
    accumulate_grad_batches = 1
    max_steps = 5


def test_a_run_that_would_never_validate_fails_at_start():
    with pytest.raises(
        ValueError, match="max_steps=5 steps, before the first validation after batch 5 .an epoch has more than 5"
    ):
        check_validation_schedule(_Trainer(), _Sampler(), True)
    check_validation_schedule(_Trainer(), _Sampler(), False)  # nothing to validate: nothing to check
    ok = _Trainer()
    ok.max_steps = 10
    check_validation_schedule(ok, _Sampler(), True)
    steps = _Trainer()
    steps.val_check_interval, steps.max_steps = 50, 100
    with pytest.raises(ValueError, match="check_val_every_n_epoch=null"):
        check_validation_schedule(steps, _Sampler(), True)
    steps.check_val_every_n_epoch = None
    check_validation_schedule(steps, _Sampler(), True)
    short = _Trainer()  # epochs cut to 4 batches by limit_train_batches validate after batch 4
    short.limit_train_batches = 4
    check_validation_schedule(short, _Sampler(), True)
    short.limit_train_batches = 0.3  # 3 of the 10 batches
    check_validation_schedule(short, _Sampler(), True)
    epochs = _Trainer()
    epochs.max_steps, epochs.max_epochs, epochs.check_val_every_n_epoch = -1, 2, 3
    with pytest.raises(ValueError, match="check_val_every_n_epoch=3 but trainer.max_epochs=2"):
        check_validation_schedule(epochs, _Sampler(), True)


@pytest.mark.parametrize("limit", ["max_steps", "max_epochs", "max_time", "max_epochs_before_max_time"])
def test_the_learning_rate_schedule_follows_each_way_of_ending_a_run(dtmf_manifest, limit):
    pl.seed_everything(0)
    model = ConformerCTCModel(_config(dtmf_manifest))
    ends = {"max_steps": {"max_steps": 8}, "max_epochs": {"max_epochs": 2}, "max_time": {"max_time": {"seconds": 4}},
            "max_epochs_before_max_time": {"max_epochs": 2, "max_time": {"minutes": 30}}}  # fmt: skip
    trainer = Trainer(strategy=MegatronStrategy(), logger=False, enable_checkpointing=False, limit_val_batches=0,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      **ends[limit])  # fmt: skip
    trainer.fit(model)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    # Each run ends near the end of its cosine: the learning rate is close to min_lr, far below the peak.
    assert lr < 0.25 * 3e-3, (limit, lr, trainer.global_step)


def _finetune_module():
    spec = importlib.util.spec_from_file_location("asr_finetune", EXAMPLES / "asr_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("given", "epochs"),
    [({}, 5), ({"max_time": {"minutes": 8}}, None), ({"max_steps": 100}, None), ({"max_epochs": 2}, 2)],
)
def test_finetune_trains_five_epochs_only_when_the_job_gives_no_bound(given, epochs):
    trainer = OmegaConf.create({"max_epochs": None, "max_steps": -1, "max_time": None, **given})
    _finetune_module().bound_run(trainer)
    assert trainer.max_epochs == epochs


def test_finetune_with_a_new_vocabulary_keeps_the_encoder_and_reports_the_decoder(tmp_path, caplog):
    torch.manual_seed(0)
    base = ConformerCTCModel(_config())
    base.configure_model()
    letters = tmp_path / "letters.json"
    CharTokenizer([" ", *"abcdefghij"]).save(letters)
    finetune = _finetune_module()
    with caplog.at_level(logging.INFO):
        model = finetune.finetune_model(base, {"tokenizer": {"path": str(letters)}, "optim": {"lr": 1e-4}})
    assert "the CTC decoder is re-initialised; the encoder is kept" in caplog.text
    assert model.cfg.optim.lr == 1e-4 and model.tokenizer.vocab == [" ", *"abcdefghij"]
    for key, value in base.state_dict().items():
        if key.startswith("encoder."):
            assert torch.equal(model.state_dict()[key], value), key
    assert not torch.equal(model.decoder.bias, base.decoder.bias[: model.decoder.bias.shape[0]])
    # The same vocabulary: everything is loaded.
    same = finetune.finetune_model(base, {"optim": {"lr": 1e-4}})
    assert all(torch.equal(same.state_dict()[k], v) for k, v in base.state_dict().items())


def test_finetuning_data_replaces_the_archives_blend_instead_of_joining_it(dtmf_manifest):
    blend = [{"manifest_filepath": str(dtmf_manifest), "weight": 2}, {"manifest_filepath": str(dtmf_manifest)}]
    train = {"manifest_filepath": None, "input_cfg": blend, "batch_size": 8, "batch_duration": None, "num_workers": 0}
    base = ConformerCTCModel(_config(train_ds=train))
    finetune = _finetune_module()
    model = finetune.finetune_model(base, {"train_ds": {"manifest_filepath": "new/train.json"}})
    assert model.cfg.train_ds.manifest_filepath == "new/train.json" and model.cfg.train_ds.input_cfg is None
    assert model.cfg.train_ds.batch_size == 8, "the archive's other settings stay"
    kept = finetune.finetune_model(base, {"optim": {"lr": 1e-4}})
    assert kept.cfg.train_ds.input_cfg == blend
    with pytest.raises(ValueError, match=r"names its data twice: input_cfg and manifest_filepath=x.json"):
        LoaderConfig(manifest_filepath="x.json", input_cfg=blend)


def test_the_finetune_command_line_sets_model_keys_without_plus_and_catches_typos():
    from speechtrain.common.config import ConfigError
    from speechtrain.core.hydra_runner import compose_config

    schema = _finetune_module().FINETUNE_SCHEMA
    cfg = compose_config(EXAMPLES / "conf", "asr_finetune", [
        "init_from.path=base.stm", "model.train_ds.manifest_filepath=new/train.json",
        "model.validation_ds.manifest_filepath=new/dev.json", "model.tokenizer.vocab_size=256",
    ], schema)  # fmt: skip
    model = OmegaConf.to_container(cfg.model)
    # Only what was given (and the YAML's optimiser settings): nothing else overrides the pretrained config.
    assert model["train_ds"] == {"manifest_filepath": "new/train.json"}
    assert model["tokenizer"] == {"vocab_size": 256} and set(model) == {
        "train_ds",
        "validation_ds",
        "tokenizer",
        "optim",
    }
    with pytest.raises(ConfigError, match="Did you mean 'model.train_ds.manifest_filepath'"):
        compose_config(EXAMPLES / "conf", "asr_finetune", ["init_from.path=b", "+model.train_ds.manifest_filepth=x"],
                       schema)  # fmt: skip
