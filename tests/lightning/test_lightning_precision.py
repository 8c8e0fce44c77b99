"""Every precision mode trains each model family under the bridge on CPU, or is refused at start with a reason:
`32`, `bf16-mixed`, `16-mixed` and `bf16-true` (fp32 main parameters) for the ASR, TTS and SALM models."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import example_main, example_overrides

from speechtrain.lightning import BaseCallback, CallbackGroup, MegatronStrategy, Trainer, teardown

ROOT = Path(__file__).resolve().parents[2]
PRECISIONS = ["32", "bf16-mixed", "16-mixed", "bf16-true"]


@pytest.fixture(autouse=True)
def _release_the_process_group():
    """Runs here leave their process group and Megatron state behind on purpose (saving after fit); the next test
    module starts clean."""
    yield
    teardown(None)


class _Losses(BaseCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_bf16_true_trains_the_demo_asr_model_for_20_steps_with_falling_loss(tmp_path, dtmf_manifest):
    """The demo-size Conformer-CTC in bf16 weights (features, CTC and the optimizer's main parameters in fp32)."""
    from speechtrain.asr.ctc import ConformerCTCConfig
    from speechtrain.core.hydra_runner import compose_config
    from speechtrain.core.job import train_job_schema

    losses = CallbackGroup.get_instance().register(_Losses()) or CallbackGroup.get_instance().callbacks[-1]
    overrides = [o for o in example_overrides(tmp_path, dtmf_manifest) if not o.startswith(("model.encoder.",
                 "model.preprocessor.n_mels", "trainer.precision"))]  # fmt: skip
    overrides += ["model.size=demo", "trainer.precision=bf16-true", "trainer.max_steps=20",
                  "trainer.limit_val_batches=0", "model.optim.lr=1e-3", "model.decoding.strategy=greedy"]  # fmt: skip
    job = compose_config(ROOT / "examples" / "conf", "asr_train", overrides, train_job_schema(ConformerCTCConfig))
    model = example_main()(job)
    assert len(losses.losses) == 20 and all(map(torch.isfinite, map(torch.tensor, losses.losses)))
    first, last = sum(losses.losses[:5]) / 5, sum(losses.losses[-5:]) / 5
    assert last < 0.8 * first, losses.losses
    if model is not None:
        assert next(model.encoder.parameters()).dtype == torch.bfloat16


def _tts(tmp_path, manifest):
    sys.path.insert(0, str(ROOT / "tests" / "tts"))
    from test_tts_model import tiny_tts_config

    from speechtrain.tts.model import TTSModel

    config = tiny_tts_config(text={"kind": "chars", "vocab": [" ", *"0123456789"]}, val_samples=0)
    config["train_ds"] = {"manifest_filepath": str(manifest), "batch_size": 4, "batch_duration": None}
    model = TTSModel(config)
    model.codec.codebooks.copy_(torch.randn(model.codec.codebooks.shape))
    model.codec.fitted.fill_(True)
    return model


def _salm(tmp_path, manifest):
    sys.path.insert(0, str(ROOT / "tests" / "speechlm"))
    from test_speechlm_model import TEXTS, tiny_salm_config

    from speechtrain.speechlm.model import SALMModel
    from speechtrain.speechlm.prompts import get_template
    from speechtrain.speechlm.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer(TEXTS, 300, get_template("llama3").special_tokens).save(tmp_path)
    return SALMModel(tiny_salm_config(tmp_path / "tokenizer.json", manifest))


def _asr(tmp_path, manifest):
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import tiny_ctc_config

    from speechtrain.asr.conv_ctc import ConvCTCModel

    return ConvCTCModel(tiny_ctc_config(manifest))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", ["asr", "tts", "salm"])
def test_each_precision_trains_each_family_or_is_refused(family, precision, tmp_path, dtmf_manifest):
    model = {"asr": _asr, "tts": _tts, "salm": _salm}[family](tmp_path, dtmf_manifest)
    losses = _Losses()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(), precision=precision, max_steps=3,
                      limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, callbacks=[losses])  # fmt: skip
    trainer.fit(model)
    assert trainer.global_step == 3 and len(losses.losses) == 3
    assert all(torch.isfinite(torch.tensor(losses.losses))), losses.losses


def test_fp16_loss_scaler_settings_reach_megatrons_scaler(tmp_path, dtmf_manifest):
    """``trainer.strategy.fp16_initial_loss_scale`` (and the other three) set Megatron's dynamic loss scaler: a run
    started at 2^4 with a window of 2 clean steps doubles its scale after its second step; bad values are refused
    when the strategy is built, naming the keys."""

    class Scales(BaseCallback):
        def __init__(self) -> None:
            self.scales: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.scales.append(float(trainer.optimizers[0].mcore.grad_scaler.scale))

    model, scales = _asr(tmp_path, dtmf_manifest), Scales()
    strategy = MegatronStrategy(fp16_initial_loss_scale=2.0**4, fp16_loss_scale_window=2, fp16_hysteresis=1)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="16-mixed", max_steps=3,
                      limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, callbacks=[scales])  # fmt: skip
    trainer.fit(model)
    assert scales.scales == [16.0, 32.0, 32.0]
    assert trainer.optimizers[0].mcore.grad_scaler.hysteresis == 1
    for bad in ({"fp16_min_loss_scale": 0.0}, {"fp16_initial_loss_scale": 0.5}, {"fp16_hysteresis": 0}):
        with pytest.raises(ValueError, match="fp16_min_loss_scale <= fp16_initial_loss_scale"):
            MegatronStrategy(**bad)
