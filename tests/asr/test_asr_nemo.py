"""NeMo ``.nemo`` checkpoints: log-probs equal to NeMo's on the fixtures (made by tools/make_nemo_fixtures.py with
NeMo; NeMo is not needed here), export and round trip, every refusal, fine-tuning, transcription, SALM, TP=2."""

import io
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import soundfile as sf
import torch
import yaml
from safetensors.torch import load_file

from speechtrain.asr.ctc import ConformerCTCModel
from speechtrain.asr.nemo_import import NemoImportError, load_weights, read_members
from speechtrain.asr.transducer import ConformerTransducerModel
from speechtrain.core.model import SpeechModel

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nemo"
NAMES = [
    "fastconformer_ctc",
    "fastconformer_ctc_noxs_tied",
    "conformer_ctc",
    "fastconformer_hybrid",
    "fastconformer_hybrid_tdt",
]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TP_JOB = Path(__file__).with_name("nemo_tp_job.py")


def fixture_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixtures' input: two utterances of different lengths, zero-padded (B, T), and their lengths."""
    waves = [torch.from_numpy(sf.read(FIXTURES / f"input_{c}.wav", dtype="float32")[0]) for c in "ab"]
    lengths = torch.tensor([len(w) for w in waves])
    audio = torch.zeros(len(waves), int(lengths.max()))
    for i, wave in enumerate(waves):
        audio[i, : len(wave)] = wave
    return audio, lengths


def max_difference(model: torch.nn.Module, name: str) -> float:
    """Largest |ours - NeMo's| log-prob over the valid frames of the fixture batch (lengths must agree)."""
    expected = load_file(FIXTURES / f"{name}.expected.safetensors")
    audio, lengths = fixture_batch()
    with torch.no_grad():
        log_probs, out_lengths = model.eval()(audio, lengths)
        if isinstance(model, ConformerTransducerModel):  # a hybrid: the encoder's output, read by its CTC head
            log_probs = model.ctc_log_probs(log_probs)
    assert out_lengths.tolist() == expected["lengths"].tolist()
    assert log_probs.shape == expected["log_probs"].shape
    return max((log_probs[i, :n] - expected["log_probs"][i, :n]).abs().max().item()
               for i, n in enumerate(out_lengths.tolist()))  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_log_probs_equal_nemos_on_every_fixture(name, caplog):
    with caplog.at_level(logging.INFO):
        model = SpeechModel.restore_from(FIXTURES / f"{name}.nemo")
    assert isinstance(model, ConformerCTCModel) and model.cfg.preprocessor.kind == "nemo"
    diff = max_difference(model, name)
    print(f"{name}: max |log-prob difference| vs NeMo = {diff:.2e}")
    assert diff < 1e-4
    expected = load_file(FIXTURES / f"{name}.expected.safetensors")["log_probs"]
    assert expected[0, :4].max() - expected[0, :4].min() > 1.0  # informative outputs, not a flat distribution
    if name == "fastconformer_hybrid":  # the whole hybrid: its transducer is checked in test_asr_nemo_transducer.py
        assert isinstance(model, ConformerTransducerModel) and model.cfg.hybrid and model.cfg.loss == "rnnt"
        assert "EncDecHybridRNNTCTCBPEModel" in caplog.text and "RNNT decoder" in caplog.text


def test_the_nemo_front_end_is_what_makes_them_equal():
    """Our default (torchaudio) front-end on the same weights is far from NeMo's numbers: the check has teeth."""
    model = SpeechModel.restore_from(FIXTURES / "fastconformer_ctc.nemo")
    state = model.state_dict()
    other = ConformerCTCModel({**model.cfg, "preprocessor": {**model.cfg.preprocessor, "kind": "torchaudio"}})
    other.configure_model()
    other.load_state_dict({k: v for k, v in state.items() if not k.startswith("preprocessor.")}, strict=False)
    assert max_difference(other, "fastconformer_ctc") > 0.01


