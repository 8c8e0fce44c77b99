"""Train a codec-token TTS model (text encoder, autoregressive codec-frame decoder, classifier-free guidance).

python examples/tts_train.py                                # one eSpeak voice (builtin:espeak-tts), CPU demo budget
python examples/tts_train.py asr_model=speechtrain_experiments/asr_demo/<version>/asr_demo.stm  # + intelligibility
python examples/tts_train.py model.text.kind=chars trainer.max_time=null trainer.max_steps=20000
python examples/tts_train.py codec_model=my_codec.stm      # a codec fitted by examples/codec_train.py

Before training, the script fits the text front-end's symbol inventory on the training transcripts and, without
``codec_model``, fits the mel-RVQ codec on ``codec_utterances`` training utterances (cached). After training it
writes the archive; with ``asr_model`` it synthesises ``eval_utterances`` test sentences with and without CFG and
prints the ASR's CER / WER on them and the real-time factors.
"""

import json
import logging
import time
from dataclasses import dataclass

import lightning.pytorch as pl

from speechtrain.core.exp_manager import exp_manager, print_final
from speechtrain.core.hydra_runner import hydra_runner
from speechtrain.core.job import train_job_schema
from speechtrain.core.model import SpeechModel
from speechtrain.lightning import Trainer, parallel_state, teardown
from speechtrain.tts.jobs import prepare_tts_config, report_intelligibility
from speechtrain.tts.model import TTSConfig, TTSModel

logger = logging.getLogger("tts_train")


@dataclass
class TTSExtras:
    """Keys of the job besides the model: the codec archive (or null: fit one), how many utterances to fit it
    on, the ASR archive for the closing intelligibility report and how many test sentences it uses."""

    codec_model: str | None = None
    codec_utterances: int = 600
    asr_model: str | None = None
    eval_manifest: str = "builtin:espeak-tts/test"
    eval_utterances: int = 50


SCHEMA = train_job_schema(TTSConfig, "tts", extras=TTSExtras)


@hydra_runner(config_path="conf", config_name="tts_train", schema=SCHEMA)
def main(cfg):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    pl.seed_everything(cfg.seed, verbose=False)
    trainer = Trainer.from_job_config(cfg.trainer)
    log_dir = exp_manager(trainer, cfg.exp_manager, name=cfg.name, job_config=cfg)
    codec = prepare_tts_config(cfg.model, cfg.codec_model, cfg.codec_utterances)
    model = TTSModel(cfg.model)
    model.codec.load_state_dict(codec.state_dict())
    if cfg.init_from.path:
        model.init_from_pretrained(cfg.init_from.path, cfg.init_from.include, cfg.init_from.exclude)
    trainer.fit(model)
    from speechtrain.lightning.fault_tolerance import exit_if_preempted

    exit_if_preempted(trainer)
    if cfg.asr_model and parallel_state.in_first_replica():  # TP peers synthesise and judge together
        asr = SpeechModel.restore_from(cfg.asr_model).eval()
        report = report_intelligibility(model, asr, cfg.eval_manifest, cfg.eval_utterances)
        if trainer.is_global_zero:
            print_final("Final: " + json.dumps(report))
    if trainer.is_global_zero:
        print(f"{time.perf_counter() - start:.0f} s wall | run folder {log_dir}")
    teardown(trainer, model)
    return model


if __name__ == "__main__":
    main()
