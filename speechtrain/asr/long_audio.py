"""Transcription of files of any length: chunked inference with overlap, merged model outputs and word timestamps.
For a CTC model the merged outputs are its log-probabilities; for a transducer (RNN-T, TDT, hybrid with either
decoder) its encoder frames, which its own decoder then reads whole, greedy or beam.

A file is cut into consecutive chunks of ``chunk_len`` seconds; each chunk is run through the model with
``overlap / 2`` seconds of audio on each side as context (the padding of its windows), and only the output frames
whose centre falls inside the chunk itself are kept. The kept frames of all chunks, in order, form the file's
CTC output: every frame was computed with at least ``overlap / 2`` seconds of context on both sides (except at
the file's ends), and no frame is counted twice, so the merge is a concatenation, with no text-level stitching.
Only one batch of windows is in memory at a time, read from the file with soundfile: a 1-hour file needs the
memory of ``batch_size`` windows plus its frame labels (greedy) or its log-probabilities (beam search).

Word timestamps come from the greedy CTC alignment: a token starts at the first frame of its run of labels and
ends at the last; a word runs from the start of its first token to the end of its last (a sentencepiece piece
beginning with ``▁``, or a character after a space, starts a word). Times are in seconds from the file start.

NeMo does the same with its buffered/chunked CTC inference scripts; nothing in lhotse, Lightning or torchaudio
does chunked CTC inference for an arbitrary model, hence this module.
"""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import soundfile as sf
import torch

WORD_START = "\u2581"


@dataclass
class ChunkedOutput:
    """The merged CTC output of one file.

    Attributes:
        text: the transcript.
        words: ``{"word", "start", "end"}`` per word (seconds), when timestamps were asked for.
        frames: number of merged output frames.
        frame_seconds: seconds per output frame.
    """

    text: str
    words: list[dict[str, Any]] | None
    frames: int
    frame_seconds: float


def frame_seconds(model: Any) -> float:
    """Seconds per output frame of a CTC model: the feature hop times the encoder's time reduction."""
    rate = model.cfg.sample_rate
    samples = 16 * rate  # any length several times the reduction: frames are then exact multiples
    return samples / rate / model.output_frames(samples)


def _read(path: str, start: int, frames: int, file_rate: int, rate: int) -> torch.Tensor:
    data, _ = sf.read(path, start=start, frames=frames, dtype="float32", always_2d=True)
    audio = torch.from_numpy(data.mean(axis=1))
    if file_rate != rate:
        from speechtrain.data.augment import resample

        audio = resample(audio, file_rate, rate)
    return audio


def transcribe_chunked(
    model: Any,
    path: str | Path,
    chunk_len: float = 30.0,
    overlap: float = 4.0,
    timestamps: bool = False,
    batch_size: int = 4,
    offset: float = 0.0,
    duration: float | None = None,
) -> ChunkedOutput:
    """Transcribe ``[offset, offset + duration)`` of an audio file of any length with a CTC model.

    Args:
        model: a CTC model (``forward(audio (B, T), lengths) -> (log_probs (B, F, V+1), lengths)``, ``blank``,
            ``tokenizer``, ``decode``), in eval mode on its device.
        path: the audio file (any rate and channel count soundfile reads; resampled and mixed to mono).
        chunk_len: seconds of audio whose output each chunk contributes.
        overlap: extra seconds of context per chunk, half on each side (not part of its output).
        timestamps: also return word start and end times (greedy alignment).
        batch_size: chunks run through the model at once.
        offset, duration: the segment of the file (seconds); None: to the end.
    """
    if chunk_len <= 0 or overlap < 0:
        raise ValueError(f"chunk_len must be > 0 and overlap >= 0 seconds, got {chunk_len} and {overlap}.")
    if not hasattr(model, "blank") or not hasattr(model, "tokenizer"):
        raise TypeError(f"Chunked transcription needs a speech recogniser; {type(model).__name__} is not one.")
    # A transducer's forward gives encoder frames (its decoder reads the merged frames), a CTC model's log-probs.
    transducer = hasattr(model, "greedy_hypotheses")
    info = sf.info(str(path))
    file_rate, rate = info.samplerate, model.cfg.sample_rate
    begin = round(offset * file_rate)
    end = info.frames if duration is None else min(info.frames, begin + round(duration * file_rate))
    step, context = round(chunk_len * file_rate), round(overlap / 2 * file_rate)
    fs = frame_seconds(model)
    greedy = model.cfg.decoding.strategy == "greedy" if hasattr(model.cfg, "decoding") else True
    labels: list[torch.Tensor] = []  # per-frame best labels (greedy alignment, timestamps)
    rows: list[torch.Tensor] = []  # per-frame log-probabilities (beam search only)
    starts = list(range(begin, max(end, begin + 1), step))
    for first in range(0, len(starts), batch_size):
        windows, spans = [], []
        for own_start in starts[first : first + batch_size]:
            own_end = min(own_start + step, end)
            lo, hi = max(begin, own_start - context), min(end, own_end + context)
            windows.append(_read(str(path), lo, hi - lo, file_rate, rate))
            spans.append((lo, own_start, own_end))
        lens = torch.tensor([len(w) for w in windows])
        audio = torch.zeros(len(windows), int(lens.max()))
        for i, w in enumerate(windows):
            audio[i, : len(w)] = w
        with torch.inference_mode():
            log_probs, out_lens = model(audio.to(model.device), lens.to(model.device))  # (B, F, V+1), (B,)
        for i, (lo, own_start, own_end) in enumerate(spans):
            count = int(out_lens[i])
            centres = (lo - begin) / file_rate + (torch.arange(count) + 0.5) * fs  # seconds from the segment start
            keep = (centres >= (own_start - begin) / file_rate) & (centres < (own_end - begin) / file_rate)
            if own_end == end:  # the last chunk keeps its trailing frames (the encoder may round lengths up)
                keep |= centres >= (own_end - begin) / file_rate
            kept = log_probs[i, :count][keep.to(log_probs.device)].float().cpu()
            if transducer or not greedy:
                rows.append(kept)
            if not transducer:
                labels.append(kept.argmax(-1))
    if transducer:
        return _transducer_output(model, rows, greedy, timestamps, fs, offset)
    best = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long)
    if greedy:
        ids = [int(i) for i in torch.unique_consecutive(best) if int(i) != model.blank]
        text = model.tokenizer.decode(ids)
    else:
        merged = torch.cat(rows)[None]  # (1, F, V+1)
        text = model.decode(merged.to(model.device), torch.tensor([merged.shape[1]], device=model.device))[0]
    words = word_timestamps(best, model.blank, model.tokenizer, fs, offset) if timestamps else None
    return ChunkedOutput(text=text, words=words, frames=int(best.numel()), frame_seconds=fs)