def test_a_character_model_loads_with_its_labels(tmp_path):
    """NeMo's EncDecCTCModel (characters): the decoder's vocabulary becomes a character tokenizer."""
    labels = list(" abcdefghijklmnopqrstuvwxyz'0123456789-.,")[:40]

    def to_chars(config):
        config["target"] = "nemo.collections.asr.models.ctc_models.EncDecCTCModel"
        del config["tokenizer"]
        config["decoder"]["vocabulary"] = labels

    path = repack(FIXTURES / "fastconformer_ctc.nemo", tmp_path / "chars.nemo", _config_edit(to_chars))
    model = SpeechModel.restore_from(path)
    assert model.tokenizer.vocab == labels
    assert max_difference(model, "fastconformer_ctc") < 1e-4


def test_an_encoder_without_biases_loads_with_zero_biases(tmp_path, caplog):
    """``encoder.use_bias: false`` (no biases in the layers' linear and convolution layers): they start at zero."""

    def drop_biases(members):
        config = yaml.safe_load(members["model_config.yaml"])
        config["encoder"]["use_bias"] = False
        members["model_config.yaml"] = yaml.safe_dump(config).encode()
        state = load_weights(tmp_path, members["model_weights.ckpt"])
        layer_biases = [k for k in state if k.startswith("encoder.layers.") and k.endswith(".bias")
                        and ("linear" in k or "_conv" in k)]  # fmt: skip
        buffer = io.BytesIO()
        torch.save({k: v for k, v in state.items() if k not in layer_biases}, buffer)
        members["model_weights.ckpt"] = buffer.getvalue()

    path = repack(FIXTURES / "fastconformer_ctc.nemo", tmp_path / "nobias.nemo", drop_biases)
    with caplog.at_level(logging.WARNING):
        model = SpeechModel.restore_from(path)
    assert "encoder.use_bias is false: the encoder's biases start at zero" in caplog.text
    layer = model.encoder.layers[1]
    assert not layer.ff1.up.linear.bias.any() and not layer.conv.depthwise.bias.any()
    assert layer.ff1_norm.bias.any()  # norms keep theirs


def test_from_pretrained_finds_a_nemo_file_by_name_in_the_models_cache(tmp_path, monkeypatch):
    from speechtrain.lightning import settings

    (tmp_path / "tiny_fc.nemo").write_bytes((FIXTURES / "fastconformer_ctc.nemo").read_bytes())
    monkeypatch.setattr(settings, "SPEECHTRAIN_MODELS_CACHE", tmp_path)
    assert max_difference(SpeechModel.from_pretrained("tiny_fc"), "fastconformer_ctc") < 1e-4


def export_with_the_fixtures_tensors(name: str, folder: Path) -> tuple[SpeechModel, dict[str, bytes]]:
    """Fixture ``name`` imported and exported to ``folder/out.nemo``: the model and the file's members, whose
    tensors are checked to be the fixture's (NeMo's names, shapes and values)."""
    model = SpeechModel.restore_from(FIXTURES / f"{name}.nemo").eval()
    model.save_to(folder / "out.nemo")
    original = load_weights(FIXTURES, read_members(FIXTURES / f"{name}.nemo")["model_weights.ckpt"])
    members = read_members(folder / "out.nemo")
    exported = load_weights(folder, members["model_weights.ckpt"])
    assert {k: tuple(v.shape) for k, v in exported.items()} == {k: tuple(v.shape) for k, v in original.items()}
    for key, tensor in exported.items():
        if not key.endswith("linear_k.bias"):  # dropped on import (softmax ignores it), written as zeros
            assert torch.equal(tensor, original[key]), key
    return model, members


@pytest.mark.parametrize("name", ["conformer_ctc", "fastconformer_ctc_noxs_tied"])  # transducers: the other file
def test_export_round_trips_with_nemos_names(name, tmp_path):
    model, members = export_with_the_fixtures_tensors(name, tmp_path)
    config = yaml.safe_load(members["model_config.yaml"])
    assert config["target"] == "nemo.collections.asr.models.ctc_bpe_models.EncDecCTCModelBPE"
    assert config["tokenizer"]["model_path"] == "nemo:tokenizer.model" and "tokenizer.model" in members
    again = SpeechModel.restore_from(tmp_path / "out.nemo").eval()
    audio, lengths = fixture_batch()
    with torch.no_grad():
        assert torch.equal(again(audio, lengths)[0], model(audio, lengths)[0])
    assert type(again) is type(model)


