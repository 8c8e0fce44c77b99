"""NeMo transducer checkpoints (RNN-T, TDT, hybrid RNN-T-CTC): the prediction network, the joint and greedy decoding
equal NeMo's on the fixtures (made by tools/make_nemo_fixtures.py with NeMo; NeMo is not needed here); export and
round trip; refusals; transcription and fine-tuning from the file."""

import io
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_asr_nemo import (
    FIXTURES,
    _config_edit,
    _finetune_module,
    export_with_the_fixtures_tensors,
    fixture_batch,
    repack,
)

from speechtrain.asr.nemo_import import NemoImportError, load_weights, read_members
from speechtrain.asr.transducer import ConformerTransducerModel
from speechtrain.asr.transducer_decoding import greedy_batch
from speechtrain.core.model import SpeechModel

# name: (loss, hybrid, LSTM layers, joint activation)
TRANSDUCERS = {
    "fastconformer_hybrid": ("rnnt", True, 1, "relu"),
    "fastconformer_rnnt": ("rnnt", False, 1, "relu"),
    "conformer_tdt": ("tdt", False, 2, "tanh"),
    "fastconformer_hybrid_tdt": ("tdt", True, 1, "relu"),  # no joint dropout: NeMo's output layer is joint_net.1
}


def transducer_differences(model: ConformerTransducerModel, name: str) -> tuple[float, float]:
    """Largest |ours - NeMo's| of the prediction network's output and of the joint's raw logits (valid frames) on the
    fixture batch and the fixture's labels; the encoder lengths must agree."""
    expected = load_file(FIXTURES / f"{name}.expected.safetensors")
    audio, lengths = fixture_batch()
    with torch.no_grad():
        enc, enc_lengths = model.eval()(audio, lengths)
        pred = model.prediction(expected["labels"])
        logits = model.joint(model.joint.enc_proj(enc)[:, :, None], model.joint.pred_proj(pred)[:, None])
    assert enc_lengths.tolist() == expected["lengths"].tolist()
    assert logits.shape == expected["joint_logits"].shape
    joint = max((logits[i, :n] - expected["joint_logits"][i, :n]).abs().max().item()
                for i, n in enumerate(enc_lengths.tolist()))  # fmt: skip
    return (pred - expected["prediction"]).abs().max().item(), joint


def greedy_ids(model: ConformerTransducerModel, name: str) -> list[list[int]]:
    """Our batched greedy decoding of the fixture's random encoder output (NeMo's decoded the same tensor)."""
    expected = load_file(FIXTURES / f"{name}.expected.safetensors")
    durations = model.durations if model.cfg.loss == "tdt" else None
    model.eval()
    with torch.no_grad():
        hyps, _ = greedy_batch(model.prediction, model.joint, expected["greedy_input"], expected["greedy_lengths"],
                               model.blank, durations, model.cfg.decoding.max_symbols)  # fmt: skip
    return [h["ids"] for h in hyps]


@pytest.mark.parametrize("name", TRANSDUCERS)
def test_prediction_joint_and_greedy_decoding_equal_nemos(name):
    model = SpeechModel.restore_from(FIXTURES / f"{name}.nemo")
    loss, hybrid, layers, activation = TRANSDUCERS[name]
    assert isinstance(model, ConformerTransducerModel)
    assert (model.cfg.loss, model.cfg.hybrid, model.cfg.prediction.pred_rnn_layers, model.cfg.joint.activation) == (
        loss, hybrid, layers, activation)  # fmt: skip
    assert model.cfg.decoding.max_symbols == 5 and model.cfg.joint.frame_stack == 1
    if loss == "tdt":
        assert model.durations == [0, 1, 2, 3, 4] and model.cfg.sigma == 0.05 and model.cfg.omega == 0.1
    pred, joint = transducer_differences(model, name)
    print(f"{name}: max |difference| vs NeMo: prediction {pred:.2e}, joint logits {joint:.2e}")
    assert pred < 1e-5 and joint < 1e-4
    expected = load_file(FIXTURES / f"{name}.expected.safetensors")
    ids = greedy_ids(model, name)
    assert ids == [expected[f"greedy_{i}"].tolist() for i in range(2)]
    assert len({token for hyp in ids for token in hyp}) > 2  # informative hypotheses, not one repeated token


