import json

import pytest
import torch

from speechtrain.lightning import checkpoint


def test_single_file_checkpoint_is_written_atomically_and_replaces_the_old_one(tmp_path):
    path = tmp_path / "last.ckpt"
    checkpoint.save_checkpoint({"step": 1}, path)
    checkpoint.save_checkpoint({"step": 2}, path)
    assert checkpoint.load_checkpoint(path) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_interrupted_sharded_save_is_not_mistaken_for_a_checkpoint(tmp_path):
    folder = tmp_path / "step=4.ckpt"
    folder.mkdir()
    torch.save({"step": 4}, folder / "tp00_pp000.ckpt")
    with pytest.raises(ValueError, match="incomplete.*interrupted"):
        checkpoint.load_checkpoint(folder)
    (folder / "metadata.json").write_text(
        json.dumps({"format": checkpoint.FORMAT, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1})
    )
    with pytest.raises(ValueError, match="saved with tensor_model_parallel_size=2.*this run uses 1"):
        checkpoint.load_checkpoint(folder)


def test_remove_checkpoint_handles_files_and_folders(tmp_path):
    (tmp_path / "a.ckpt").write_bytes(b"x")
    (tmp_path / "b.ckpt").mkdir()
    checkpoint.remove_checkpoint(tmp_path / "a.ckpt")
    checkpoint.remove_checkpoint(tmp_path / "b.ckpt")
    assert list(tmp_path.iterdir()) == []
