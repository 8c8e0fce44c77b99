"""Long files with the demo's model (hybrid TDT-CTC): RTFx and WER of chunked transcription, greedy and beam + LM,
with word timestamps, on 2- and 10-minute files of one voice's speech from the built-in corpus's test split.

    python benchmarks/long_audio_hybrid.py --model speechtrain_experiments/asr_demo/<run>/asr_demo.stm [--record]

Each long file is one voice's test utterances (``builtin:speech/test``, ``--voice``, default Piper's neural voice:
a long recording is mostly one speaker) one after another with 0.3 s pauses (from the start again when they run
out), its reference their transcripts joined. For each file and decoding: ``transcribe_paths`` with the CLI's
defaults (split at pauses, 30 s chunks, 4 s of context; ``--split fixed``: chunks only) and
``timestamps=true``, timed (RTFx: audio seconds per second, model loading
excluded), its WER against the reference, and the WER of the same utterances decoded one by one (what the model
does on the inputs it was trained on, the baseline for the long file). On the 2-minute file also the whole file in
one pass (no chunks; it fits in memory), and the WER between the two transcripts. ``--record`` appends the figures
to results/speed.jsonl.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from speechtrain.asr.transcribe import transcribe_paths  # noqa: E402
from speechtrain.common.metrics import word_error_rate  # noqa: E402
from speechtrain.core.model import SpeechModel  # noqa: E402
from speechtrain.corpora.builtin import resolve_manifest  # noqa: E402
from speechtrain.data.manifest import read_nemo_manifest  # noqa: E402


def long_file(path: Path, minutes: float, voice: str, skip: int = 0) -> tuple[dict, list[dict]]:
    """A file of about ``minutes`` of ``voice``'s test utterances from the ``skip``-th on, its row, and the rows of
    the utterances it holds."""
    manifest = resolve_manifest("builtin:speech/test")
    records = [r for r in read_nemo_manifest(manifest) if r.get("voice") == voice]
    if not records:
        raise SystemExit(f"--voice {voice}: no utterance of builtin:speech/test has that voice.")
    pause = np.zeros(int(0.3 * 16000), dtype=np.float32)
    audio, parts, total, index = [], [], 0, skip
    while total < minutes * 60 * 16000:
        record = records[index % len(records)]
        data, rate = sf.read(manifest.parent / record["audio_filepath"], dtype="float32")
        assert rate == 16000, f"{record['audio_filepath']}: {rate} Hz"
        audio += [data, pause]
        parts.append({**record, "audio_filepath": str(manifest.parent / record["audio_filepath"])})
        total += len(data) + len(pause)
        index += 1
    samples = np.concatenate(audio)
    sf.write(path, samples, 16000)
    row = {"audio_filepath": str(path), "duration": round(len(samples) / 16000, 4),
           "text": " ".join(r["text"] for r in parts)}  # fmt: skip
    return row, parts


def run(model, row: dict, decoding: str, chunk_len: float | None = 30.0, split: str = "pauses") -> tuple[float, dict]:
    model.cfg.decoding.strategy = decoding
    start = time.perf_counter()
    (out,) = transcribe_paths(
        model, [dict(row)], chunk_len=chunk_len, chunk_overlap=4.0, timestamps=chunk_len is not None, split=split
    )
    return row["duration"] / (time.perf_counter() - start), out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the demo's archive (make demo)")
    parser.add_argument("--minutes", default="2,10", help="file lengths in minutes")
    parser.add_argument("--voice", default="piper:joe", help="the voice of builtin:speech/test the files are made of")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--split", default="pauses", choices=("pauses", "fixed"), help="the CLI's split")
    parser.add_argument("--record", action="store_true", help="append the figures to results/speed.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]  # recorded with the figures: RTFx on a shared machine depends on it
    model = SpeechModel.restore_from(args.model).eval()
    norm = model.text_normalizer
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, minutes in enumerate(float(m) for m in args.minutes.split(",")):
            row, parts = long_file(Path(tmp) / f"long{n}.wav", minutes, args.voice, skip=40 * n)
            for decoding in ("greedy", "beam"):
                speed, out = run(model, row, decoding, split=args.split)
                wer = word_error_rate([norm(out["pred_text"])], [norm(row["text"])])
                alone = transcribe_paths(model, [dict(r) for r in parts])
                alone_wer = word_error_rate([norm(r["pred_text"]) for r in alone], [norm(r["text"]) for r in parts])
                line = {"minutes": round(row["duration"] / 60, 1), "decoding": decoding, "rtfx": round(speed, 1),
                        "wer": round(100 * wer, 2), "utterances_alone_wer": round(100 * alone_wer, 2),
                        "words": len(out["words"])}  # fmt: skip
                if minutes <= 2:
                    _, whole = run(model, row, decoding, chunk_len=None)
                    line["whole_file_wer"] = round(100 * word_error_rate([norm(whole["pred_text"])],
                                                                         [norm(row["text"])]), 2)  # fmt: skip
                    line["chunked_vs_whole"] = round(
                        100 * word_error_rate([out["pred_text"]], [whole["pred_text"]]), 2
                    )
                print(line, flush=True)
                rows.append(line)
    if args.record:
        from results import append

        command = f"python benchmarks/long_audio_hybrid.py --model <asr_demo.stm> --voice {args.voice}"
        command += "" if args.split == "pauses" else " --split fixed"
        split = "split at pauses, then" if args.split == "pauses" else "fixed"
        for line in rows:
            minutes = f"{line['minutes']:g}".replace(".", "_")
            note = (f"demo archive (hybrid TDT-CTC), {line['minutes']:g}-min file of {args.voice}'s "
                    f"builtin:speech/test utterances, {split} 30 s chunks + 4 s context, word timestamps, "
                    f"{args.threads} threads; WER {line['wer']}% (the same utterances one by one: "
                    f"{line['utterances_alone_wer']}%); load average {load:.1f} at the start")  # fmt: skip
            if "whole_file_wer" in line:
                note += (f"; whole file in one pass {line['whole_file_wer']}%, chunked vs whole transcripts differ by "
                         f"{line['chunked_vs_whole']}%")  # fmt: skip
            suffix = "" if args.split == "pauses" else "_fixed"
            figure = f"speed.long_audio_rtfx.hybrid_{line['decoding']}_{minutes}min{suffix}"
            append(figure, line["rtfx"], "RTFx", command, note)


if __name__ == "__main__":
    main()
