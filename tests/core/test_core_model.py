import pytest
import torch
from conftest import tiny_ctc_config

from speechtrain.asr.conv_ctc import ConvCTCModel
from speechtrain.common.config import ConfigError
from speechtrain.core.model import SpeechModel


def test_unknown_model_key_names_it_and_suggests():
    cfg = tiny_ctc_config()
    cfg["encoder"]["d_modle"] = 32
    with pytest.raises(ConfigError, match=r"Unknown config key 'encoder.d_modle'. Did you mean 'encoder.d_model'\?"):
        ConvCTCModel(cfg)


def test_wrong_type_names_the_key():
    cfg = tiny_ctc_config()
    cfg["encoder"]["num_layers"] = "many"
    with pytest.raises(ConfigError, match="encoder.num_layers"):
        ConvCTCModel(cfg)


def test_partial_init_with_changed_vocabulary_reports_instead_of_crashing(tmp_path):
    torch.manual_seed(0)
    source = ConvCTCModel(tiny_ctc_config())
    path = source.save_to(tmp_path / "src.stm")

    cfg = tiny_ctc_config()
    cfg["tokenizer"]["vocab"] = [" ", *"0123456789abc"]  # 3 more characters: new decoder shape
    target = ConvCTCModel(cfg)
    before_decoder = target.decoder.weight.detach().clone()
    report = target.init_from_pretrained(path)

    assert ("decoder.weight", (12, 16), (15, 16)) in report.mismatched
    assert "decoder.weight" in report.missing and "decoder.bias" in report.missing
    assert torch.equal(target.decoder.weight, before_decoder)
    for name, tensor in source.state_dict().items():
        if not name.startswith("decoder."):
            assert torch.equal(target.state_dict()[name], tensor), name
    assert "shape mismatch decoder.weight" in str(report)


def test_include_and_exclude_patterns(tmp_path):
    torch.manual_seed(0)
    source = ConvCTCModel(tiny_ctc_config())
    torch.manual_seed(1)
    target = ConvCTCModel(tiny_ctc_config())
    report = target.init_from_pretrained(
        source, include=["encoder.blocks", "encoder.subsample.*"], exclude=["encoder.blocks.0.norm"]
    )
    assert set(report.loaded) == {
        k for k in source.state_dict() if k.startswith(("encoder.blocks.", "encoder.subsample."))
    } - {
        "encoder.blocks.0.norm.weight",
        "encoder.blocks.0.norm.bias",
    }
    assert "decoder.weight" in report.excluded and "encoder.blocks.0.norm.weight" in report.excluded
    assert torch.equal(target.encoder.subsample.weight, source.encoder.subsample.weight)
    assert not torch.equal(target.decoder.weight, source.decoder.weight)


def test_init_from_lightning_checkpoint(tmp_path):
    torch.manual_seed(0)
    source = ConvCTCModel(tiny_ctc_config())
    ckpt = tmp_path / "x.ckpt"
    torch.save({"state_dict": source.state_dict()}, ckpt)
    target = ConvCTCModel(tiny_ctc_config())
    report = target.init_from_pretrained(ckpt)
    assert len(report.loaded) == len(source.state_dict()) and not report.missing
    with pytest.raises(ValueError, match="no 'state_dict'"):
        torch.save({"weights": 1}, tmp_path / "bad.ckpt")
        target.init_from_pretrained(tmp_path / "bad.ckpt")


def test_from_pretrained_resolves_names_in_the_models_cache(tmp_path, monkeypatch):
    from speechtrain.lightning import settings

    monkeypatch.setattr(settings, "SPEECHTRAIN_MODELS_CACHE", tmp_path)
    model = ConvCTCModel(tiny_ctc_config())
    model.save_to(tmp_path / "digits.stm")
    (tmp_path / "folder").mkdir()
    model.save_to(tmp_path / "folder" / "any-name.stm")
    assert isinstance(SpeechModel.from_pretrained("digits"), ConvCTCModel)
    assert isinstance(SpeechModel.from_pretrained("folder"), ConvCTCModel)
    assert isinstance(SpeechModel.from_pretrained(tmp_path / "digits.stm"), ConvCTCModel)
    with pytest.raises(FileNotFoundError, match=r"available: digits"):
        SpeechModel.from_pretrained("nope")
