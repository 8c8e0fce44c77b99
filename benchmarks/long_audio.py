"""Long-audio transcription: RTFx of chunked CTC inference on a 10-minute file, and the WER of chunked vs
whole-file decoding on files that fit both ways.

    python benchmarks/long_audio.py [--model model.stm] [--train-seconds 90] [--minutes 10]

Without ``--model``, a small Conformer-CTC is trained first (``--train-seconds`` of training, CPU) on generated
DTMF-digit utterances concatenated into 3-25 s files, so that the WER means something. The long files are made the
same way from other utterances (0.3 s pauses); their reference is the concatenated transcripts.

1. RTFx (audio seconds per second) of ``transcribe_paths`` on a ``--minutes`` file, chunked (``split=fixed``: 30 s
   chunks, 4 s of context; the split at pauses is measured by ``long_audio_hybrid.py``), with word timestamps; for
   the trained model and for an untrained FastConformer ``small`` (14M; the compute of a real model, weights do not
   matter for speed).
2. WER on ten 60-second files, whole-file decoding vs chunked with 10 s chunks (6 chunk borders per file).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from speechtrain.asr.ctc import INTERCTC_OFF, UNET_OFF
from speechtrain.asr.transcribe import transcribe_paths
from speechtrain.common import metrics
from speechtrain.corpora.dtmf import make_dtmf_corpus

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _dhms(seconds: float) -> str:
    """Lightning's ``max_time`` string (``DD:HH:MM:SS``, each field below its base) for ``seconds``."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days:02d}:{hours:02d}:{minutes:02d}:{secs:02d}"


def concatenate(records: list[dict], source: Path, folder: Path, name: str, seconds: float, pieces) -> dict:
    """A file of about ``seconds`` made of the next DTMF utterances of ``pieces`` with 0.3 s pauses, and its row."""
    pause = np.zeros(int(0.3 * 16000), dtype=np.float32)
    audio, texts = [], []
    while sum(len(a) for a in audio) < seconds * 16000:
        record = next(pieces)
        data, _ = sf.read(source / record["audio_filepath"], dtype="float32")
        audio += [data, pause]
        texts.append(record["text"])
    path = folder / f"{name}.wav"
    sf.write(path, np.concatenate(audio), 16000)
    return {"audio_filepath": str(path), "duration": round(len(np.concatenate(audio)) / 16000, 4),
            "text": " ".join(texts)}  # fmt: skip


def corpus(folder: Path, utterances: int, seed: int, lengths: list[float]) -> list[dict]:
    """DTMF utterances (0.4-1.7 s each) concatenated into files of the given lengths (seconds)."""
    manifest = make_dtmf_corpus(folder / "src", utterances, seed=seed, id_prefix=f"s{seed}")
    records = [json.loads(line) for line in manifest.read_text().splitlines()]
    pieces = iter(records)
    return [concatenate(records, manifest.parent, folder, f"f{i}", length, pieces) for i, length in enumerate(lengths)]


