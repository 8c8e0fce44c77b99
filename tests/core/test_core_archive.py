import io
import json
import tarfile

import pytest
import torch
from conftest import tiny_ctc_config

from speechtrain.asr.conv_ctc import ConvCTCModel
from speechtrain.common.tokenizers import CharTokenizer
from speechtrain.core.archive import ArchiveError, read_archive, write_archive
from speechtrain.core.model import SpeechModel


def _model_with_tokenizer_file(tmp_path):
    vocab_file = tmp_path / "vocab.json"
    CharTokenizer([" ", *"0123456789"]).save(vocab_file)
    cfg = tiny_ctc_config()
    cfg["tokenizer"] = {"path": str(vocab_file)}
    torch.manual_seed(0)
    return ConvCTCModel(cfg)


def _outputs(model):
    torch.manual_seed(1)
    audio = torch.randn(2, 8000)
    model.eval()
    with torch.no_grad():
        return model(audio, torch.tensor([8000, 5000]))


def test_round_trip_gives_identical_outputs_and_keeps_artifacts(tmp_path):
    model = _model_with_tokenizer_file(tmp_path)
    path = model.save_to(tmp_path / "out" / "model.stm")
    (tmp_path / "vocab.json").unlink()  # the archive must carry its own tokenizer

    for restored in (SpeechModel.restore_from(path), ConvCTCModel.restore_from(path)):
        assert type(restored) is ConvCTCModel
        assert restored.tokenizer == model.tokenizer
        (a, la), (b, lb) = _outputs(model), _outputs(restored)
        assert torch.equal(a, b) and torch.equal(la, lb)

    # Saving a restored model again packs the artifact again.
    again = SpeechModel.restore_from(path).save_to(tmp_path / "again.stm")
    assert read_archive(again).config["tokenizer"]["path"].endswith("vocab.json")
    with tarfile.open(again) as tar:
        assert "artifacts/vocab.json" in tar.getnames()
        config_text = tar.extractfile("model_config.yaml").read().decode()
    assert "stm:vocab.json" in config_text


def test_override_config_on_restore(tmp_path):
    model = _model_with_tokenizer_file(tmp_path)
    path = model.save_to(tmp_path / "m.stm")
    restored = SpeechModel.restore_from(path, override_config={"preprocessor": {"dither": 0.5}})
    assert restored.cfg.preprocessor.dither == 0.5


def test_write_is_atomic_and_leaves_no_temporary_files(tmp_path):
    write_archive(tmp_path / "a.stm", {"x": 1}, {"w": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.stm"]


def test_truncated_archive_is_named(tmp_path):
    path = write_archive(tmp_path / "a.stm", {"x": 1}, {"w": torch.ones(1000)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArchiveError, match="a.stm"):
        read_archive(path)


def test_corrupted_member_fails_checksum(tmp_path):
    path = write_archive(tmp_path / "a.stm", {"x": 1}, {"w": torch.zeros(64)})
    with tarfile.open(path) as tar:
        offset = tar.getmember("model_weights.safetensors").offset_data
    data = bytearray(path.read_bytes())
    data[offset + 200] ^= 0xFF  # one flipped bit pattern inside the weights payload
    path.write_bytes(bytes(data))
    with pytest.raises(ArchiveError, match="checksum"):
        read_archive(path)


def test_not_an_archive_and_missing_file(tmp_path):
    junk = tmp_path / "junk.stm"
    junk.write_bytes(b"definitely not a tar file" * 40)
    with pytest.raises(ArchiveError, match="junk.stm"):
        read_archive(junk)
    with pytest.raises(FileNotFoundError, match="nope.stm"):
        read_archive(tmp_path / "nope.stm")


def _tar_with(path, members):
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


@pytest.mark.parametrize("name", ["/etc/passwd", "../escape.txt", "artifacts/../../escape.txt"])
def test_hostile_member_paths_are_refused(tmp_path, name):
    info = tarfile.TarInfo(name)
    info.size = 3
    _tar_with(tmp_path / "evil.stm", [(info, b"bad")])
    with pytest.raises(ArchiveError, match="unsafe path"):
        read_archive(tmp_path / "evil.stm")
    assert not (tmp_path.parent / "escape.txt").exists()


def test_links_are_refused(tmp_path):
    link = tarfile.TarInfo("artifacts/link")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    _tar_with(tmp_path / "evil.stm", [(link, None)])
    with pytest.raises(ArchiveError, match="regular files"):
        read_archive(tmp_path / "evil.stm")


def test_other_tar_formats_are_named(tmp_path):
    manifest = json.dumps({"format": "something-else"}).encode()
    info = tarfile.TarInfo("manifest.json")
    info.size = len(manifest)
    _tar_with(tmp_path / "other.stm", [(info, manifest)])
    with pytest.raises(ArchiveError, match="not a speechtrain archive"):
        read_archive(tmp_path / "other.stm")


def test_archive_cannot_name_foreign_classes(tmp_path):
    path = write_archive(tmp_path / "a.stm", {"_target_": "os.system", "x": 1}, {})
    with pytest.raises(ValueError, match="not an imported speechtrain model"):
        SpeechModel.restore_from(path)
