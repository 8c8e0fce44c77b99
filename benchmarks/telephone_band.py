"""A channel never heard: the built-in corpus's ``test`` set through a telephone line (300-3400 Hz, 8 kHz, G.711
mu-law: :func:`speechtrain.data.augment.telephone`, the training augmentation's channel), decoded beside the same
set as recorded.

    python benchmarks/telephone_band.py --model asr_demo.stm [--tag NAME] [--record]

Prints greedy and beam + LM WER on both; ``--record`` appends them to results/channel.jsonl as
``channel.<tag>.{greedy,beam_lm}_wer.{test,test_telephone}``. The channel has no randomness: every run hears the
same audio.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import soundfile as sf
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from human_prompts import test_wers  # noqa: E402

from speechtrain.corpora.builtin import resolve_manifest  # noqa: E402
from speechtrain.data.augment import telephone  # noqa: E402
from speechtrain.data.manifest import read_nemo_manifest  # noqa: E402

SET = "builtin:speech/test"


def rows_of(manifest: Path) -> list[dict]:
    """``manifest``'s rows with absolute audio paths (relative ones are relative to the manifest)."""
    rows = []
    for row in read_nemo_manifest(manifest):
        source = Path(row["audio_filepath"])
        rows.append(dict(row, audio_filepath=str(source if source.is_absolute() else manifest.parent / source)))
    return rows


def write_manifest(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def through_telephone(manifest: Path, out: Path) -> Path:
    """A copy of ``manifest`` whose audio went through the telephone channel (written under ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, row in enumerate(rows_of(manifest)):
        samples, rate = sf.read(row["audio_filepath"], dtype="float32", always_2d=True)
        target = out / f"{i:05d}.wav"
        sf.write(target, telephone(torch.from_numpy(samples.mean(axis=1)), rate).numpy(), rate)
        rows.append(dict(row, audio_filepath=str(target)))
    return write_manifest(rows, out / "manifest.json")


def absolute(manifest: Path, out: Path) -> Path:
    """``manifest`` with absolute audio paths (the decoder reads them as given)."""
    return write_manifest(rows_of(manifest), out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="the archive to decode with")
    parser.add_argument("--set", default=SET, help="the manifest sent through the channel")
    parser.add_argument("--tag", default="demo", help="names the figures (the model's recipe)")
    parser.add_argument("--record", action="store_true", help="append the WERs to results/channel.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    manifest = resolve_manifest(args.set)
    with tempfile.TemporaryDirectory() as tmp:
        sets = {"test": absolute(manifest, Path(tmp) / "wide.json"),
                "test_telephone": through_telephone(manifest, Path(tmp) / "telephone")}  # fmt: skip
        wers = {name: test_wers(args.model, path) for name, path in sets.items()}
    print("\n| set | greedy | beam + LM |\n|---|---|---|")
    for name, found in wers.items():
        print(f"| {name} | {found['greedy']:.2f}% | {found['beam']:.2f}% |")
    if args.record:
        from results import append

        command = f"python benchmarks/telephone_band.py --model <{args.model.name}> --tag {args.tag}"
        count = len(read_nemo_manifest(manifest))
        note = f"{args.set}, {count} utterances, as recorded and through 300-3400 Hz, 8 kHz, mu-law"
        for name, found in wers.items():
            for key, label in (("greedy", "greedy_wer"), ("beam", "beam_lm_wer")):
                append(f"channel.{args.tag}.{label}.{name}", round(found[key], 2), "%", command, note)


if __name__ == "__main__":
    main()
