"""Transcribe audio with a saved model: one file, a folder of audio files, or a NeMo manifest.

    python -m speechtrain.asr.transcribe model_path=model.stm audio=test_manifest.json \\
        [output=preds.json] [batch_duration=300] [batch_size=null] [device=auto|cpu|cuda] [precision=32|bf16] \\
        [decoding=greedy|beam] [lm_path=lm.arpa] [beam_size=16] [lm_weight=1.0] [word_score=0.0] \\
        [decoder_type=transducer|ctc] [chunk_len=30] [chunk_overlap=4] [split=pauses|fixed] [min_pause=0.3] \\
        [timestamps=false] [wer.lowercase=true ...]
        [streaming=true [chunk=2] [att_context_size=[70,1]]]

Decoding follows the model's ``decoding`` config (the demo's archives: beam search with the word 3-gram LM fitted
on their training transcripts); the decoding keys override it for this run.

Utterances are sorted by duration and grouped into batches of at most ``batch_duration`` seconds of audio (and at
most ``batch_size`` utterances when set), so that little compute goes to padding. The output is JSON lines, one
row per input in input order: the input's fields plus ``pred_text``. Audio that cannot be read or transcribed
gets ``pred_text: null`` and an ``error`` field instead of stopping the run. With reference ``text`` in the
manifest, the corpus WER (and CER) is printed, with the real-time factor (RTFx: audio seconds per second of
transcription, model loading excluded).

Files longer than ``chunk_len + chunk_overlap`` seconds (any length: a 1-hour file in bounded memory) are
transcribed by :mod:`speechtrain.asr.long_audio`: split where the audio pauses for ``min_pause`` seconds, each
stretch of speech decoded on its own (``split=pauses``), and stretches longer than a chunk, or the whole file with
``split=fixed``, in chunks of ``chunk_len`` seconds with overlapping context; ``timestamps=true`` adds
``words: [{"word", "start", "end"}, ...]`` (seconds, from the CTC alignment) to every row.

``streaming=true`` runs a cache-aware streaming model (:mod:`speechtrain.asr.streaming`) as a live client would:
each file is fed ``chunk`` encoder frames of audio at a time, one file after another, greedy decoding; the final
hypotheses equal the offline greedy ones (``decoding=greedy``) of the same model and context.
"""

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import torch
from omegaconf import OmegaConf

from speechtrain import backends
from speechtrain.asr.decoding import STRATEGIES
from speechtrain.asr.long_audio import needs_chunking, transcribe_chunked, transcribe_segmented
from speechtrain.common import metrics
from speechtrain.common.cli import fail, parse_key_values
from speechtrain.common.config import ConfigError
from speechtrain.common.metrics import WerConfig
from speechtrain.core.model import SpeechModel
from speechtrain.data.augment import resample
from speechtrain.data.manifest import ManifestError

logger = logging.getLogger(__name__)

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")
MANIFEST_SUFFIXES = (".json", ".jsonl")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("32", "bf16")
SPLITS = ("pauses", "fixed")


