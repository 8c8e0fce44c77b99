"""TTS jobs: what the training and distillation scripts do around the model: the codec and text front-end a
config needs before the model is built (:func:`prepare_tts_config`), and the intelligibility report of a trained
model judged by an ASR model (:func:`report_intelligibility`). The model modules never import this one."""

import logging
import time
from typing import Any

from omegaconf import OmegaConf

from speechtrain.corpora.builtin import resolve_manifest
from speechtrain.data.manifest import read_nemo_manifest
from speechtrain.tts.codec import MelRVQCodec, ensure_codec, manifest_rows
from speechtrain.tts.model import TTSModel
from speechtrain.tts.synthesize import intelligibility
from speechtrain.tts.text import TextFrontEnd

logger = logging.getLogger(__name__)


def prepare_tts_config(model_cfg: Any, codec_model: str | None, codec_utterances: int = 600) -> MelRVQCodec:
    """Completes a training config before the model is built: ``codec`` from the codec archive ``codec_model``
    (None: a codec of ``model_cfg.codec`` fitted on ``codec_utterances`` utterances of the first training
    manifest, cached), and the text front-end's symbol inventory from the training transcripts when
    ``text.vocab`` is null. Returns the codec, whose codebooks the model then loads."""
    manifests = model_cfg.train_ds.manifest_filepath
    if not manifests:
        raise ValueError("model.train_ds.manifest_filepath is not set: there is nothing to train on.")
    manifests = [manifests] if isinstance(manifests, str) else list(manifests)
    if codec_model is None:
        codec_model = str(ensure_codec(model_cfg.codec, manifests[0], codec_utterances))
    codec = MelRVQCodec.restore_from(codec_model)
    for key, value in codec.cfg.items():  # the archive's settings win over the job's
        model_cfg.codec[key] = value
    if not model_cfg.text.vocab:
        frontend = TextFrontEnd(OmegaConf.to_object(model_cfg.text))
        start = time.perf_counter()
        vocab = frontend.fit(r["text"] for m in manifests for r in read_nemo_manifest(resolve_manifest(m)))
        model_cfg.text.vocab = vocab
        logger.info("Text front-end (%s): %d symbols from the training transcripts in %.1f s.", model_cfg.text.kind,
                    len(vocab), time.perf_counter() - start)  # fmt: skip
    return codec


def report_intelligibility(model: TTSModel, asr: Any, manifest: str, count: int, batch_size: int = 8) -> dict:
    """CER / WER of ``asr`` on ``count`` sentences of ``manifest`` synthesised by ``model`` with its guidance scale
    and without guidance (scale 1), with the real-time factors; the other settings from ``model.cfg.inference``."""
    texts = [row["text"] for row in manifest_rows(manifest, count)]
    report: dict[str, Any] = {"utterances": len(texts)}
    scale = model.cfg.inference.guidance_scale
    for name, value in (("cfg", scale), ("no_cfg", 1.0)):
        if name == "cfg" and value == 1.0:
            continue
        _, result = intelligibility(model, texts, asr, batch_size, guidance_scale=value)
        report[name] = {"guidance_scale": value, **{k: (round(v, 4) if isinstance(v, float) else v)
                                                    for k, v in result.items()}}  # fmt: skip
    return report
