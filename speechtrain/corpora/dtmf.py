"""Built-in synthetic "DTMF digits" corpus: speech-like utterances the framework renders itself.

Each utterance is a random sequence of 2..8 digits. Every digit sounds as its telephone keypad dual tone
(DTMF: one row and one column frequency), with random duration, amplitude and pauses, a small per-utterance
frequency jitter (a stand-in for speaker pitch), leading/trailing silence and white noise at a random SNR.
The transcript is the digits separated by single spaces, e.g. ``"3 1 4"``.

The corpus is a stand-in for a synthesized-speech corpus: it needs no download and is learnable by a small
CTC model in minutes on CPU, while still exercising variable lengths, silence and noise.
"""

import fcntl
import json
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np
import soundfile as sf

from speechtrain.corpora.cache import default_datasets_cache

CORPUS_NAME = "dtmf"
CORPUS_VERSION = 1
DEFAULT_SPLITS: Mapping[str, int] = MappingProxyType({"train": 2000, "val": 200})

# Standard keypad: rows 697/770/852/941 Hz, columns 1209/1336/1477 Hz; '0' sits on row 4, column 2.
DTMF_FREQUENCIES: Mapping[str, tuple[float, float]] = MappingProxyType(
    {
        "1": (697.0, 1209.0),
        "2": (697.0, 1336.0),
        "3": (697.0, 1477.0),
        "4": (770.0, 1209.0),
        "5": (770.0, 1336.0),
        "6": (770.0, 1477.0),
        "7": (852.0, 1209.0),
        "8": (852.0, 1336.0),
        "9": (852.0, 1477.0),
        "0": (941.0, 1336.0),
    }
)
DIGITS = "0123456789"

MIN_DIGITS, MAX_DIGITS = 2, 8
DIGIT_SECONDS = (0.07, 0.16)
GAP_SECONDS = (0.03, 0.09)
EDGE_SILENCE_SECONDS = (0.05, 0.25)
AMPLITUDE = (0.15, 0.45)
FREQUENCY_JITTER = 0.015
SNR_DB = (10.0, 30.0)
# Short raised-cosine ramps keep tone onsets from splattering energy over the whole spectrum.
RAMP_SECONDS = 0.005
MIN_SAMPLE_RATE = 8000


def render_digits(digits: str, rng: np.random.Generator, sample_rate: int = 16000) -> np.ndarray:
    """Render a digit string as a noisy DTMF utterance.

    Args:
        digits: Digits to render, e.g. ``"314"``; every character must be one of ``0-9``.
        rng: Source of all randomness (durations, gaps, amplitudes, jitter, phases, noise).
        sample_rate: Output sample rate in Hz, at least 8000.

    Returns:
        Float32 waveform of shape (T,), values in [-1, 1].

    Raises:
        ValueError: If ``digits`` is empty or holds a non-digit, or the sample rate is too low.
    """
    if not digits or any(d not in DTMF_FREQUENCIES for d in digits):
        raise ValueError(f"render_digits: expected a non-empty string of digits 0-9, got {digits!r}")
    if sample_rate < MIN_SAMPLE_RATE:
        raise ValueError(f"render_digits: sample_rate must be >= {MIN_SAMPLE_RATE} Hz, got {sample_rate}")
    jitter = 1.0 + rng.uniform(-FREQUENCY_JITTER, FREQUENCY_JITTER)
    ramp_len = max(1, round(RAMP_SECONDS * sample_rate))
    ramp = 0.5 - 0.5 * np.cos(np.pi * np.arange(ramp_len) / ramp_len)

    pieces = [np.zeros(round(rng.uniform(*EDGE_SILENCE_SECONDS) * sample_rate))]
    for position, digit in enumerate(digits):
        if position > 0:
            pieces.append(np.zeros(round(rng.uniform(*GAP_SECONDS) * sample_rate)))
        length = round(rng.uniform(*DIGIT_SECONDS) * sample_rate)
        t = np.arange(length) / sample_rate
        low, high = DTMF_FREQUENCIES[digit]
        phases = rng.uniform(0.0, 2.0 * np.pi, size=2)
        tone = np.sin(2.0 * np.pi * low * jitter * t + phases[0]) + np.sin(2.0 * np.pi * high * jitter * t + phases[1])
        tone *= 0.5 * rng.uniform(*AMPLITUDE)
        tone[:ramp_len] *= ramp
        tone[-ramp_len:] *= ramp[::-1]
        pieces.append(tone)
    pieces.append(np.zeros(round(rng.uniform(*EDGE_SILENCE_SECONDS) * sample_rate)))
    signal = np.concatenate(pieces)

    # SNR is measured against the power of the tones only, so that long silences do not lower it.
    voiced_power = float(np.mean(np.concatenate(pieces[1:-1:2]) ** 2))
    noise_std = np.sqrt(voiced_power / 10.0 ** (rng.uniform(*SNR_DB) / 10.0))
    signal += rng.normal(0.0, noise_std, size=signal.shape)
    return np.clip(signal, -1.0, 1.0).astype(np.float32)