def test_export_command_line_and_refusals(tmp_path, capsys):
    from speechtrain.asr.export_nemo import main

    model = SpeechModel.restore_from(FIXTURES / "fastconformer_ctc.nemo")
    model.save_to(tmp_path / "model.stm")
    main([str(tmp_path / "model.stm"), str(tmp_path / "model.nemo")])
    assert "EncDecCTCModelBPE, 40 tokens" in capsys.readouterr().out
    assert max_difference(SpeechModel.restore_from(tmp_path / "model.nemo"), "fastconformer_ctc") < 1e-4

    chars = ConformerCTCModel(
        {"tokenizer": {"vocab": list(" abc")}, "preprocessor": {"kind": "nemo"}, "size": "debug"}
    )
    with pytest.raises(ValueError, match=r"x\.nemo: this ConformerCTCModel has a CharTokenizer.*sentencepiece"):
        chars.save_to(tmp_path / "x.nemo")
    torchaudio = ConformerCTCModel({**model.cfg, "preprocessor": {**model.cfg.preprocessor, "kind": "torchaudio"}})
    with pytest.raises(ValueError, match="uses the 'torchaudio' front-end.*preprocessor.kind=nemo"):
        torchaudio.save_to(tmp_path / "y.nemo")
    unet = {**model.cfg.encoder, "time_reduce_idx": 0, "time_recovery_idx": 1}
    unet = ConformerCTCModel({**model.cfg, "encoder": unet})
    with pytest.raises(ValueError, match="runs layers on half the frames.*time_reduce_idx.*\\.stm"):
        unet.save_to(tmp_path / "u.nemo")
    from speechtrain.testing.toy_models import ToyTransformerRegressor

    with pytest.raises(ValueError, match="ToyTransformerRegressor cannot be exported to NeMo's .nemo format"):
        ToyTransformerRegressor({}).save_to(tmp_path / "z.nemo")