def test_tdt_greedy_decoding_skips_frames_as_nemos():
    """The TDT fixture's hypotheses are shorter than its frames: durations > 1 were taken, as NeMo took them."""
    model = SpeechModel.restore_from(FIXTURES / "conformer_tdt.nemo")
    expected = load_file(FIXTURES / "conformer_tdt.expected.safetensors")
    ids = greedy_ids(model, "conformer_tdt")
    assert [len(h) for h in ids] == [len(expected[f"greedy_{i}"]) for i in range(2)]
    assert sum(len(h) for h in ids) < int(expected["greedy_lengths"].sum()) // 2


def test_a_nonzero_blank_embedding_is_zeroed_on_import(tmp_path):
    """NeMo starts the prediction network from a zero vector and never reads the blank's (padding) embedding row;
    ours reads that row as the start symbol, so the import zeroes it."""

    def perturb(members):
        state = load_weights(tmp_path, members["model_weights.ckpt"])
        state["decoder.prediction.embed.weight"][-1] = 1.0
        buffer = io.BytesIO()
        torch.save(state, buffer)
        members["model_weights.ckpt"] = buffer.getvalue()

    path = repack(FIXTURES / "fastconformer_rnnt.nemo", tmp_path / "row.nemo", perturb)
    model = SpeechModel.restore_from(path)
    assert torch.equal(model.prediction.embed.weight[-1], torch.zeros(16))
    assert transducer_differences(model, "fastconformer_rnnt")[1] < 1e-4


@pytest.mark.parametrize("name", TRANSDUCERS)
def test_export_round_trips_with_nemos_names_and_config(name, tmp_path):
    model, members = export_with_the_fixtures_tensors(name, tmp_path)
    ours = yaml.safe_load(members["model_config.yaml"])
    theirs = yaml.safe_load(read_members(FIXTURES / f"{name}.nemo")["model_config.yaml"])
    assert ours["target"] == theirs["target"]
    for section in ("model_defaults", "loss"):
        assert ours[section] == theirs[section], section
    assert ours["decoder"]["prednet"] == theirs["decoder"]["prednet"]
    for key in ("jointnet", "num_classes", "vocabulary", "num_extra_outputs"):
        assert ours["joint"].get(key) == theirs["joint"].get(key), key
    assert ours["decoding"] == {**theirs["decoding"], "greedy": {"max_symbols": 5}}
    again = SpeechModel.restore_from(tmp_path / "out.nemo").eval()
    assert type(again) is ConformerTransducerModel
    assert transducer_differences(again, name)[1] < 1e-4
    assert greedy_ids(again, name) == greedy_ids(model, name)


def test_export_refuses_what_nemos_transducers_do_not_compute(tmp_path):
    model = SpeechModel.restore_from(FIXTURES / "fastconformer_rnnt.nemo")
    for change, word in (({"joint": {"frame_stack": 2}}, "stacked frames"),
                         ({"joint": {"activation": "silu"}}, "'silu' joint"),
                         ({"prediction": {"context_size": 2}}, "stateless prediction network")):  # fmt: skip
        cfg = {**model.cfg, **{k: {**model.cfg[k], **v} for k, v in change.items()}}
        with pytest.raises(ValueError, match=f"x.nemo: this ConformerTransducerModel .*{word}.*\\.stm"):
            ConformerTransducerModel(cfg).save_to(tmp_path / "x.nemo")


def test_a_tdt_checkpoint_without_its_durations_is_refused(tmp_path):
    def drop(config):
        config["loss"]["tdt_kwargs"].pop("durations")
        config["model_defaults"].pop("tdt_durations")

    path = repack(FIXTURES / "conformer_tdt.nemo", tmp_path / "nodur.nemo", _config_edit(drop))
    with pytest.raises(NemoImportError, match="nodur.nemo: a TDT model needs loss.tdt_kwargs.durations.*5"):
        SpeechModel.restore_from(path)


def test_fastemit_is_noted_not_refused(tmp_path, caplog):
    edit = _config_edit(lambda c: c["loss"]["tdt_kwargs"].update(fastemit_lambda=0.001))
    path = repack(FIXTURES / "conformer_tdt.nemo", tmp_path / "fe.nemo", edit)
    model = SpeechModel.restore_from(path)
    assert "FastEmit (fastemit_lambda=0.001) is not applied when fine-tuning here" in caplog.text
    assert transducer_differences(model, "conformer_tdt")[1] < 1e-4


