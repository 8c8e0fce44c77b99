"""Fit the mel-RVQ audio codec (k-means codebooks) on a corpus and report its round-trip quality.

python examples/codec_train.py                                  # built-in eSpeak corpus, 8 x 256 codebooks
python examples/codec_train.py codec.num_codebooks=4 max_utterances=2000 asr_model=run/asr_demo.stm
"""

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from speechtrain.core.hydra_runner import hydra_runner
from speechtrain.core.model import SpeechModel
from speechtrain.tts.codec import MelRVQCodecConfig, fit_codec, manifest_rows, round_trip_report

logger = logging.getLogger("codec_train")


@dataclass
class CodecTrainJob:
    """Config of examples/codec_train.py (see conf/codec_train.yaml)."""

    name: str = "codec"
    train_manifest: str = "builtin:espeak/train"
    eval_manifest: str | None = "builtin:espeak/test"
    max_utterances: int = 600
    eval_utterances: int = 40
    asr_model: str | None = None
    output: str | None = None
    codec: MelRVQCodecConfig = field(default_factory=MelRVQCodecConfig)


@hydra_runner(config_path="conf", config_name="codec_train", schema=CodecTrainJob)
def main(cfg):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    rows = manifest_rows(cfg.train_manifest, cfg.max_utterances)  # spread over the corpus, same for every run
    codec, errors = fit_codec(cfg.codec, rows)
    logger.info("Fitted %d x %d codebooks on %d utterances in %.0f s; log-mel MSE after each: %s",
                codec.num_codebooks, codec.codebook_size, len(rows), time.perf_counter() - start,
                ", ".join(f"{v:.3f}" for v in errors.values()))  # fmt: skip
    output = Path(cfg.output or f"speechtrain_experiments/{cfg.name}/{cfg.name}.stm")
    codec.save_to(output)
    report = {"fit_seconds": round(time.perf_counter() - start, 1), **errors}
    if cfg.eval_manifest and cfg.eval_utterances > 0:
        asr = SpeechModel.restore_from(cfg.asr_model).eval() if cfg.asr_model else None
        report.update(round_trip_report(codec, manifest_rows(cfg.eval_manifest, cfg.eval_utterances), asr))
    print(json.dumps({"archive": str(output), **report}, indent=1))
    return codec


if __name__ == "__main__":
    main()