# ------------------------------------------------------------------------------------------------ bad input
def repack(source: Path, target: Path, edit=None, extra: list[tuple[tarfile.TarInfo, bytes | None]] = ()) -> Path:
    """A copy of a .nemo (as a plain tar) with members changed by ``edit(members)`` and raw ``extra`` entries."""
    members = read_members(source)
    if edit is not None:
        edit(members)
    with tarfile.open(target, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return target


def _config_edit(change):
    def edit(members):
        config = yaml.safe_load(members["model_config.yaml"])
        change(config)
        members["model_config.yaml"] = yaml.safe_dump(config).encode()

    return edit


CTC, RNNT = "fastconformer_ctc", "fastconformer_rnnt"


@pytest.mark.parametrize(
    ("source", "change", "message"),
    [
        (CTC, lambda c: c.update(target="nemo.collections.tts.models.fastpitch.FastPitchModel"),
         "holds a FastPitchModel"),
        (CTC, lambda c: c["encoder"].update(att_context_style="chunked_limited_with_rc"),
         "att_context_style is 'chunked_limited_with_rc'"),
        (CTC, lambda c: c["encoder"].update(att_context_size=[70, -1], att_context_style="chunked_limited"),
         r"att_context_size is \[70, -1\]"),
        (CTC, lambda c: c["encoder"].update(self_attention_model="rel_pos_local_attn"), "'rel_pos_local_attn'"),
        (CTC, lambda c: c["encoder"].update(_target_="nemo.collections.asr.modules.SqueezeformerEncoder"),
         "SqueezeformerEncoder"),
        (CTC, lambda c: c["tokenizer"].update(type="wpe"), "a WordPiece tokenizer"),
        (CTC, lambda c: c["preprocessor"].update(normalize="all_features"),
         "preprocessor.normalize is 'all_features'"),
        (RNNT, lambda c: c["decoder"].update(_target_="nemo.collections.asr.modules.StatelessTransducerDecoder"),
         "decoder._target_ is 'StatelessTransducerDecoder'"),
        (RNNT, lambda c: c["decoder"].update(normalization_mode="layer"), "normalization_mode is 'layer'"),
        (RNNT, lambda c: c["decoder"]["prednet"].update(rnn_hidden_size=32), "rnn_hidden_size is 32.*projection"),
        (RNNT, lambda c: c["joint"].update(_target_="nemo.collections.asr.modules.HATJoint"), "'HATJoint'"),
        (RNNT, lambda c: c["joint"]["jointnet"].update(activation="gelu"), "activation is 'gelu'"),
        (RNNT, lambda c: c["loss"].update(loss_name="multiblank_rnnt"), "loss_name is 'multiblank_rnnt'"),
        (RNNT, lambda c: c["joint"].update(num_extra_outputs=3), "num_extra_outputs is 3"),
    ],
)  # fmt: skip
def test_models_we_cannot_represent_are_refused_by_name(tmp_path, source, change, message):
    path = repack(FIXTURES / f"{source}.nemo", tmp_path / "bad.nemo", _config_edit(change))
    with pytest.raises(NemoImportError, match=f"bad.nemo: .*{message}"):
        SpeechModel.restore_from(path)


def test_a_truncated_file_is_refused(tmp_path):
    for source in (FIXTURES / "fastconformer_ctc.nemo", repack(FIXTURES / "conformer_ctc.nemo", tmp_path / "p.nemo")):
        data = source.read_bytes()
        cut = tmp_path / f"cut_{source.name}"
        cut.write_bytes(data[: len(data) // 2])
        with pytest.raises(NemoImportError, match=f"{cut.name}.*truncated"):
            SpeechModel.restore_from(cut)


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes = b"x"):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data if kind == tarfile.REGTYPE else None


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (_member("../evil.txt"), r"unsafe path '\.\./evil\.txt'"),
        (_member("./a/../../evil.txt"), "unsafe path"),
        (_member("/etc/evil.txt"), r"unsafe path '/etc/evil\.txt'"),
        (_member("./link", tarfile.SYMTYPE, "/etc/passwd"), r"'./link': it is a link \('/etc/passwd'\)"),
        (_member("./hard", tarfile.LNKTYPE, "model_config.yaml"), "it is a link"),
        (_member("./fifo", tarfile.FIFOTYPE), "only regular files"),
    ],
)  # fmt: skip
def test_unsafe_tar_members_are_refused(tmp_path, member, message):
    path = repack(FIXTURES / "fastconformer_ctc.nemo", tmp_path / "unsafe.nemo", extra=[member])
    with pytest.raises(NemoImportError, match=f"unsafe.nemo: refusing tar member.*{message}"):
        SpeechModel.restore_from(path)
    assert not (tmp_path.parent / "evil.txt").exists()


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["exploit", "object", "list"])
def test_weights_that_are_not_a_plain_state_dict_are_refused_and_never_run(tmp_path, payload):
    marker = tmp_path / "executed"

    def edit(members):
        if payload == "exploit":
            members["model_weights.ckpt"] = pickle.dumps({"w": _Exploit(marker)})
        else:
            buffer = io.BytesIO()
            value = {"w": _Exploit(marker)} if payload == "object" else [torch.zeros(2)]
            torch.save(value, buffer)
            members["model_weights.ckpt"] = buffer.getvalue()

    path = repack(FIXTURES / "fastconformer_ctc.nemo", tmp_path / "pickle.nemo", edit)
    expected = "does not hold a state dict" if payload == "list" else "is not a plain state dict.*weights_only"
    with pytest.raises(NemoImportError, match=f"pickle.nemo: model_weights.ckpt {expected}"):
        SpeechModel.restore_from(path)
    assert not marker.exists()


