"""Audio codecs for codec-token TTS: audio <-> frames of ``K`` discrete codebook indices.

:class:`AudioCodec` is the interface the TTS model needs (encode, decode, shapes); a stronger neural codec can
fill it later. :class:`MelRVQCodec` is the one that trains on a CPU in minutes: a log-mel spectrogram quantised
by residual vector quantisation (RVQ) whose codebooks are fitted by k-means, decoded back to a mel spectrogram
(the sum of the chosen codewords), then to audio by least-squares mel inversion and Griffin-Lim phase
reconstruction (torchaudio). Nothing is learned by gradient descent, so "training" (``examples/codec_train.py``)
is k-means on frames of the corpus; it is deterministic for a given seed.

Shapes: ``codes`` are ``(B, K, F)`` int64 in ``[0, codebook_size)`` with ``F`` frames at ``frame_rate`` Hz;
``frame_lengths`` give each utterance's valid frames.
"""

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchaudio

from speechtrain.core.model import SpeechModel

logger = logging.getLogger(__name__)


class AudioCodec:
    """What a TTS model needs from a codec (see the module docstring for shapes)."""

    sample_rate: int
    frame_rate: float
    num_codebooks: int
    codebook_size: int

    def encode(
        self, audio: torch.Tensor, audio_lens: torch.Tensor, samples: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) audio, (B,) lengths -> (B, K, F) codes, (B,) frame lengths. ``samples``: the lengths as Python
        ints where the caller has them (a training batch): then the host never reads ``audio_lens``."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor, frame_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, K, F) codes, (B,) frame lengths -> (B, T) audio, (B,) audio lengths."""
        raise NotImplementedError


@dataclass
class MelRVQCodecConfig:
    """Config of :class:`MelRVQCodec`.

    Attributes:
        sample_rate: audio rate (Hz).
        n_fft, win_length, hop_length: STFT geometry (samples); ``sample_rate / hop_length`` frames per second.
        n_mels: mel bands.
        f_min, f_max: mel filter range (Hz; f_max None = Nyquist).
        num_codebooks: RVQ depth ``K``.
        codebook_size: codewords per codebook.
        kmeans_iterations: Lloyd iterations per codebook when fitting.
        griffin_lim_iterations: phase reconstruction iterations when decoding.
        seed: seeds the k-means initialisation.
    """

    sample_rate: int = 16000
    n_fft: int = 1024
    win_length: int = 1024
    hop_length: int = 256
    n_mels: int = 80
    f_min: float = 0.0
    f_max: float | None = None
    num_codebooks: int = 8
    codebook_size: int = 256
    kmeans_iterations: int = 20
    griffin_lim_iterations: int = 32
    seed: int = 0


def kmeans(points: torch.Tensor, k: int, iterations: int, generator: torch.Generator) -> torch.Tensor:
    """(k, D) centroids of ``points`` (N, D) by Lloyd's algorithm from a k-means++ start. Empty clusters are
    re-seeded with the points farthest from their centroid."""
    n = points.shape[0]
    if n < k:
        raise ValueError(f"kmeans: {n} points cannot make {k} clusters; fit on more audio.")
    points = points.double()
    # k-means++ on a random subset (at most 16 points per cluster): the next centre is drawn with probability
    # proportional to its squared distance from the chosen ones.
    subset = points[torch.randperm(n, generator=generator)[: min(n, 16 * k)]]
    centroids = subset[:1]
    closest = torch.cdist(subset, centroids).squeeze(1) ** 2
    for _ in range(1, k):
        index = torch.multinomial(closest / closest.sum(), 1, generator=generator)
        centroids = torch.cat([centroids, subset[index]])
        closest = torch.minimum(closest, (torch.cdist(subset, subset[index]).squeeze(1)) ** 2)
    for _ in range(iterations):
        distances, assignment = _nearest(points, centroids)
        counts = torch.bincount(assignment, minlength=k)
        sums = torch.zeros_like(centroids).index_add_(0, assignment, points)
        empty = counts == 0
        centroids = torch.where(empty[:, None], centroids, sums / counts.clamp(min=1)[:, None])
        if empty.any():
            far = distances.argsort(descending=True)[: int(empty.sum())]
            centroids[empty] = points[far]
    return centroids.float()


