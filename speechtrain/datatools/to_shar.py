"""Pack NeMo manifests and lhotse cuts into lhotse Shar shards, so training reads a few large files in sequence.

    python -m speechtrain.datatools.to_shar train.json [more.json cuts.jsonl.gz ...] --out DIR --shard-size 1000 \\
        [--audio-format flac] [--shuffle --seed 0] [--sample-rate 16000]

One shard is ``DIR/recording.NNNNNN.tar`` (the audio of ``--shard-size`` utterances, encoded as ``--audio-format``)
plus ``DIR/cuts.NNNNNN.jsonl.gz`` (their metadata). Network storage serves such large sequential reads well, where
one small file per utterance is slow. Train on the folder with ``shar_path: DIR`` in a dataset config, or an
``input_cfg`` entry ``{type: lhotse_shar, shar_path: DIR}``.

- Every cut keeps its transcript, language and the manifest's extra keys (its custom fields).
- ``--shuffle`` mixes the inputs before sharding (seeded), so that every shard is a sample of the whole corpus;
  without it, shards follow the input order.
- Utterances whose audio is missing, unreadable or shorter than the manifest says are skipped and counted; the
  summary names a few of them. Audio stored at another rate than the cut's (the manifest's ``sampling_rate``,
  else ``--sample-rate``) is resampled to the cut's rate.
- Audio is decoded and encoded by libsndfile (``soundfile``), lhotse's first-choice backend: FFmpeg and
  torchaudio's I/O are not needed. ``flac`` is lossless and about half the size of ``wav``.

Python API: :func:`convert_to_shar`, which returns a :class:`SharSummary`.
"""

import argparse
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import soundfile as sf

from speechtrain.data.lhotse_loader import blend_sources
from speechtrain.datatools.blend_weights import source_entry

AUDIO_FORMATS = ("flac", "wav")
# Paths of skipped utterances named in the summary.
MAX_EXAMPLES = 5


@dataclass
class SharSummary:
    """What :func:`convert_to_shar` wrote and skipped."""

    out_dir: str
    shards: int = 0
    utterances: int = 0
    seconds: float = 0.0
    skipped: int = 0
    skipped_examples: list[tuple[str, str]] = field(default_factory=list)  # (audio path or cut ID, reason)

    @property
    def hours(self) -> float:
        return self.seconds / 3600

    def __str__(self) -> str:
        lines = [f"{self.out_dir}: {self.shards} shards, {self.utterances} utterances, {self.hours:.3f} hours, "
                 f"{self.skipped} skipped"]  # fmt: skip
        if self.skipped:
            lines.append(f"skipped {self.skipped} utterances whose audio could not be read, e.g.:")
            lines += [f"  {where}: {why}" for where, why in self.skipped_examples]
        return "\n".join(lines)


def _read_inputs(inputs: list[str | Path], sample_rate: int) -> list[Any]:
    cuts = []
    for path in inputs:
        entry = source_entry(path)
        if entry["type"] == "lhotse_shar":
            raise ValueError(f"{path} is a folder; give NeMo manifests or lhotse cuts files (.jsonl/.jsonl.gz).")
        cuts.extend(blend_sources([entry], sample_rate))
    return cuts


def _audio_path(cut: Any) -> str:
    if cut.has_recording and cut.recording.sources[0].type == "file":
        return cut.recording.sources[0].source
    return cut.id


def _why(cut: Any, error: Exception) -> str:
    """A one-line reason; lhotse's message lists every backend it tried, the first one's (libsndfile) is enough."""
    path = _audio_path(cut)
    if path != cut.id:
        if not Path(path).exists():
            return "file not found"
        if not Path(path).is_file():
            return "not a file"
        try:
            seconds = sf.info(path).duration
        except sf.SoundFileError as e:
            return f"unreadable: {e}"
        if seconds < cut.end:
            return f"the file holds {seconds:.3f} s, the manifest asks for {cut.start:.3f}-{cut.end:.3f} s"
    lines = str(error).splitlines() or [type(error).__name__]
    first_backend = next((line for line in lines if line.startswith("Exception #0")), lines[0])
    return f"unreadable: {first_backend.rpartition('>: ')[2][:200]}"