def test_missing_members_are_named(tmp_path):
    def drop_tokenizer(members):
        for name in [n for n in members if n.endswith("tokenizer.model")]:
            del members[name]

    path = repack(FIXTURES / "fastconformer_ctc.nemo", tmp_path / "notok.nemo", drop_tokenizer)
    with pytest.raises(NemoImportError, match=r"notok.nemo: tokenizer.model_path names 'nemo:.*missing tokenizer"):
        SpeechModel.restore_from(path)
    path = repack(FIXTURES / "fastconformer_ctc.nemo", tmp_path / "now.nemo", lambda m: m.pop("model_weights.ckpt"))
    with pytest.raises(NemoImportError, match="now.nemo is not a complete .nemo archive: it has no model_weights"):
        SpeechModel.restore_from(path)

    def drop_tensor(members):
        state = load_weights(tmp_path, members["model_weights.ckpt"])
        del state["encoder.layers.1.conv.depthwise_conv.weight"]
        buffer = io.BytesIO()
        torch.save(state, buffer)
        members["model_weights.ckpt"] = buffer.getvalue()

    path = repack(FIXTURES / "fastconformer_ctc.nemo", tmp_path / "short.nemo", drop_tensor)
    with pytest.raises(NemoImportError, match="short.nemo: model_weights.ckpt lacks 1 tensors.*depthwise_conv"):
        SpeechModel.restore_from(path)


def test_a_nemo_file_without_the_suffix_gets_a_hint(tmp_path):
    from speechtrain.core.archive import ArchiveError

    path = repack(FIXTURES / "fastconformer_ctc.nemo", tmp_path / "model.tar")
    with pytest.raises(ArchiveError, match="model.tar is not a speechtrain archive.*looks like a NeMo checkpoint"):
        SpeechModel.restore_from(path)


# ------------------------------------------------------------------------------------ everywhere a path goes
def test_transcribe_command_line_takes_a_nemo_file(tmp_path, capsys):
    from speechtrain.asr.transcribe import main

    output = tmp_path / "preds.json"
    main([f"model_path={FIXTURES / 'conformer_ctc.nemo'}", f"audio={FIXTURES / 'input_a.wav'}", f"output={output}"])
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    model = SpeechModel.restore_from(FIXTURES / "conformer_ctc.nemo")
    assert rows[0]["pred_text"] == model.transcribe([FIXTURES / "input_a.wav"])[0]


def _finetune_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("asr_finetune", EXAMPLES / "asr_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_from_a_nemo_file_keeps_its_weights_or_its_encoder(tmp_path):
    from speechtrain.common.tokenizers import CharTokenizer

    base = SpeechModel.restore_from(FIXTURES / "fastconformer_hybrid.nemo")
    finetune = _finetune_module()
    same = finetune.finetune_model(base, {"optim": {"lr": 1e-4}}, defer=True)
    assert same.encoder is None  # loaded when the trainer builds the layers
    same.configure_model()
    assert all(torch.equal(same.state_dict()[k], v) for k, v in base.state_dict().items())
    CharTokenizer(list(" abcdefghijklmnopqrstuvwxyz'")).save(tmp_path / "letters.json")
    new = finetune.finetune_model(base, {"tokenizer": {"path": str(tmp_path / "letters.json")}})
    assert new.decoder.weight.shape[0] == 29
    assert all(torch.equal(new.state_dict()[k], v) for k, v in base.state_dict().items() if k.startswith("encoder."))


def test_salm_perception_takes_a_nemo_encoder(tmp_path):
    from omegaconf import OmegaConf

    from speechtrain.common.config import validate_config
    from speechtrain.speechlm.backbone import ensure_parallel_state
    from speechtrain.speechlm.model import SALMConfig, SALMModel, prepare_salm_config
    from speechtrain.speechlm.prompts import get_template
    from speechtrain.speechlm.tokenizer import train_bpe_tokenizer

    ensure_parallel_state()
    train_bpe_tokenizer(["transcribe the audio", "one two three"] * 20, 300,
                        get_template("llama3").special_tokens).save(tmp_path)  # fmt: skip
    cfg = validate_config({
        "prompt_format": "llama3",
        "perception": {"asr_model": str(FIXTURES / "fastconformer_ctc.nemo"), "compression": "ctc",
                       "adapter": {"subsampling": 1, "num_layers": 1}},
        "llm": {"config": {"vocab_size": 320, "hidden_size": 32, "num_layers": 1, "num_attention_heads": 4,
                           "num_query_groups": 2, "ffn_hidden_size": 64, "max_position_embeddings": 512},
                "tokenizer": str(tmp_path / "tokenizer.json")},
    }, SALMConfig)  # fmt: skip
    prepare_salm_config(cfg)
    assert cfg.perception.preprocessor.kind == "nemo" and cfg.perception.encoder.d_model == 16
    assert cfg.perception.ctc_vocab == 41
    model = SALMModel(OmegaConf.to_container(cfg))
    model.configure_model()
    asr = SpeechModel.restore_from(FIXTURES / "fastconformer_ctc.nemo")
    for name, tensor in asr.encoder.state_dict().items():
        assert torch.equal(model.perception.encoder.state_dict()[name], tensor), name
    assert torch.equal(model.perception.preprocessor.fb, asr.preprocessor.fb)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [pytest.param("conformer_ctc", marks=pytest.mark.slow), "conformer_tdt"])