def _transducer_output(
    model: Any, rows: list[torch.Tensor], greedy: bool, timestamps: bool, fs: float, offset: float
) -> ChunkedOutput:
    """The transcript of a transducer's merged encoder frames (its configured decoding), with word timestamps from
    its greedy alignment."""
    from speechtrain.asr.transducer_decoding import word_timestamps as transducer_words

    merged = torch.cat(rows)[None] if rows else torch.zeros(1, 0, 1)
    enc, lengths = merged.to(model.device), torch.tensor([merged.shape[1]], device=model.device)
    with torch.inference_mode():
        text = model.decode(enc, lengths, "greedy" if greedy else None)[0]
        words = None
        if timestamps:
            (hypothesis,) = model.greedy_hypotheses(enc, lengths)
            stacked = fs * getattr(getattr(model.cfg, "joint", None), "frame_stack", 1)
            words = transducer_words(model.tokenizer, hypothesis["ids"], hypothesis["starts"], hypothesis["ends"],
                                     stacked)  # fmt: skip
            words = [{**w, "start": round(w["start"] + offset, 3), "end": round(w["end"] + offset, 3)} for w in words]
    return ChunkedOutput(text=text, words=words, frames=int(merged.shape[1]), frame_seconds=fs)


def word_timestamps(
    labels: torch.Tensor, blank: int, tokenizer: Any, seconds_per_frame: float, offset: float = 0.0
) -> list[dict[str, Any]]:
    """Words with start and end times (seconds) from per-frame best labels (F,) of a CTC model.

    A token spans its run of equal labels; a word spans its tokens. Word boundaries: a sentencepiece piece that
    begins with ``▁``, or a space character (which belongs to no word).
    """
    vocab = tokenizer.vocab
    tokens: list[tuple[int, int, int]] = []  # (id, first frame, last frame)
    values = labels.tolist()
    frame = 0
    while frame < len(values):
        last = frame
        while last + 1 < len(values) and values[last + 1] == values[frame]:
            last += 1
        if values[frame] != blank:
            tokens.append((values[frame], frame, last))
        frame = last + 1
    words: list[list[tuple[int, int, int]]] = []
    starts_word = True
    for token in tokens:
        piece = vocab[token[0]] if token[0] < len(vocab) else ""
        if piece == " ":
            starts_word = True
            continue
        if starts_word or piece.startswith(WORD_START) or not words:
            words.append([])
        words[-1].append(token)
        starts_word = False
    out = []
    for word in words:
        text = tokenizer.decode([t[0] for t in word]).strip()
        if text:
            start, stop = word[0][1] * seconds_per_frame, (word[-1][2] + 1) * seconds_per_frame
            out.append({"word": text, "start": round(offset + start, 3), "end": round(offset + stop, 3)})
    return out


def needs_chunking(duration: float, chunk_len: float | None, overlap: float) -> bool:
    """Whether a file of ``duration`` seconds is transcribed in chunks (longer than one chunk and its context)."""
    return chunk_len is not None and duration > chunk_len + overlap + 1e-6 and math.isfinite(duration)
