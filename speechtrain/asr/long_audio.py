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

Split at pauses (:func:`transcribe_segmented`, the transcribe CLI's default ``split=pauses``): a model trained on
single utterances hears a window of several sentences, normalised together, worse than each sentence alone (the
demo's model's figures are in docs/asr.md, "Long audio and timestamps"). So the file is first
cut where the signal stays quiet for ``min_pause`` seconds (:func:`speech_segments`), and each stretch of speech is
decoded on its own, like an utterance; a stretch longer than a chunk is chunked as above. The pauses come from frame
energies against the file's own noise floor: a voice-activity detector with a model would need weights that we may
not download, torchaudio's ``vad`` only trims a file's leading silence, and lhotse cuts at supervisions it is given.
"""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import torch

WORD_START = "\u2581"
_ENERGY_BLOCK_FRAMES = 6000  # energy frames (a hundredth of a second each) read at a time when looking for pauses


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
    end = None if duration is None else offset + duration
    return _transcribe_spans(model, path, [(offset, end)], chunk_len, overlap, timestamps, batch_size)[0]


def _transcribe_spans(
    model: Any,
    path: str | Path,
    spans: list[tuple[float, float | None]],
    chunk_len: float,
    overlap: float,
    timestamps: bool,
    batch_size: int,
) -> list[ChunkedOutput]:
    """Each span ``(start, end)`` (seconds; end None: the file's end) of a file transcribed on its own, in chunks
    where it is longer than one; the chunks of all spans share batches of at most ``batch_size`` full windows of
    audio (many short spans fill one batch)."""
    if chunk_len <= 0 or overlap < 0:
        raise ValueError(f"chunk_len must be > 0 and overlap >= 0 seconds, got {chunk_len} and {overlap}.")
    if not hasattr(model, "blank") or not hasattr(model, "tokenizer"):
        raise TypeError(f"Chunked transcription needs a speech recogniser; {type(model).__name__} is not one.")
    # A transducer's forward gives encoder frames (its decoder reads the merged frames), a CTC model's log-probs.
    transducer = hasattr(model, "greedy_hypotheses")
    info = sf.info(str(path))
    file_rate, rate = info.samplerate, model.cfg.sample_rate
    step, context = round(chunk_len * file_rate), round(overlap / 2 * file_rate)
    fs = frame_seconds(model)
    greedy = model.cfg.decoding.strategy == "greedy" if hasattr(model.cfg, "decoding") else True
    bounds, chunks = [], []  # each span's (begin, end) samples; (span, window start, own start, own end) per chunk
    for index, (start, stop) in enumerate(spans):
        begin = round(start * file_rate)
        end = info.frames if stop is None else min(info.frames, round(stop * file_rate))
        bounds.append((begin, end))
        for own_start in range(begin, max(end, begin + 1), step):
            own_end = min(own_start + step, end)
            chunks.append((index, max(begin, own_start - context), own_start, own_end, min(end, own_end + context)))
    labels: list[list[torch.Tensor]] = [[] for _ in spans]  # per-frame best labels (greedy alignment, timestamps)
    rows: list[list[torch.Tensor]] = [[] for _ in spans]  # per-frame log-probabilities (beam search, transducers)
    budget, first = batch_size * (step + 2 * context), 0
    while first < len(chunks):
        last, total = first, 0
        while last < len(chunks) and (last == first or total + chunks[last][4] - chunks[last][1] <= budget):
            total += chunks[last][4] - chunks[last][1]
            last += 1
        batch = chunks[first:last]
        first = last
        windows = [_read(str(path), lo, hi - lo, file_rate, rate) for _, lo, _, _, hi in batch]
        lens = torch.tensor([len(w) for w in windows])
        audio = torch.zeros(len(windows), int(lens.max()))
        for i, w in enumerate(windows):
            audio[i, : len(w)] = w
        with torch.inference_mode():
            log_probs, out_lens = model(audio.to(model.device), lens.to(model.device))  # (B, F, V+1), (B,)
        for i, (index, lo, own_start, own_end, _) in enumerate(batch):
            begin, end = bounds[index]
            count = int(out_lens[i])
            centres = (lo - begin) / file_rate + (torch.arange(count) + 0.5) * fs  # seconds from the span start
            keep = (centres >= (own_start - begin) / file_rate) & (centres < (own_end - begin) / file_rate)
            if own_end == end:  # the last chunk keeps its trailing frames (the encoder may round lengths up)
                keep |= centres >= (own_end - begin) / file_rate
            kept = log_probs[i, :count][keep.to(log_probs.device)].float().cpu()
            if transducer or not greedy:
                rows[index].append(kept)
            if not transducer:
                labels[index].append(kept.argmax(-1))
    outputs = []
    for index, (begin, _) in enumerate(bounds):
        offset = begin / file_rate
        if transducer:
            outputs.append(_transducer_output(model, rows[index], greedy, timestamps, fs, offset))
            continue
        best = torch.cat(labels[index]) if labels[index] else torch.zeros(0, dtype=torch.long)
        if greedy:
            ids = [int(i) for i in torch.unique_consecutive(best) if int(i) != model.blank]
            text = model.tokenizer.decode(ids)
        else:
            merged = torch.cat(rows[index])[None]  # (1, F, V+1)
            text = model.decode(merged.to(model.device), torch.tensor([merged.shape[1]], device=model.device))[0]
        words = word_timestamps(best, model.blank, model.tokenizer, fs, offset) if timestamps else None
        outputs.append(ChunkedOutput(text=text, words=words, frames=int(best.numel()), frame_seconds=fs))
    return outputs


def speech_segments(
    path: str | Path,
    min_pause: float = 0.3,
    margin: float = 0.2,
    offset: float = 0.0,
    duration: float | None = None,
    min_speech: float = 0.1,
) -> list[tuple[float, float]]:
    """Stretches of speech of ``[offset, offset + duration)`` of an audio file, split at pauses: ``(start, end)`` in
    seconds from the file start, in order.

    Energies of frames of a hundredth of a second, read in blocks (a 1-hour file needs its 360,000 frame energies,
    not its audio). A frame is quiet below ``floor + max(6 dB, 0.3 (top - floor))``, floor and top being the 10th and
    95th percentiles of the frame energies: the threshold follows the file's own noise and level. A run of quiet
    frames of at least ``min_pause`` seconds is a pause; speech between pauses shorter than ``min_speech`` (a click)
    is dropped. Each stretch keeps up to ``margin`` seconds of the pauses around it (never more than half of a
    pause). A file with no clear pause (its top less than 10 dB above its floor, a silent file too) is one stretch.
    """
    if min_pause <= 0 or margin < 0:
        raise ValueError(f"min_pause must be > 0 and margin >= 0 seconds, got {min_pause} and {margin}.")
    info = sf.info(str(path))
    rate = info.samplerate
    begin = round(offset * rate)
    end = info.frames if duration is None else min(info.frames, begin + round(duration * rate))
    hop = max(1, round(0.01 * rate))
    hop_s = hop / rate
    energies = []
    with sf.SoundFile(str(path)) as f:
        f.seek(begin)
        remaining = end - begin
        while remaining > 0:
            block = f.read(min(remaining, _ENERGY_BLOCK_FRAMES * hop), dtype="float32", always_2d=True).mean(axis=1)
            if not len(block):
                break
            remaining -= len(block)
            padded = np.zeros(-(-len(block) // hop) * hop, dtype=np.float32)
            padded[: len(block)] = block
            energies.append((padded.reshape(-1, hop) ** 2).mean(axis=1))
    if not energies:
        return []
    db = 10.0 * np.log10(np.concatenate(energies) + 1e-10)
    floor, top = np.percentile(db, 10), np.percentile(db, 95)
    first, last = begin / rate, end / rate
    if top - floor < 10.0:
        return [(first, last)]
    speech = db > floor + max(6.0, 0.3 * (top - floor))
    edges = np.flatnonzero(np.diff(np.concatenate([[0], speech.astype(np.int8), [0]])))
    starts, ends = edges[0::2], edges[1::2]  # runs of speech frames [start, end)
    if not len(starts):
        return []
    split = np.flatnonzero((starts[1:] - ends[:-1]) * hop_s >= min_pause)
    starts = np.concatenate([starts[:1], starts[split + 1]]) * hop_s + first
    ends = np.concatenate([ends[split], ends[-1:]]) * hop_s + first
    keep = ends - starts >= min_speech
    starts, ends = starts[keep], ends[keep]
    middles = (ends[:-1] + starts[1:]) / 2  # no stretch takes more than half of a pause
    lo = np.maximum(starts - margin, np.concatenate([[first], middles]))
    hi = np.minimum(ends + margin, np.concatenate([middles, [last]]))
    return [(round(a, 4), round(b, 4)) for a, b in zip(lo.tolist(), hi.tolist())]


def transcribe_segmented(
    model: Any,
    path: str | Path,
    chunk_len: float = 30.0,
    overlap: float = 4.0,
    timestamps: bool = False,
    batch_size: int = 4,
    offset: float = 0.0,
    duration: float | None = None,
    min_pause: float = 0.3,
) -> ChunkedOutput:
    """Transcribe ``[offset, offset + duration)`` of an audio file split at its pauses (:func:`speech_segments`):
    each stretch of speech on its own with :func:`transcribe_chunked` (in chunks where it is longer than
    ``chunk_len + overlap``); transcripts joined with spaces, word times from the file start."""
    spans = speech_segments(path, min_pause, offset=offset, duration=duration)
    outputs = _transcribe_spans(model, path, spans, chunk_len, overlap, timestamps, batch_size) if spans else []
    text = " ".join(t for out in outputs if (t := out.text.strip()))
    words = [w for out in outputs for w in out.words or []] if timestamps else None
    return ChunkedOutput(text, words, sum(out.frames for out in outputs), frame_seconds(model))


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