def _check_empty(out_dir: Path) -> None:
    existing = sorted(out_dir.glob("cuts.*")) + sorted(out_dir.glob("recording.*"))
    if existing:
        raise FileExistsError(
            f"{out_dir} already holds Shar shards ({existing[0].name}, ...); choose an empty folder."
        )


def convert_to_shar(
    inputs: list[str | Path],
    out_dir: str | Path,
    shard_size: int = 1000,
    audio_format: str = "flac",
    shuffle: bool = False,
    seed: int = 0,
    sample_rate: int = 16000,
) -> SharSummary:
    """Write the utterances of ``inputs`` to lhotse Shar shards in ``out_dir`` (see module docstring).

    Args:
        inputs: NeMo manifests and/or lhotse cuts files (``.jsonl``/``.jsonl.gz``), concatenated in order.
        out_dir: Output folder; created if needed, and must not hold shards already.
        shard_size: Utterances per shard (the last shard may hold fewer).
        audio_format: ``flac`` (lossless, compressed) or ``wav``.
        shuffle: Shuffle the utterances of all inputs together before sharding.
        seed: Seed of that shuffle.
        sample_rate: Sample rate of NeMo manifest lines without a ``sampling_rate`` key.

    Returns:
        Counts of shards, utterances, seconds and skipped utterances, with a few skipped paths and why.

    Raises:
        ValueError: On a bad argument or manifest line (``ManifestError`` names the file and line).
        FileExistsError: If ``out_dir`` already holds shards.
    """
    from lhotse.audio.utils import AudioLoadingError, DurationMismatchError
    from lhotse.shar import SharWriter

    if shard_size < 1:
        raise ValueError(f"shard_size must be at least 1, got {shard_size}.")
    if audio_format not in AUDIO_FORMATS:
        raise ValueError(f"audio_format={audio_format!r} is not supported; choose one of {', '.join(AUDIO_FORMATS)}.")
    if not inputs:
        raise ValueError("No inputs: give at least one NeMo manifest or lhotse cuts file.")
    cuts = _read_inputs(inputs, sample_rate)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_empty(out_dir)
    if shuffle:
        random.Random(seed).shuffle(cuts)
    summary = SharSummary(out_dir=str(out_dir))
    with SharWriter(str(out_dir), fields={"recording": audio_format}, shard_size=shard_size) as writer:
        for cut in cuts:
            try:
                # The writer decodes the audio before it writes anything, so a failed cut leaves no trace.
                writer.write(cut)
            except (AudioLoadingError, DurationMismatchError, sf.SoundFileError) as e:
                summary.skipped += 1
                if len(summary.skipped_examples) < MAX_EXAMPLES:
                    summary.skipped_examples.append((_audio_path(cut), _why(cut, e)))
                continue
            summary.utterances += 1
            summary.seconds += cut.duration
    summary.shards = len(writer.output_paths.get("cuts", []))
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m speechtrain.datatools.to_shar", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("inputs", nargs="+", help="NeMo manifests (.json) and/or lhotse cuts (.jsonl[.gz])")
    parser.add_argument("--out", required=True, help="output folder (created; must hold no shards yet)")
    parser.add_argument("--shard-size", type=int, default=1000, help="utterances per shard")
    parser.add_argument("--audio-format", choices=AUDIO_FORMATS, default="flac")
    parser.add_argument("--shuffle", action="store_true", help="shuffle all utterances before sharding")
    parser.add_argument("--seed", type=int, default=0, help="seed of --shuffle")
    parser.add_argument("--sample-rate", type=int, default=16000, help="rate of manifest lines without one")
    args = parser.parse_args(argv)
    try:
        summary = convert_to_shar(args.inputs, args.out, args.shard_size, args.audio_format, args.shuffle,
                                  args.seed, args.sample_rate)  # fmt: skip
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    print(summary)
    if summary.utterances == 0:
        sys.exit("error: no utterance could be read; no shard was written.")


if __name__ == "__main__":
    main()