def test_tensor_parallel_fine_tuning_slices_nemo_weights(tmp_path, name):
    """A .nemo loaded for fine-tuning under TP=2 (each rank takes its slices) gives NeMo's log-probs (the
    Conformer fixture: 4 heads, tied relative-position biases, layer-norm convolution module), or, for the TDT
    transducer, NeMo's joint logits."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
               str(TP_JOB), str(FIXTURES / f"{name}.nemo"), str(out)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["tp"] == 2 and report["sharded"] > 0
    assert report["max_difference"] < 1e-4, report


@pytest.mark.slow
@pytest.mark.multiprocess
# TP=2 runs the closing report's per-engine greedy WER on both ranks (run on global rank 0 alone, that step waited for
# its tensor-parallel peer forever). It passes alone in ~27 s, but timed out (280 s) once in a fresh-clone full
# suite: kept slow until that is understood.
@pytest.mark.parametrize(("name", "tp"), [("conformer_ctc", 1), ("conformer_ctc", 2), ("conformer_tdt", 1)])
def test_fine_tune_a_nemo_fixture_for_20_steps_then_transcribe_and_export(tmp_path, name, tp):
    """examples/asr_finetune.py from a .nemo (CTC; a TDT transducer) on a small built-in eSpeak corpus at TP=1 and
    TP=2 (two processes), then the archive transcribes and exports back to .nemo with the same outputs."""
    from speechtrain.asr.transcribe import main as transcribe
    from speechtrain.lightning import settings

    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port()),
           "SPEECHTRAIN_DATASETS_CACHE": str(settings.SPEECHTRAIN_DATASETS_CACHE)}  # fmt: skip
    command = [sys.executable, str(EXAMPLES / "asr_finetune.py"), f"init_from.path={FIXTURES / f'{name}.nemo'}",
               "model.train_ds.manifest_filepath=builtin:espeak-0.2h/train",
               "model.validation_ds.manifest_filepath=builtin:espeak-0.2h/dev", "trainer.max_steps=20",
               "trainer.val_check_interval=20", "trainer.check_val_every_n_epoch=null", "trainer.accelerator=cpu",
               f"trainer.devices={tp}", f"trainer.strategy.tensor_model_parallel_size={tp}",
               "trainer.enable_progress_bar=false", f"exp_manager.exp_dir={tmp_path}"]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert f"Megatron layout: TP {tp} x PP 1" in result.stdout + result.stderr
    assert "Final: val_cer=" in result.stdout
    (archive,) = tmp_path.rglob("asr_finetune.stm")
    model = SpeechModel.restore_from(archive)
    assert model.cfg.preprocessor.kind == "nemo" and model.cfg.encoder.untie_biases is (name == "conformer_tdt")
    assert type(model).__name__ == ("ConformerTransducerModel" if name == "conformer_tdt" else "ConformerCTCModel")
    dev = settings.SPEECHTRAIN_DATASETS_CACHE / "espeak-en-v2" / "0.2h-seed0" / "dev" / "manifest.json"
    transcribe([f"model_path={archive}", f"audio={dev}", f"output={tmp_path / 'preds.json'}"])
    rows = [json.loads(line) for line in (tmp_path / "preds.json").read_text().splitlines()]
    assert rows and all(isinstance(r["pred_text"], str) for r in rows)
    model.save_to(tmp_path / "finetuned.nemo")
    audio, lengths = fixture_batch()
    with torch.no_grad():
        exported = SpeechModel.restore_from(tmp_path / "finetuned.nemo").eval()(audio, lengths)[0]
        assert torch.equal(exported, model.eval()(audio, lengths)[0])