def test_transcribe_and_salm_take_a_transducer_nemo_file(tmp_path):
    from omegaconf import OmegaConf

    from speechtrain.asr.transcribe import main
    from speechtrain.speechlm.model import SALMConfig, prepare_salm_config

    output = tmp_path / "preds.json"
    main([f"model_path={FIXTURES / 'conformer_tdt.nemo'}", f"audio={FIXTURES / 'input_a.wav'}", f"output={output}"])
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    model = SpeechModel.restore_from(FIXTURES / "conformer_tdt.nemo")
    assert rows[0]["pred_text"] == model.transcribe([FIXTURES / "input_a.wav"])[0]
    cfg = OmegaConf.structured(SALMConfig)
    cfg.perception.asr_model, cfg.perception.compression = str(FIXTURES / "conformer_tdt.nemo"), "ctc"
    with pytest.raises(ValueError, match="conformer_tdt.nemo: compression=ctc needs the ASR model's CTC head.*none"):
        prepare_salm_config(cfg)


def test_finetune_from_a_transducer_nemo_file_keeps_its_weights_or_its_encoder(tmp_path):
    from speechtrain.common.tokenizers import CharTokenizer

    base = SpeechModel.restore_from(FIXTURES / "conformer_tdt.nemo")
    finetune = _finetune_module()
    same = finetune.finetune_model(base, {"optim": {"lr": 1e-4}}, defer=True)
    same.configure_model()
    assert all(torch.equal(same.state_dict()[k], v) for k, v in base.state_dict().items())
    CharTokenizer(list(" abcdefghijklmnopqrstuvwxyz'")).save(tmp_path / "letters.json")
    new = finetune.finetune_model(base, {"tokenizer": {"path": str(tmp_path / "letters.json")}})
    assert new.joint.out.weight.shape[0] == 29 + 5 and new.prediction.embed.weight.shape[0] == 29
    assert all(torch.equal(new.state_dict()[k], v) for k, v in base.state_dict().items() if k.startswith("encoder."))


def test_a_character_transducer_loads_with_its_labels(tmp_path):
    """NeMo's EncDecRNNTModel (characters): the joint's vocabulary (or the model's labels) becomes a character
    tokenizer; the outputs are the BPE fixture's (same weights)."""
    labels = list(" abcdefghijklmnopqrstuvwxyz'0123456789-.,")[:40]

    def to_chars(config):
        config["target"] = "nemo.collections.asr.models.rnnt_models.EncDecRNNTModel"
        del config["tokenizer"]
        config["labels"] = labels
        config["joint"]["vocabulary"] = labels

    path = repack(FIXTURES / "conformer_tdt.nemo", tmp_path / "chars.nemo", _config_edit(to_chars))
    model = SpeechModel.restore_from(path)
    assert model.tokenizer.vocab == labels and model.cfg.loss == "tdt"
    assert transducer_differences(model, "conformer_tdt")[1] < 1e-4
    assert greedy_ids(model, "conformer_tdt") == greedy_ids(SpeechModel.restore_from(FIXTURES / "conformer_tdt.nemo"),
                                                            "conformer_tdt")  # fmt: skip


def test_transcribe_chooses_a_hybrids_decoder_and_refuses_the_choice_for_one_decoder(tmp_path, capsys):
    """``decoder_type=ctc|transducer`` (NeMo's ``change_decoding_strategy(decoder_type=...)``) on a hybrid .nemo."""
    from speechtrain.asr.ctc import ConformerCTCModel
    from speechtrain.asr.transcribe import main

    hybrid = FIXTURES / "fastconformer_hybrid.nemo"
    for kind in ("ctc", "transducer"):
        main([f"model_path={hybrid}", f"audio={FIXTURES}", f"output={tmp_path / kind}.json", f"decoder_type={kind}"])
    got = {kind: [json.loads(line)["pred_text"] for line in (tmp_path / f"{kind}.json").read_text().splitlines()]
           for kind in ("ctc", "transducer")}  # fmt: skip
    model = SpeechModel.restore_from(hybrid).eval()
    audio, lengths = fixture_batch()
    with torch.no_grad():
        enc, enc_lengths = model(audio, lengths)
        ctc = ConformerCTCModel.greedy_decode(model, model.ctc_log_probs(enc), enc_lengths)  # the CTC head, by hand
        transducer = model.greedy_decode(enc, enc_lengths)
    assert got == {"ctc": ctc, "transducer": transducer}
    with pytest.raises(SystemExit):
        main([f"model_path={FIXTURES / 'conformer_tdt.nemo'}", f"audio={FIXTURES}", "decoder_type=ctc",
              f"output={tmp_path / 'x.json'}"])  # fmt: skip
    assert "holds a ConformerTransducerModel with one decoder" in capsys.readouterr().err
