"""Synthesise speech with a saved TTS model, and measure how intelligible it is.

    python -m speechtrain.tts.synthesize model_path=tts.stm text="Hello there." [out_dir=tts_out]
    python -m speechtrain.tts.synthesize model_path=tts.stm manifest=test_manifest.json [max_utterances=50] \\
        [guidance_scale=2.5] [temperature=0.6] [top_k=80] [seed=0] [batch_size=8] [asr_model=asr.stm]

Each text becomes ``<out_dir>/<index>.wav`` (16-bit PCM at the model's rate); ``<out_dir>/synthesized.json`` lists
them (JSON lines: ``audio_filepath``, ``text``, ``duration``). Generation settings default to the model's
``inference`` config (a distilled student: no guidance). The real-time factor (synthesis seconds per audio second)
is printed; with ``asr_model`` the synthesised audio is transcribed and the CER / WER against the input texts
printed.
"""

import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import soundfile as sf
import torch

from speechtrain.common.cli import fail, parse_key_values
from speechtrain.common.config import ConfigError
from speechtrain.core.model import SpeechModel

logger = logging.getLogger(__name__)


@dataclass
class SynthesizeConfig:
    """Command-line options of ``python -m speechtrain.tts.synthesize``.

    Attributes:
        model_path: a TTS model archive (``.stm``).
        text: one text to speak (or give ``manifest``).
        manifest: a NeMo manifest (or ``builtin:`` name) whose ``text`` fields are spoken.
        max_utterances: at most this many texts of the manifest.
        out_dir: folder for the WAV files and ``synthesized.json``.
        guidance_scale: CFG scale (null: the model's ``inference`` setting).
        temperature: sampling temperature (null: the model's).
        top_k: sampling top-k (null: the model's).
        seed: sampling seed.
        batch_size: texts synthesised together.
        asr_model: an ASR archive that transcribes the speech to report CER / WER.
    """

    model_path: str | None = None
    text: str | None = None
    manifest: str | None = None
    max_utterances: int | None = None
    out_dir: str = "tts_out"
    guidance_scale: float | None = None
    temperature: float | None = None
    top_k: int | None = None
    seed: int = 0
    batch_size: int = 8
    asr_model: str | None = None


def intelligibility(
    tts: Any, texts: list[str], asr: Any = None, batch_size: int = 8, **generation: Any
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Synthesise ``texts`` in batches; returns the waveforms and a report: ``rtf`` (synthesis seconds per audio
    second, codec decoding included), ``audio_seconds``, ``decoder_passes`` per step, and with an ASR model
    ``cer`` / ``wer`` of its greedy transcripts against ``texts``. ``generation``: :meth:`TTSModel.generate_codes`
    options."""
    from speechtrain.common import metrics

    waves: list[torch.Tensor] = []
    seconds, passes = 0.0, 1
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        seed = generation.get("seed", 0)
        result = tts.synthesize(chunk, return_details=True, **{**generation, "seed": None if seed is None else
                                                                seed + start})  # fmt: skip
        waves += result["audio"]
        seconds += result["seconds"]
        passes = result["decoder_passes"]
    audio_seconds = sum(w.numel() for w in waves) / tts.cfg.sample_rate
    report = {"utterances": len(texts), "audio_seconds": round(audio_seconds, 1),
              "rtf": seconds / max(audio_seconds, 1e-9), "decoder_passes": passes}  # fmt: skip
    if asr is not None:
        # Greedy: an LM fitted on in-domain text would hide mispronunciations.
        hyps = asr.transcribe([w.numpy() for w in waves], batch_size=batch_size, strategy="greedy")
        report["cer"] = metrics.char_error_rate(hyps, texts)
        report["wer"] = metrics.word_error_rate(hyps, texts)
        report["examples"] = [{"text": t, "asr": h} for t, h in list(zip(texts, hyps))[:3]]
    return waves, report


def parse_args(argv: Sequence[str]) -> SynthesizeConfig:
    """``key=value`` arguments as a checked :class:`SynthesizeConfig`.

    Raises:
        ConfigError: on an argument that is not ``key=value``, an unknown key, a wrong type, or when
            ``model_path`` or both / neither of ``text`` and ``manifest`` are given.
    """
    cfg = parse_key_values(argv, SynthesizeConfig, __doc__)
    if not cfg.model_path:
        raise ConfigError("Missing model_path=...")
    if (cfg.text is None) == (cfg.manifest is None):
        raise ConfigError("Give exactly one of text=... and manifest=...")
    if cfg.batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {cfg.batch_size}.")
    return cfg


def _texts(cfg: SynthesizeConfig) -> list[str]:
    if cfg.text is not None:
        return [cfg.text]
    from speechtrain.corpora.builtin import resolve_manifest
    from speechtrain.data.manifest import read_nemo_manifest

    rows = read_nemo_manifest(resolve_manifest(cfg.manifest))
    texts = [r["text"] for r in rows if r.get("text")]
    if cfg.max_utterances is not None:
        texts = texts[: cfg.max_utterances]
    if not texts:
        raise ValueError(f"manifest={cfg.manifest} has no rows with text.")
    return texts


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
        if not Path(cfg.model_path).is_file():
            raise FileNotFoundError(f"model_path={cfg.model_path}: no such file.")
        texts = _texts(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        fail(str(e))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import speechtrain.tts.model  # noqa: F401  (registers the class the archive names)

    tts = SpeechModel.restore_from(cfg.model_path).eval()
    if not callable(getattr(tts, "synthesize", None)):
        fail(f"{type(tts).__name__} (from {cfg.model_path}) has no synthesize method.")
    asr = SpeechModel.restore_from(cfg.asr_model).eval() if cfg.asr_model else None
    keys = ("guidance_scale", "temperature", "top_k")
    generation = {k: getattr(cfg, k) for k in keys if getattr(cfg, k) is not None}
    start = time.perf_counter()
    try:
        waves, report = intelligibility(tts, texts, asr, cfg.batch_size, seed=cfg.seed, **generation)
    except ValueError as e:  # a text the front-end cannot read, or too long
        fail(str(e))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "synthesized.json", "w", encoding="utf-8") as listing:
        for index, (text, wave) in enumerate(zip(texts, waves)):
            path = out / f"{index:05d}.wav"
            sf.write(path, wave.clamp(-1, 1).numpy(), tts.cfg.sample_rate, subtype="PCM_16")
            row = {"audio_filepath": str(path), "text": text, "duration": round(wave.numel() / tts.cfg.sample_rate, 3)}
            listing.write(json.dumps(row, ensure_ascii=False) + "\n")
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in report.items() if k != "examples"}
    print(json.dumps(shown))
    print(f"Wrote {len(waves)} wav files to {out} in {time.perf_counter() - start:.1f} s.")


if __name__ == "__main__":
    main()