def write_manifest(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_dtmf_model(folder: Path, seconds: float) -> Path:
    """A small Conformer-CTC trained on concatenated DTMF utterances of 3-25 s (the lengths it will decode)."""
    from speechtrain.asr.ctc import ConformerCTCConfig
    from speechtrain.common.tokenizers import CharTokenizer
    from speechtrain.core.hydra_runner import compose_config
    from speechtrain.core.job import train_job_schema
    from speechtrain.lightning import CallbackGroup

    rng = np.random.default_rng(0)
    train = write_manifest(corpus(folder / "train", 2000, 1, list(rng.uniform(3, 25, 140))), folder / "train.json")
    dev = write_manifest(corpus(folder / "dev", 200, 2, list(rng.uniform(3, 25, 12))), folder / "dev.json")
    tokenizer = folder / "digits.json"
    CharTokenizer([" ", *"0123456789"]).save(tokenizer)
    overrides = [
        f"exp_manager.exp_dir={folder / 'exp'}", "trainer.precision=32", f"trainer.max_time={_dhms(seconds)}",
        "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0", f"model.tokenizer.path={tokenizer}",
        f"model.train_ds.manifest_filepath={train}", f"model.validation_ds.manifest_filepath={dev}",
        "model.encoder.d_model=64", "model.encoder.num_layers=2", "model.encoder.num_heads=2",
        *INTERCTC_OFF,
        *UNET_OFF,
        "model.encoder.conv_kernel_size=15", "model.encoder.subsampling_conv_channels=32",
        "model.encoder.subsampling_factor=4", "model.preprocessor.n_mels=40", "model.decoding.strategy=greedy",
        "model.train_ds.batch_duration=120", "model.train_ds.max_duration=30", "model.train_ds.num_workers=1",
        "model.optim.lr=3e-3", "model.optim.sched.warmup_steps=50", "name=dtmf",
    ]  # fmt: skip
    cfg = compose_config(EXAMPLES / "conf", "asr_train", overrides, train_job_schema(ConformerCTCConfig))
    import importlib.util

    spec = importlib.util.spec_from_file_location("asr_train", EXAMPLES / "asr_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(cfg)
    CallbackGroup.get_instance().callbacks.clear()
    return next((folder / "exp" / "dtmf").glob("*/dtmf.stm"))


def rtfx(model, row: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    (out,) = transcribe_paths(model, [dict(row)], chunk_len=30.0, chunk_overlap=4.0, timestamps=True, split="fixed")
    seconds = time.perf_counter() - start
    return out["duration"] / seconds, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--train-seconds", type=float, default=90.0)
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from speechtrain.asr.ctc import ConformerCTCModel
    from speechtrain.core.model import SpeechModel

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = Path(args.model) if args.model else train_dtmf_model(folder, args.train_seconds)
        model = SpeechModel.restore_from(path, override_config={"decoding": {"strategy": "greedy"}}).eval()
        (long,) = corpus(folder / "long", int(args.minutes * 60 / 1.0) + 50, 9, [args.minutes * 60])
        minutes = corpus(folder / "minutes", 700, 10, [60.0] * 10)
        speed, out = rtfx(model, long)
        long_wer = metrics.word_error_rate([out["pred_text"]], [long["text"]])
        minutes_long = out["duration"] / 60
        print(
            f"trained model ({model.num_parameters / 1e6:.2f}M): {minutes_long:.1f} min file, RTFx {speed:.0f}, "
            f"WER {100 * long_wer:.2f}%, {len(out['words'])} words with timestamps",
            flush=True,
        )
        torch.manual_seed(0)
        big = ConformerCTCModel({"size": "small", "tokenizer": {"vocab": [" ", *"0123456789"]}}).eval()
        big_speed, _ = rtfx(big, long)
        print(f"FastConformer small ({big.num_parameters / 1e6:.1f}M, untrained): RTFx {big_speed:.1f}", flush=True)
        whole = transcribe_paths(model, [dict(r) for r in minutes], chunk_len=None, batch_duration=60.0)
        chunked = transcribe_paths(model, [dict(r) for r in minutes], chunk_len=10.0, chunk_overlap=2.0, split="fixed")
        refs = [r["text"] for r in minutes]
        wer_whole = metrics.word_error_rate([r["pred_text"] for r in whole], refs)
        wer_chunked = metrics.word_error_rate([r["pred_text"] for r in chunked], refs)
        agree = metrics.word_error_rate([r["pred_text"] for r in chunked], [r["pred_text"] for r in whole])
        words = sum(len(r.split()) for r in refs)
        print("\n| figure | value |\n|---|---|")
        print(
            f"| RTFx, {out['duration'] / 60:.1f}-min file, chunked 30 s + 4 s context, timestamps, 1 thread | "
            f"{speed:.0f} (trained {model.num_parameters / 1e6:.2f}M model), {big_speed:.1f} (FastConformer small) |"
        )
        print(f"| WER whole-file vs chunked (10 s chunks), 10 x 60 s, {words} words | {100 * wer_whole:.2f}% vs "
              f"{100 * wer_chunked:.2f}% (difference {100 * (wer_chunked - wer_whole):+.2f} points; chunked vs "
              f"whole transcripts differ by {100 * agree:.2f}% WER) |")  # fmt: skip


if __name__ == "__main__":
    main()
