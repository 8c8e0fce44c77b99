"""The LibriSpeech recipe's data path on a tiny generated folder in LibriSpeech's layout (no download): lhotse's
LibriSpeech preparation -> cuts -> the recipe's YAML -> tokenizer from the cuts -> a few training steps and a
validation on dev-clean and dev-other."""

from pathlib import Path

import numpy as np
import soundfile as sf
from lhotse import CutSet
from lhotse.recipes import prepare_librispeech

from speechtrain.asr.ctc import ConformerCTCConfig
from speechtrain.core.hydra_runner import compose_config
from speechtrain.core.job import train_job_schema
from tests.conftest import example_main

EXAMPLES = Path(__file__).parents[2] / "examples"
WORDS = "she had your dark suit in greasy wash water all year don't ask me to carry an oily rag like that".upper()


def _librispeech_folder(root: Path) -> Path:
    """LibriSpeech/<part>/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac with <speaker>-<chapter>.trans.txt."""
    rng = np.random.default_rng(0)
    words = WORDS.split()
    for part, speakers in (("train-clean-100", (19, 26)), ("dev-clean", (84,)), ("dev-other", (116,))):
        for speaker in speakers:
            chapter = 100 + speaker
            folder = root / "LibriSpeech" / part / str(speaker) / str(chapter)
            folder.mkdir(parents=True)
            lines = []
            for utt in range(4):
                uid = f"{speaker}-{chapter}-{utt:04d}"
                text = " ".join(words[(utt * 3 + i) % len(words)] for i in range(3 + utt))
                t = np.arange(int(16000 * (0.8 + 0.3 * utt))) / 16000
                audio = 0.1 * np.sin(2 * np.pi * (200 + 40 * utt) * t) + 0.01 * rng.standard_normal(t.size)
                sf.write(folder / f"{uid}.flac", audio.astype(np.float32), 16000)
                lines.append(f"{uid} {text}")
            (folder / f"{speaker}-{chapter}.trans.txt").write_text("\n".join(lines) + "\n")
    return root / "LibriSpeech"


def test_the_librispeech_recipe_trains_from_lhotse_cuts(tmp_path, capsys):
    corpus = _librispeech_folder(tmp_path)
    # What `lhotse prepare librispeech --normalize-text lower` and `lhotse cut simple` do, in-process.
    manifests = prepare_librispeech(corpus, output_dir=tmp_path / "data", normalize_text="lower")
    cuts = {}
    for part, m in manifests.items():
        cuts[part] = tmp_path / "data" / f"cuts_{part}.jsonl.gz"
        CutSet.from_manifests(recordings=m["recordings"], supervisions=m["supervisions"]).to_file(cuts[part])
    overrides = [
        f"model.train_ds.cuts_path=[{cuts['train-clean-100']}]",
        f"model.validation_ds.cuts_path=[{cuts['dev-clean']},{cuts['dev-other']}]",
        f"exp_manager.exp_dir={tmp_path / 'exp'}", "exp_manager.resume_if_exists=false",
        "trainer.accelerator=cpu", "trainer.devices=1", "trainer.precision=32", "trainer.max_steps=3",
        "trainer.val_check_interval=3", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "model.size=debug", "model.encoder.xscaling=false", "model.tokenizer.vocab_size=40",
        "model.train_ds.batch_duration=6", "model.train_ds.num_workers=0", "model.validation_ds.num_workers=0",
        "model.optim.sched.warmup_steps=1", "exp_manager.checkpoint_callback_params.every_n_train_steps=3",
    ]  # fmt: skip
    cfg = compose_config(EXAMPLES / "conf", "librispeech_fastconformer_ctc", overrides,
                         train_job_schema(ConformerCTCConfig))  # fmt: skip
    model = example_main()(cfg)
    assert model.trainer.global_step == 3
    assert model.tokenizer.vocab_size == 40 and "<unk>" not in model.tokenizer.decode(
        model.tokenizer.encode("she had")
    )
    out = capsys.readouterr().out
    assert "val_wer_cuts_dev-clean=" in out and "val_wer_cuts_dev-other=" in out
    assert "transcripts lowercase, no punctuation" in out
    run = next((tmp_path / "exp" / "librispeech_fastconformer_ctc").iterdir())
    assert (run / "librispeech_fastconformer_ctc.stm").is_file()
