"""Device discipline: no tensor is made without a device inside a training or validation step of the bridge
and the ASR, TTS and SALM models (on a GPU such a tensor lands on the CPU and breaks the step under NCCL), and
the bridge's own modules never call a factory without one."""

import ast
import sys
from pathlib import Path

import pytest
import torch
from conftest import example_job, example_main

from speechtrain.lightning import BaseCallback, CallbackGroup, MegatronStrategy, Trainer, teardown
from speechtrain.testing.devices import FACTORIES, DevicelessFactoryCalls, RecordDevicelessFactories

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _release_the_process_group():
    """Runs here leave their process group and Megatron state behind on purpose (saving after fit); the next test
    module starts clean."""
    yield
    teardown(None)


class _Recorder(BaseCallback, RecordDevicelessFactories):
    def __init__(self) -> None:
        BaseCallback.__init__(self)
        RecordDevicelessFactories.__init__(self)


def test_the_recorder_sees_a_cpu_tensor_made_on_purpose():
    from speechtrain.lightning import megatron_parallel

    with DevicelessFactoryCalls() as found:
        megatron_parallel.split_micro_batches(torch.zeros(4, device="cpu"), 2)
        torch.zeros(3)  # this file is not speechtrain code: not counted
        exec(compile("torch.zeros(2)", megatron_parallel.__file__, "exec"), {"torch": torch})  # as if in the bridge
    assert found.calls == ["speechtrain/lightning/megatron_parallel.py:1 torch.zeros"]


STREAMING = ("model.encoder.att_context_size=[[4,0],[4,1]]", "model.encoder.att_context_style=chunked_limited",
             "model.encoder.conv_context_size=causal", "model.encoder.causal_downsampling=true",
             "model.preprocessor.normalize=none")  # fmt: skip


@pytest.mark.parametrize("encoder", [(), STREAMING], ids=["offline", "streaming"])
def test_asr_training_and_validation_steps_make_every_tensor_on_a_device(tmp_path, dtmf_manifest, encoder):
    recorder = CallbackGroup.get_instance().register(_Recorder()) or CallbackGroup.get_instance().callbacks[-1]
    job = example_job(tmp_path, dtmf_manifest, "trainer.max_steps=3", "+trainer.val_check_interval=2",
                      "trainer.check_val_every_n_epoch=null", "trainer.limit_val_batches=1",
                      "model.decoding.strategy=greedy", "exp_manager.create_checkpoint_callback=false",
                      *encoder)  # fmt: skip
    example_main()(job)
    assert recorder.calls == [], "\n".join(recorder.calls)


def family_model(family: str, folder: Path, manifest: Path):
    """A tiny SALM or codec TTS model on the DTMF corpus (also trained on a GPU by ``tests/gpu/family_job.py``)."""
    sys.path.insert(0, str(ROOT / "tests" / ("speechlm" if family == "salm" else "tts")))
    if family == "salm":
        from test_speechlm_model import TEXTS, tiny_salm_config

        from speechtrain.speechlm.model import SALMModel
        from speechtrain.speechlm.prompts import get_template
        from speechtrain.speechlm.tokenizer import train_bpe_tokenizer

        train_bpe_tokenizer(TEXTS, 300, get_template("llama3").special_tokens).save(folder)
        return SALMModel(tiny_salm_config(folder / "tokenizer.json", manifest))
    from test_tts_model import tiny_tts_config

    from speechtrain.tts.model import TTSModel

    config = tiny_tts_config(text={"kind": "chars", "vocab": [" ", *"0123456789"]}, val_samples=1)
    config["train_ds"] = {"manifest_filepath": str(manifest), "batch_size": 4, "batch_duration": None}
    config["validation_ds"] = {"manifest_filepath": str(manifest), "batch_size": 4}
    model = TTSModel(config)
    model.codec.codebooks.copy_(torch.randn(model.codec.codebooks.shape))  # a codec "fitted" at random
    model.codec.fitted.fill_(True)
    return model


@pytest.mark.parametrize("family", ["salm", "tts"])
def test_salm_and_tts_steps_under_the_bridge_make_every_tensor_on_a_device(family, tmp_path, dtmf_manifest):
    model = family_model(family, tmp_path, dtmf_manifest)
    recorder = RecordDevicelessFactories()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(), max_steps=2, limit_val_batches=1,
                      val_check_interval=2, num_sanity_val_steps=0, use_distributed_sampler=False, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[recorder])  # fmt: skip
    trainer.fit(model)
    assert trainer.global_step == 2
    assert recorder.calls == [], "\n".join(recorder.calls)


def _deviceless_factory_lines(path: Path) -> list[str]:
    names = {f.__name__ for f in FACTORIES}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):  # fmt: skip
            found.append(f"{path.name}:{node.lineno} torch.{node.func.attr}")
    return found


def test_bridge_modules_give_every_factory_call_a_device():
    """Every ``torch.zeros(...)``-style call in speechtrain/lightning says where (the CPU adaptation layer builds
    CPU stand-ins on purpose and is exempt)."""
    folder = ROOT / "speechtrain" / "lightning"
    found = [line for path in sorted(folder.glob("*.py")) if path.name != "megatron_compat.py"
             for line in _deviceless_factory_lines(path)]  # fmt: skip
    assert found == [], "\n".join(found)


def test_the_ast_check_finds_a_factory_call_without_a_device(tmp_path):
    source = tmp_path / "bridge.py"
    source.write_text("import torch\nx = torch.zeros(2, device='cpu')\ny = torch.tensor([1.0])\n")
    assert _deviceless_factory_lines(source) == ["bridge.py:3 torch.tensor"]