def make_dtmf_corpus(
    out_dir: str | os.PathLike,
    num_utterances: int,
    seed: int = 0,
    sample_rate: int = 16000,
    *,
    id_prefix: str = CORPUS_NAME,
) -> Path:
    """Write a DTMF digits corpus: 16-bit PCM wavs plus a NeMo JSON-lines manifest.

    Utterance ``i`` depends only on ``(seed, i)``, so a larger corpus with the same seed starts with the
    utterances of a smaller one, and the same arguments always give byte-identical files.

    Args:
        out_dir: Folder to write into; ``audio/<id>.wav`` and ``manifest.json`` are created inside.
        num_utterances: Number of utterances, >= 0.
        seed: Seed of the corpus.
        sample_rate: Sample rate of the wavs in Hz, at least 8000.
        id_prefix: Utterance ids are ``<id_prefix>-<index:06d>``; give splits different prefixes so that
            their ids never collide when corpora are blended.

    Returns:
        Path of the manifest. Each line is ``{"audio_filepath": "audio/<id>.wav", "duration": <s>,
        "text": "3 1 4"}`` with the audio path relative to the manifest's folder and the duration rounded
        to 4 decimals.

    Raises:
        ValueError: If ``num_utterances`` is negative, ``sample_rate`` is too low or ``id_prefix`` is not a
            plain file-name prefix.
    """
    if isinstance(num_utterances, bool) or not isinstance(num_utterances, int) or num_utterances < 0:
        raise ValueError(f"make_dtmf_corpus: num_utterances must be an int >= 0, got {num_utterances!r}")
    if sample_rate < MIN_SAMPLE_RATE:
        raise ValueError(f"make_dtmf_corpus: sample_rate must be >= {MIN_SAMPLE_RATE} Hz, got {sample_rate}")
    if not id_prefix or any(c in id_prefix for c in "/\\") or id_prefix.startswith("."):
        raise ValueError(f"make_dtmf_corpus: id_prefix must be a plain file-name prefix, got {id_prefix!r}")
    out_dir = Path(out_dir)
    audio_dir = out_dir / "audio"
    audio_dir.mkdir(parents=True, exist_ok=True)

    lines = []
    for index, child in enumerate(np.random.SeedSequence(seed).spawn(num_utterances)):
        rng = np.random.default_rng(child)
        num_digits = int(rng.integers(MIN_DIGITS, MAX_DIGITS + 1))
        digits = "".join(DIGITS[d] for d in rng.integers(0, 10, size=num_digits))
        waveform = render_digits(digits, rng, sample_rate)
        name = f"{id_prefix}-{index:06d}.wav"
        sf.write(audio_dir / name, waveform, sample_rate, subtype="PCM_16", format="WAV")
        record = {
            "audio_filepath": f"audio/{name}",
            "duration": round(len(waveform) / sample_rate, 4),
            "text": " ".join(digits),
        }
        lines.append(json.dumps(record) + "\n")

    manifest = out_dir / "manifest.json"
    tmp = out_dir / f".manifest.json.{os.getpid()}.tmp"
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, manifest)
    return manifest


def _split_seed(seed: int, split: str) -> int:
    """Derive a split's seed from the corpus seed and the split name (stable across runs and dict order)."""
    return int(np.random.SeedSequence([seed, zlib.crc32(split.encode("utf-8"))]).generate_state(1)[0])


def _is_complete(root: Path, params: dict) -> bool:
    """Whether ``root`` holds a finished build made with exactly ``params``."""
    try:
        recorded = json.loads((root / "corpus.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if recorded != params:
        return False
    for split, count in params["splits"].items():
        try:
            with open(root / split / "manifest.json", encoding="utf-8") as f:
                if sum(1 for line in f if line.strip()) != count:
                    return False
        except OSError:
            return False
    return True


def prepare_dtmf_corpus(
    root: str | os.PathLike | None = None,
    splits: Mapping[str, int] = DEFAULT_SPLITS,
    seed: int = 0,
    sample_rate: int = 16000,
) -> dict[str, Path]:
    """Build the DTMF corpus once and reuse it afterwards.

    Each split is written to ``root/<split>`` with its own seed derived from ``seed`` and the split name.
    ``root/corpus.json`` records the parameters and is written last: a build that was interrupted, or one
    made with other parameters, is rebuilt rather than reused. Concurrent callers (e.g. every rank of a
    distributed job) are serialized by a lock file, so only the first builds.

    Args:
        root: Corpus folder. Defaults to ``<datasets cache>/dtmf-v1``
            (see :func:`speechtrain.corpora.cache.default_datasets_cache`).
        splits: Split name -> number of utterances.
        seed: Corpus seed.
        sample_rate: Sample rate of the wavs in Hz.

    Returns:
        Split name -> manifest path.

    Raises:
        ValueError: If a split name is not a plain folder name or a count is not an int >= 0.
    """
    for split, count in splits.items():
        if not isinstance(split, str) or split in ("", ".", "..") or any(c in split for c in "/\\"):
            raise ValueError(f"prepare_dtmf_corpus: split names must be plain folder names, got {split!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"prepare_dtmf_corpus: split {split!r} needs an int count >= 0, got {count!r}")
    root = Path(root) if root is not None else default_datasets_cache() / f"{CORPUS_NAME}-v{CORPUS_VERSION}"
    params = {
        "name": CORPUS_NAME,
        "version": CORPUS_VERSION,
        "seed": seed,
        "sample_rate": sample_rate,
        "splits": dict(splits),
    }
    manifests = {split: root / split / "manifest.json" for split in splits}
    # Checked before locking too, so that a finished corpus on a read-only disk can be used.
    if _is_complete(root, params):
        return manifests

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(root, params):
            return manifests
        (root / "corpus.json").unlink(missing_ok=True)
        for split, count in splits.items():
            prefix = f"{CORPUS_NAME}-{split}"
            # Drop wavs of an earlier, larger build so that the folder matches its manifest.
            for stale in (root / split / "audio").glob(f"{prefix}-*.wav"):
                stale.unlink()
            make_dtmf_corpus(root / split, count, _split_seed(seed, split), sample_rate, id_prefix=prefix)
        tmp = root / f".corpus.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(params, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, root / "corpus.json")
    return manifests