@dataclass
class TranscribeConfig:
    """Command-line options of ``python -m speechtrain.asr.transcribe``.

    Attributes:
        model_path: a model archive (``.stm``) written by ``SpeechModel.save_to``, or a NeMo ``.nemo`` checkpoint.
        audio: an audio file, a folder (searched recursively for .wav/.flac/.ogg/.mp3) or a NeMo manifest.
        output: JSON-lines output; default ``<manifest stem>_preds.json`` (manifest input) or
            ``transcripts.json``, in the working directory.
        batch_duration: most seconds of audio per batch (None: no limit).
        batch_size: most utterances per batch (None: no limit).
        device: ``auto`` (cuda if available), ``cpu`` or ``cuda``.
        precision: ``32``, or ``bf16`` (autocast).
        decoding: ``greedy`` or ``beam``; None: the model's ``decoding.strategy``.
        lm_path, beam_size, lm_weight, word_score: beam-search settings (None: the model's).
        decoder_type: for a hybrid transducer (e.g. a NeMo hybrid ``.nemo``), ``transducer`` or ``ctc`` (its CTC head),
            NeMo's ``change_decoding_strategy(decoder_type=...)``; None: the model's ``decoder_type``.
        chunk_len: files longer than ``chunk_len + chunk_overlap`` seconds are transcribed in chunks of this many
            seconds (None: never).
        chunk_overlap: seconds of context around each chunk (half on each side).
        split: how a file longer than a chunk is cut: ``pauses`` (where it pauses for ``min_pause`` seconds, each
            stretch of speech decoded on its own, in chunks where longer than one) or ``fixed`` (consecutive chunks,
            their outputs merged: one decode of the whole file).
        min_pause: seconds of quiet that make a pause (``split=pauses``).
        timestamps: add word start and end times to each row (CTC alignment).
        wer: normalisation before WER/CER (``wer.lowercase=true wer.remove_punctuation=true wer.numbers=true``);
            None: the model's ``wer`` config. The choice is printed with the WER.
        streaming: transcribe chunk by chunk with the encoder's caches (a streaming model; greedy).
        chunk: streaming: encoder frames per step (None: one attention chunk, ``right + 1``).
        att_context_size: streaming: which trained ``[left, right]`` context to run (None: the model's first).
    """

    model_path: str | None = None
    audio: str | None = None
    output: str | None = None
    batch_duration: float | None = 300.0
    batch_size: int | None = None
    device: str = "auto"
    precision: str = "32"
    decoding: str | None = None
    lm_path: str | None = None
    beam_size: int | None = None
    lm_weight: float | None = None
    word_score: float | None = None
    decoder_type: str | None = None
    chunk_len: float | None = 30.0
    chunk_overlap: float = 4.0
    split: str = "pauses"
    min_pause: float = 0.3
    timestamps: bool = False
    wer: WerConfig | None = None
    streaming: bool = False
    chunk: int | None = None
    att_context_size: list[int] | None = None

    def decoding_overrides(self) -> dict[str, Any]:
        """The ``model.decoding`` keys this run sets."""
        values = {"strategy": self.decoding, "lm_path": self.lm_path, "beam_size": self.beam_size,
                  "lm_weight": self.lm_weight, "word_score": self.word_score}  # fmt: skip
        return {k: v for k, v in values.items() if v is not None}


# ------------------------------------------------------------------------------------------------------ inputs
def _read_manifest(path: Path) -> list[dict[str, Any]]:
    """Rows of a NeMo manifest for inference: only ``audio_filepath`` is required (``text`` and ``duration`` may
    be missing); relative audio paths are resolved against the manifest's folder."""
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ManifestError(f"{where}: invalid JSON: {e}") from None
            audio = row.get("audio_filepath") if isinstance(row, dict) else None
            if not isinstance(audio, str) or not audio:
                raise ManifestError(f"{where}: expected a JSON object with a non-empty 'audio_filepath' string")
            for key in ("duration", "offset"):
                value = row.get(key, 0.0)
                if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                    raise ManifestError(f"{where}: {key!r} must be a number >= 0, got {value!r}")
            row["audio_filepath"] = audio if os.path.isabs(audio) else str(path.parent / audio)
            rows.append(row)
    return rows


def collect_inputs(audio: str | os.PathLike) -> list[dict[str, Any]]:
    """Input rows (dicts with at least ``audio_filepath``) of an audio file, a folder or a NeMo manifest.

    Raises:
        FileNotFoundError: if ``audio`` does not exist.
        ValueError: if a folder holds no audio file or a manifest no utterance; ManifestError on a bad line.
    """
    path = Path(audio).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"No audio files ({', '.join(AUDIO_SUFFIXES)}) under {path}.")
        return [{"audio_filepath": str(p)} for p in files]
    if not path.is_file():
        raise FileNotFoundError(f"audio={audio}: no such file or folder.")
    if path.suffix.lower() in MANIFEST_SUFFIXES:
        rows = _read_manifest(path)
        if not rows:
            raise ValueError(f"Manifest {path} holds no utterance.")
        return rows
    return [{"audio_filepath": str(path)}]