def _nearest(points: torch.Tensor, centroids: torch.Tensor, chunk: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared distance to, and index of, each point's nearest centroid (in chunks to bound memory)."""
    distances, indices = [], []
    for start in range(0, points.shape[0], chunk):
        d = torch.cdist(points[start : start + chunk], centroids) ** 2
        value, index = d.min(dim=1)
        distances.append(value)
        indices.append(index)
    return torch.cat(distances), torch.cat(indices)


class MelRVQCodec(SpeechModel, AudioCodec):
    """Log-mel + residual VQ (k-means codebooks) + Griffin-Lim (see the module docstring)."""

    Config = MelRVQCodecConfig
    keep_fp32 = True  # codes come from fp32 features and fp32 codebooks whatever the precision

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        cfg = self.cfg
        self.sample_rate = cfg.sample_rate
        self.frame_rate = cfg.sample_rate / cfg.hop_length
        self.num_codebooks = cfg.num_codebooks
        self.codebook_size = cfg.codebook_size
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=cfg.sample_rate, n_fft=cfg.n_fft, win_length=cfg.win_length, hop_length=cfg.hop_length,
            f_min=cfg.f_min, f_max=cfg.f_max, n_mels=cfg.n_mels, power=1.0, center=True,
        )  # fmt: skip
        self.register_buffer("codebooks", torch.zeros(cfg.num_codebooks, cfg.codebook_size, cfg.n_mels))
        self.register_buffer("fitted", torch.zeros((), dtype=torch.bool))
        self.register_load_state_dict_post_hook(lambda module, keys: setattr(module, "_known_fitted", False))

    def configure_model(self) -> None:
        """Nothing to build: the codebooks are buffers (a SpeechModel hook)."""

    # --------------------------------------------------------------------------------------------- features
    def frame_lengths(self, audio_lens: torch.Tensor) -> torch.Tensor:
        """Frames of utterances of ``audio_lens`` samples (centred STFT)."""
        return audio_lens // self.cfg.hop_length + 1

    def log_mel(
        self, audio: torch.Tensor, audio_lens: torch.Tensor, samples: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) -> (B, n_mels, F) natural-log mel magnitudes (floor 1e-5), fp32, and frame lengths. Each
        utterance is analysed alone (the centred STFT reflects at its own end, not into the padding), so its
        frames do not depend on the batch; padded frames hold the floor. ``samples``: ``audio_lens`` as Python ints,
        when the caller has them (else they are read from the device)."""
        frame_lens = self.frame_lengths(audio_lens)
        samples = audio_lens.tolist() if samples is None else samples
        frames = max(n // self.cfg.hop_length + 1 for n in samples)
        out = torch.full((audio.shape[0], self.cfg.n_mels, frames), -11.5129, device=audio.device)
        with torch.autocast(audio.device.type, enabled=False):
            for i, length in enumerate(samples):
                mel = self.mel(audio[i, :length].float())
                out[i, :, : mel.shape[-1]] = mel.clamp(min=1e-5).log()
        return out, frame_lens

    # ------------------------------------------------------------------------------------------- quantiser
    def quantize(self, log_mel: torch.Tensor) -> torch.Tensor:
        """(B, n_mels, F) -> (B, K, F) codes: each codebook quantises what the previous ones left."""
        self._check_fitted()
        frames = log_mel.transpose(1, 2).reshape(-1, self.cfg.n_mels).double()
        residual, codes = frames, []
        for codebook in self.codebooks.double():
            _, index = _nearest(residual, codebook)
            residual = residual - codebook[index]
            codes.append(index)
        batch, _, length = log_mel.shape
        return torch.stack(codes).reshape(self.num_codebooks, batch, length).transpose(0, 1)

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, K, F) codes -> (B, n_mels, F) log-mel (the sum of the chosen codewords)."""
        total = sum(self.codebooks[k][codes[:, k]] for k in range(codes.shape[1]))  # (B, F, n_mels)
        return total.transpose(1, 2)

    def fit(self, log_mels: list[torch.Tensor], max_frames: int = 200_000) -> dict[str, float]:
        """Fit the codebooks by k-means on the frames of ``log_mels`` (each (n_mels, F), valid frames only; at
        most ``max_frames``, drawn evenly). Returns the mean squared log-mel error after each codebook."""
        cfg = self.cfg
        frames = torch.cat([m.transpose(0, 1) for m in log_mels]).double()
        if frames.shape[0] > max_frames:
            frames = frames[torch.linspace(0, frames.shape[0] - 1, max_frames).long()]
        generator = torch.Generator().manual_seed(cfg.seed)
        residual, errors = frames, {}
        for k in range(cfg.num_codebooks):
            centroids = kmeans(residual, cfg.codebook_size, cfg.kmeans_iterations, generator)
            self.codebooks[k] = centroids
            _, index = _nearest(residual, centroids.double())
            residual = residual - centroids.double()[index]
            errors[f"mse_after_{k + 1}"] = float(residual.pow(2).mean())
        self.fitted.fill_(True)
        self._known_fitted = True
        return errors

    def _check_fitted(self) -> None:
        # Read from the device once, then known on the host (fit and a state-dict load set it again).
        if getattr(self, "_known_fitted", False):
            return
        self._known_fitted = bool(self.fitted)
        if not self._known_fitted:
            raise RuntimeError(
                "MelRVQCodec has no codebooks yet: fit it (examples/codec_train.py) or load an archive."
            )

    # ------------------------------------------------------------------------------------------ interface
    @torch.no_grad()
    def encode(
        self, audio: torch.Tensor, audio_lens: torch.Tensor, samples: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        log_mel, frame_lens = self.log_mel(audio, audio_lens, samples)
        return self.quantize(log_mel), frame_lens

    @torch.no_grad()
    def mel_to_audio(self, log_mel: torch.Tensor, frame_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, n_mels, F) log-mel -> (B, T) audio by least-squares mel inversion and Griffin-Lim (zero initial
        phase, so the result is deterministic)."""
        cfg = self.cfg
        magnitude = self._inverse_mel()(log_mel.float().exp())
        griffin_lim = torchaudio.transforms.GriffinLim(
            n_fft=cfg.n_fft, n_iter=cfg.griffin_lim_iterations, win_length=cfg.win_length,
            hop_length=cfg.hop_length, power=1.0, rand_init=False,
        ).to(log_mel.device)  # fmt: skip
        audio = griffin_lim(magnitude)
        audio_lens = (frame_lens - 1) * cfg.hop_length
        mask = torch.arange(audio.shape[-1], device=audio.device)[None, :] < audio_lens[:, None]
        return audio * mask, audio_lens

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, frame_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mel_to_audio(self.dequantize(codes), frame_lens)

    def _inverse_mel(self) -> torch.nn.Module:
        """Mel -> linear magnitude by non-negative least squares (torchaudio's solver), built once."""
        if getattr(self, "_inverse", None) is None:
            cfg = self.cfg
            # Kept outside the module tree (object.__setattr__): a lazily added submodule would change state_dict.
            inverse = torchaudio.transforms.InverseMelScale(
                n_stft=cfg.n_fft // 2 + 1, n_mels=cfg.n_mels, sample_rate=cfg.sample_rate, f_min=cfg.f_min,
                f_max=cfg.f_max, driver="gelsd",
            )  # fmt: skip
            object.__setattr__(self, "_inverse", inverse)
        self._inverse.to(self.codebooks.device)
        return self._inverse


def mel_distance(reference: torch.Tensor, other: torch.Tensor, lengths: torch.Tensor) -> float:
    """Mean absolute difference of two (B, n_mels, F) log-mel spectrograms over valid frames (natural log)."""
    mask = torch.arange(reference.shape[-1], device=reference.device)[None, None, :] < lengths[:, None, None]
    length = min(reference.shape[-1], other.shape[-1])
    diff = (reference[..., :length] - other[..., :length]).abs() * mask[..., :length]
    return float(diff.sum() / (mask[..., :length].sum() * reference.shape[1]).clamp(min=1))


def load_audio(path: str, sample_rate: int) -> torch.Tensor:
    """A mono float32 waveform at ``sample_rate`` (soundfile; resampled when needed)."""
    import soundfile as sf

    data, rate = sf.read(path, dtype="float32", always_2d=True)
    audio = torch.from_numpy(data.mean(axis=1))
    if rate != sample_rate:
        from speechtrain.data.augment import resample

        audio = resample(audio, rate, sample_rate)
    return audio


def manifest_rows(manifest: str, count: int) -> list[dict[str, Any]]:
    """``count`` rows spread evenly over a manifest (``builtin:`` names resolved): the same for every run."""
    from speechtrain.corpora.builtin import resolve_manifest
    from speechtrain.data.manifest import read_nemo_manifest

    rows = read_nemo_manifest(resolve_manifest(manifest))
    step = max(1, len(rows) // max(count, 1))
    return rows[::step][:count]


def fit_codec(cfg: MelRVQCodecConfig | Any, rows: list[dict[str, Any]]) -> tuple[MelRVQCodec, dict[str, float]]:
    """A codec fitted on the audio of manifest ``rows``, and its log-mel error after each codebook."""
    codec = MelRVQCodec(cfg)
    mels = []
    for row in rows:
        audio = load_audio(row["audio_filepath"], codec.sample_rate)
        log_mel, frames = codec.log_mel(audio[None], torch.tensor([audio.numel()]))
        mels.append(log_mel[0, :, : int(frames[0])])
    return codec, codec.fit(mels)


def ensure_codec(cfg: Any, manifest: str, max_utterances: int = 600) -> Path:
    """The archive of a codec of config ``cfg`` fitted on ``max_utterances`` utterances of ``manifest``: fitted
    once (about a minute) and cached under the datasets cache (``codecs/``, keyed by the manifest's content); the
    file is replaced atomically."""
    import dataclasses
    import hashlib
    import json
    import os
    import tempfile

    from omegaconf import OmegaConf

    from speechtrain.common.fingerprint import file_fingerprint
    from speechtrain.corpora.builtin import resolve_manifest
    from speechtrain.lightning import settings

    plain = OmegaConf.to_container(cfg) if OmegaConf.is_config(cfg) else dataclasses.asdict(cfg)
    source = Path(resolve_manifest(manifest)).resolve()
    key = hashlib.sha256(json.dumps([str(source), file_fingerprint(source), max_utterances, plain],
                                    sort_keys=True).encode()).hexdigest()[:12]  # fmt: skip
    path = settings.SPEECHTRAIN_DATASETS_CACHE / "codecs" / f"melrvq-{key}" / "codec.stm"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        codec, errors = fit_codec(cfg, manifest_rows(manifest, max_utterances))
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            codec.save_to(Path(tmp) / "codec.stm")
            os.replace(Path(tmp) / "codec.stm", path)
        logger.info("Fitted a %d x %d mel-RVQ codec on %d utterances of %s in %.0f s (log-mel MSE %.3f): %s",
                    codec.num_codebooks, codec.codebook_size, max_utterances, manifest, time.perf_counter() - start,
                    list(errors.values())[-1], path)  # fmt: skip
    return path


def round_trip_report(codec: MelRVQCodec, rows: list[dict[str, Any]], asr: Any = None) -> dict[str, float]:
    """Round-trip quality on manifest ``rows``: mean log-mel distance of codec audio to the original (and of
    Griffin-Lim alone, the vocoder's share), and with an ASR model the CER / WER of the original, Griffin-Lim-only
    and codec audio (the model's own decoding)."""
    from speechtrain.common import metrics

    original, codec_audio, vocoder_audio, distances, vocoder_distances = [], [], [], [], []
    for row in rows:
        audio = load_audio(row["audio_filepath"], codec.sample_rate)
        lens = torch.tensor([audio.numel()])
        log_mel, frames = codec.log_mel(audio[None], lens)
        codes, _ = codec.encode(audio[None], lens)
        decoded, decoded_lens = codec.decode(codes, frames)
        vocoded, vocoded_lens = codec.mel_to_audio(log_mel, frames)
        distances.append(mel_distance(log_mel, codec.log_mel(decoded, decoded_lens)[0], frames))
        vocoder_distances.append(mel_distance(log_mel, codec.log_mel(vocoded, vocoded_lens)[0], frames))
        original.append(audio.numpy())
        codec_audio.append(decoded[0, : decoded_lens[0]].numpy())
        vocoder_audio.append(vocoded[0, : vocoded_lens[0]].numpy())
    report = {"utterances": len(rows), "mel_distance": sum(distances) / len(distances),
              "mel_distance_vocoder_only": sum(vocoder_distances) / len(vocoder_distances)}  # fmt: skip
    if asr is not None:
        refs = [row["text"] for row in rows]
        for name, audio in (("original", original), ("vocoder_only", vocoder_audio), ("codec", codec_audio)):
            hyps = asr.transcribe(audio, batch_size=8)
            report[f"cer_{name}"] = metrics.char_error_rate(hyps, refs)
            report[f"wer_{name}"] = metrics.word_error_rate(hyps, refs)
    return report