def _as_rows(inputs: str | os.PathLike | Sequence[str | os.PathLike | Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(inputs, str | os.PathLike):
        return collect_inputs(inputs)
    return [dict(item) if isinstance(item, Mapping) else {"audio_filepath": str(item)} for item in inputs]


def _probe_duration(row: dict[str, Any]) -> float:
    """Seconds of audio ``row`` stands for: its ``duration``, else read from the file's header."""
    path = row["audio_filepath"]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    if "duration" in row:
        return float(row["duration"])
    return max(0.0, sf.info(path).duration - float(row.get("offset", 0.0)))


def _load_segment(row: dict[str, Any], sample_rate: int | None) -> np.ndarray:
    """The ``[offset, offset + duration)`` segment of a file as a mono float32 array at ``sample_rate`` (None: the
    file's rate); models take arrays as already at their rate, so the resampling is done here."""
    path = row["audio_filepath"]
    rate = sf.info(path).samplerate
    start = round(float(row.get("offset", 0.0)) * rate)
    frames = round(float(row["duration"]) * rate) if "duration" in row else -1
    data, _ = sf.read(path, start=start, frames=frames, dtype="float32", always_2d=True)
    if len(data) == 0:
        raise ValueError(f"{path}: no audio at offset {row.get('offset')} s.")
    audio = data.mean(axis=1)
    if sample_rate is not None and rate != sample_rate:
        audio = resample(torch.from_numpy(audio), rate, sample_rate).numpy()
    return audio


# ----------------------------------------------------------------------------------------------------- batching
def plan_batches(durations: Sequence[float], batch_duration: float | None, batch_size: int | None) -> list[list[int]]:
    """Group utterances, longest first, into batches of at most ``batch_duration`` seconds and ``batch_size``
    utterances (either may be None: no limit). An utterance longer than ``batch_duration`` gets a batch alone.

    Returns:
        Batches of indices into ``durations``; every index appears exactly once.
    """
    batches: list[list[int]] = []
    total = 0.0
    for index in sorted(range(len(durations)), key=lambda i: -durations[i]):
        too_many = batch_size is not None and batches and len(batches[-1]) >= batch_size
        too_long = batch_duration is not None and total + durations[index] > batch_duration
        if not batches or too_many or too_long:
            batches.append([])
            total = 0.0
        batches[-1].append(index)
        total += durations[index]
    return batches


def _check_split(split: str, min_pause: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split}: expected one of {', '.join(SPLITS)}.")
    if not min_pause > 0:
        raise ValueError(f"min_pause={min_pause}: expected seconds > 0.")


def _check_limits(batch_duration: float | None, batch_size: int | None) -> None:
    if batch_duration is not None and batch_duration <= 0:
        raise ValueError(f"batch_duration must be > 0 seconds or null, got {batch_duration}.")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or null, got {batch_size}.")


def _error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _transcribe_batch(model: Any, items: list[str | np.ndarray]) -> list[str | Exception]:
    """Transcripts of one batch; if the batch fails, each utterance is retried alone so that only the bad ones
    are lost."""
    try:
        texts = model.transcribe(items, batch_size=len(items))
    except Exception as error:  # one bad file must not stop the run: it is reported in its row
        if len(items) == 1:
            return [error]
        logger.warning("A batch of %d failed (%s); retrying its utterances one by one.", len(items), error)
        return [result for item in items for result in _transcribe_batch(model, [item])]
    if len(texts) != len(items):
        raise RuntimeError(f"{type(model).__name__}.transcribe returned {len(texts)} texts for {len(items)} inputs.")
    return list(texts)


def transcribe_paths(
    model: Any,
    inputs: str | os.PathLike | Sequence[str | os.PathLike | Mapping[str, Any]],
    batch_duration: float | None = 300.0,
    batch_size: int | None = None,
    precision: str = "32",
    chunk_len: float | None = 30.0,
    chunk_overlap: float = 4.0,
    timestamps: bool = False,
    split: str = "pauses",
    min_pause: float = 0.3,
) -> list[dict[str, Any]]:
    """Transcribe many utterances with ``model.transcribe``, batched by duration.

    Args:
        model: a model with ``transcribe(audio: list[str | Path | np.ndarray], batch_size) -> list[str]``, in
            eval mode, on its device.
        inputs: an audio file, folder or NeMo manifest (see :func:`collect_inputs`), or a list of audio paths or
            of manifest-like rows (``audio_filepath`` and optionally ``duration``, ``offset``, ``text``, ...).
        batch_duration: most seconds of audio per call of ``model.transcribe`` (None: no limit).
        batch_size: most utterances per call (None: no limit).
        precision: ``"32"``, or ``"bf16"`` to run under bf16 autocast on the model's device.
        chunk_len, chunk_overlap: files longer than ``chunk_len + chunk_overlap`` seconds are transcribed in
            chunks (:func:`speechtrain.asr.long_audio.transcribe_chunked`), one file at a time.
        split, min_pause: ``pauses``: such a file is first split where it pauses for ``min_pause`` seconds
            (:func:`speechtrain.asr.long_audio.transcribe_segmented`); ``fixed``: chunks only.
        timestamps: add ``words`` (``{"word", "start", "end"}`` in seconds) to every row.

    Returns:
        One row per input, in input order: the input's fields, ``duration`` (probed from the file when missing)
        and ``pred_text``; rows whose audio could not be read or transcribed have ``pred_text`` None and an
        ``error`` message.
    """
    _check_limits(batch_duration, batch_size)
    _check_split(split, min_pause)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}.")
    rows = _as_rows(inputs)
    readable, durations = [], []
    for index, row in enumerate(rows):
        row["pred_text"] = None
        try:
            durations.append(_probe_duration(row))
        except Exception as error:  # soundfile raises several types for unreadable files
            row["error"] = _error_text(error)
            continue
        row.setdefault("duration", durations[-1])
        readable.append(index)

    cfg = getattr(model, "cfg", None)
    sample_rate = cfg.get("sample_rate") if hasattr(cfg, "get") else None
    device_type = getattr(getattr(model, "device", None), "type", "cpu")
    autocast = torch.autocast(device_type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    if hasattr(model, "blank"):  # a recogniser: long files (and every file, for timestamps) go through chunking
        long = [needs_chunking(d, chunk_len, chunk_overlap) for d in durations]
        chunked = [i for i in range(len(durations)) if timestamps or long[i]]
        with autocast:
            for i in chunked:
                _transcribe_long(model, rows[readable[i]], chunk_len or durations[i], chunk_overlap, timestamps,
                                 min_pause if split == "pauses" and long[i] else None)  # fmt: skip
        done = set(chunked)
        readable = [r for j, r in enumerate(readable) if j not in done]
        durations = [d for j, d in enumerate(durations) if j not in done]
    elif timestamps:
        raise ValueError(f"timestamps=true needs a CTC model; {type(model).__name__} is not one.")
    batches = plan_batches(durations, batch_duration, batch_size)
    padded = 0.0
    with autocast:
        for batch in batches:
            padded += max(durations[i] for i in batch) * len(batch)
            indices, items = [], []
            for i in batch:
                row = rows[readable[i]]
                try:
                    items.append(_load_segment(row, sample_rate) if "offset" in row else row["audio_filepath"])
                except Exception as error:  # as above
                    row["error"] = _error_text(error)
                    continue
                indices.append(readable[i])
            for index, result in zip(indices, _transcribe_batch(model, items) if items else []):
                if isinstance(result, Exception):
                    rows[index]["error"] = _error_text(result)
                else:
                    rows[index]["pred_text"] = result
    if batches:
        logger.info(
            "%d utterances in %d batches; padding %.1f%% of the batched audio.",
            len(readable),
            len(batches),
            100.0 * (1.0 - sum(durations) / padded) if padded else 0.0,
        )
    return rows


def _transcribe_long(
    model: Any, row: dict[str, Any], chunk_len: float, overlap: float, timestamps: bool, min_pause: float | None
) -> None:
    """Fill ``row`` (``pred_text``, ``words``) by chunked transcription, split at pauses of ``min_pause`` seconds
    first unless it is None; an error is reported in the row."""
    where = {"offset": float(row.get("offset", 0.0)), "duration": row.get("duration")}
    try:
        if min_pause is None:
            out = transcribe_chunked(model, row["audio_filepath"], chunk_len, overlap, timestamps, **where)
        else:
            out = transcribe_segmented(model, row["audio_filepath"], chunk_len, overlap, timestamps,
                                       min_pause=min_pause, **where)  # fmt: skip
    except Exception as error:  # one bad file must not stop the run: it is reported in its row
        row["error"] = _error_text(error)
        return
    row["pred_text"] = out.text
    if out.words is not None:
        row["words"] = out.words


def transcribe_streaming(
    model: Any,
    inputs: str | os.PathLike | Sequence[str | os.PathLike | Mapping[str, Any]],
    chunk: int | None = None,
    att_context_size: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Transcribe each input with :class:`~speechtrain.asr.streaming.StreamingTranscriber`, feeding ``chunk``
    encoder frames' worth of samples per call (rows as :func:`transcribe_paths`; ``partials``: how many times the
    partial hypothesis changed)."""
    from speechtrain.asr.streaming import StreamingTranscriber

    StreamingTranscriber(model, att_context_size, chunk)  # a model that cannot stream stops here, before any work
    rows = _as_rows(inputs)
    rate = model.cfg.sample_rate
    for row in rows:
        row["pred_text"] = None
        try:
            audio = _load_segment(row, rate)
            row.setdefault("duration", len(audio) / rate)
            stream = StreamingTranscriber(model, att_context_size, chunk)
            step = stream.encoder.chunk * stream.encoder.factor * model.preprocessor.hop
            partial, changes = "", 0
            for start in range(0, len(audio), step):
                text = stream.push(audio[start : start + step])
                changes, partial = changes + (text != partial), text
            row["pred_text"] = stream.finish()
            row["partials"] = changes + (row["pred_text"] != partial)
        except Exception as error:  # one bad file must not stop the run: it is reported in its row
            row["error"] = _error_text(error)
    return rows


# ---------------------------------------------------------------------------------------------------------- CLI
def summarize(
    rows: Sequence[Mapping[str, Any]], seconds: float, normalizer: metrics.TextNormalizer | None = None
) -> list[str]:
    """Report lines: counts, audio seconds and RTFx, WER (and CER) against ``text`` where present (both normalised
    by ``normalizer``), skipped inputs."""
    done = [r for r in rows if r.get("pred_text") is not None]
    audio_seconds = sum(float(r.get("duration", 0.0)) for r in done)
    rtfx = audio_seconds / seconds if seconds > 0 else math.inf
    lines = [
        f"Transcribed {len(done)}/{len(rows)} utterances, {audio_seconds:.2f} s of audio in {seconds:.2f} s: "
        f"RTFx {rtfx:.1f}"
    ]
    scored = [r for r in done if isinstance(r.get("text"), str)]
    unscored = sum(1 for r in rows if r.get("pred_text") is None and isinstance(r.get("text"), str))
    if scored or unscored:
        norm = normalizer or metrics.TextNormalizer()
        hyps, refs = [norm(r["pred_text"]) for r in scored], [norm(r["text"]) for r in scored]
        errors, words = metrics.word_errors(hyps, refs)
        rate = metrics.format_rate(metrics.error_rate(errors, words))
        line = f"WER {rate} ({errors} errors / {words} words, {len(scored)} utterances"
        line += f"; {unscored} skipped, see 'error')" if unscored else ")"
        errors, chars = metrics.char_errors(hyps, refs)
        line += (
            f", CER {metrics.format_rate(metrics.error_rate(errors, chars))} ({errors} errors / {chars} characters)"
            f"; transcripts {norm.describe()}"
        )
        lines.append(line)
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines.append(f"Skipped {len(failed)} unreadable or failed utterance(s) (pred_text null, see 'error'):")
        lines += [f"  {r['audio_filepath']}: {r['error']}" for r in failed[:10]]
        if len(failed) > 10:
            lines.append(f"  ... and {len(failed) - 10} more")
    return lines


def parse_args(argv: Sequence[str]) -> TranscribeConfig:
    """``key=value`` arguments as a checked :class:`TranscribeConfig`.

    Raises:
        SystemExit: status 0 after ``--help``; status 2 on an argument that is not ``key=value``, an unknown key
            (with the closest known key) or a value of the wrong type.
        ConfigError: a value of the wrong choice, or a missing ``model_path`` / ``audio``; ValueError on a batch
            limit, a ``split`` or a ``min_pause`` out of range.
    """
    cfg = parse_key_values(argv, TranscribeConfig, __doc__)
    missing = [k for k in ("model_path", "audio") if not getattr(cfg, k)]
    if missing:
        raise ConfigError(f"Missing {' and '.join(f'{k}=...' for k in missing)}.")
    for key, choices in (("device", DEVICES), ("precision", PRECISIONS), ("decoding", STRATEGIES),
                         ("decoder_type", ("transducer", "ctc"))):  # fmt: skip
        if getattr(cfg, key) is not None and getattr(cfg, key) not in choices:
            raise ConfigError(f"{key}={getattr(cfg, key)}: expected one of {', '.join(choices)}.")
    _check_limits(cfg.batch_duration, cfg.batch_size)
    _check_split(cfg.split, cfg.min_pause)
    if not cfg.streaming and (cfg.chunk is not None or cfg.att_context_size is not None):
        raise ConfigError("chunk and att_context_size are streaming options: add streaming=true.")
    if cfg.streaming and cfg.timestamps:
        raise ConfigError("streaming=true gives no timestamps; leave timestamps=false.")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda, but CUDA is not available; use device=cpu or device=auto.")
    return cfg


def default_output(audio: str | os.PathLike) -> Path:
    """``<manifest stem>_preds.json`` for a manifest, else ``transcripts.json``, in the working directory."""
    path = Path(audio)
    if path.suffix.lower() in MANIFEST_SUFFIXES and path.is_file():
        return Path(f"{path.stem}_preds.json")
    return Path("transcripts.json")


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
        if not Path(cfg.model_path).is_file():
            raise FileNotFoundError(f"model_path={cfg.model_path}: no such file.")
        rows = collect_inputs(cfg.audio)
        if cfg.wer is not None:
            metrics.TextNormalizer(cfg.wer)  # a bad choice stops here, before any work
    except (ConfigError, ValueError, FileNotFoundError, ImportError) as e:
        fail(str(e))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    backends.configure_process(torch.device(device).type)  # as the Trainer does
    decoding = cfg.decoding_overrides()
    override = {"decoding": decoding} if decoding else None
    try:
        model = SpeechModel.restore_from(cfg.model_path, map_location=device, override_config=override).eval()
    except (ValueError, FileNotFoundError) as e:  # not an archive (e.g. a training checkpoint), or a damaged one
        fail(str(e))
    if not callable(getattr(model, "transcribe", None)):
        fail(f"{type(model).__name__} (from {cfg.model_path}) has no transcribe method.")
    if cfg.decoder_type is not None:  # read at decoding time, so set on the loaded model
        if not model.cfg.get("hybrid"):
            fail(f"decoder_type={cfg.decoder_type}: {cfg.model_path} holds a {type(model).__name__} with one decoder; "
                 "decoder_type chooses between a hybrid transducer's two.")  # fmt: skip
        model.cfg.decoder_type = cfg.decoder_type

    start = time.perf_counter()
    if cfg.streaming:
        try:
            rows = transcribe_streaming(model, rows, cfg.chunk, cfg.att_context_size)
        except ValueError as e:  # not a streaming model, or a chunk / context it cannot run
            fail(str(e))
    else:
        rows = transcribe_paths(model, rows, cfg.batch_duration, cfg.batch_size, cfg.precision, cfg.chunk_len,
                                cfg.chunk_overlap, cfg.timestamps, cfg.split, cfg.min_pause)  # fmt: skip
    seconds = time.perf_counter() - start

    output = Path(cfg.output) if cfg.output else default_output(cfg.audio)
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    wer_cfg = cfg.wer if cfg.wer is not None else model.cfg.get("wer")
    normalizer = metrics.TextNormalizer(OmegaConf.to_container(wer_cfg) if OmegaConf.is_config(wer_cfg) else wer_cfg)
    for line in summarize(rows, seconds, normalizer):
        print(line)
    print(f"Wrote {len(rows)} rows to {output} (device {device}, precision {cfg.precision}).")
    if not any(r["pred_text"] is not None for r in rows):
        sys.exit("error: no utterance could be transcribed.")


if __name__ == "__main__":
    main()
