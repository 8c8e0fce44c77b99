"""Fine-tune a trained speech recogniser from its archive, or from a checkpoint of its run (see
conf/asr_finetune.yaml).

python examples/asr_finetune.py init_from.path=asr_demo.stm model.train_ds.manifest_filepath=new/train.json \
    model.validation_ds.manifest_filepath=new/dev.json model.optim.lr=5e-4
python examples/asr_finetune.py init_from.path=asr_demo.stm model.tokenizer.path=null model.tokenizer.vocab_size=256
python examples/asr_finetune.py init_from.path=stt_en_fastconformer_ctc_large.nemo  # a NeMo checkpoint
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from omegaconf import OmegaConf

from speechtrain.asr.jobs import (
    FinetuneLMConfig,
    ensure_lm,
    ensure_tokenizer,
    finetune_lm,
    fit_and_report,
    restore_for_finetuning,
)
from speechtrain.asr.transducer import ConformerTransducerConfig
from speechtrain.common.config import to_plain
from speechtrain.core.exp_manager import exp_manager
from speechtrain.core.hydra_runner import hydra_runner
from speechtrain.core.job import train_job_schema
from speechtrain.core.model import SpeechModel
from speechtrain.lightning import Trainer, teardown

logger = logging.getLogger("asr_finetune")
DEFAULT_EPOCHS = 5  # the run's length when the job bounds it neither by time, steps nor epochs
DATA_KEYS = ("manifest_filepath", "cuts_path", "shar_path", "input_cfg", "is_tarred", "tarred_audio_filepaths")


def finetune_model(
    base: SpeechModel,
    overrides: dict[str, Any],
    include=None,
    exclude=None,
    defer: bool = False,
    lm: FinetuneLMConfig | None = None,
) -> SpeechModel:
    """A new model of ``base``'s class with ``overrides`` merged over its config, initialised from ``base``'s
    weights. A different tokenizer keeps the encoder and re-initialises the decoder (said in the log).
    New training data (``train_ds``) gets a beam-search LM by the rule ``lm`` (:func:`~speechtrain.asr.jobs.
    finetune_lm`: by default the archive's LM interpolated with one fitted on the new transcripts); a
    ``decoding.lm_path`` given is used as it is. ``defer``: load the weights when the trainer builds the layers
    (under tensor parallelism each rank then takes its slices)."""
    overrides = dict(overrides)
    base_cfg = OmegaConf.create(to_plain(base.cfg))
    archive_lm = base_cfg.decoding.get("lm_path") if "decoding" in base_cfg else None
    new_data = any(dict(overrides.get("train_ds") or {}).get(k) for k in DATA_KEYS)
    for node in ("train_ds", "validation_ds"):  # the data named here replaces the archive's, not joins it
        given = dict(overrides.get(node) or {})
        if node in base_cfg and any(given.get(k) for k in DATA_KEYS):
            for key in DATA_KEYS:
                if key in base_cfg[node] and key not in given:
                    base_cfg[node][key] = False if key == "is_tarred" else None
    tokenizer = dict(overrides.get("tokenizer") or {})
    new_tokenizer = bool(tokenizer) and any(k in tokenizer for k in ("path", "vocab", "vocab_size", "type"))
    cfg = OmegaConf.merge(base_cfg, OmegaConf.create(overrides))
    if new_tokenizer and not tokenizer.get("path") and not tokenizer.get("vocab"):
        cfg.tokenizer.path, cfg.tokenizer.vocab = None, None
        ensure_tokenizer(cfg.tokenizer, cfg.train_ds)
    origin = None
    if new_data and "decoding" in cfg:
        if not dict(overrides.get("decoding") or {}).get("lm_path"):
            cfg.decoding.lm_path = None  # the rule decides, from the archive's LM and the new transcripts
        origin = finetune_lm(cfg.decoding, cfg.train_ds, archive_lm, lm or FinetuneLMConfig())
    elif "lm_path" in dict(overrides.get("decoding") or {}):
        ensure_lm(cfg.decoding, cfg.train_ds)
    model = type(base)(cfg)
    model.lm_origin = origin or None  # said by the closing report (speechtrain.asr.report.lm_description)
    exclude = list(exclude or [])
    if new_tokenizer or model.tokenizer.vocab_size != base.tokenizer.vocab_size:
        # the CTC head's self-conditioning projection and a transducer's prediction and joint networks go too
        exclude += ["decoder", "conditioning", "prediction", "joint"]
        logger.warning(
            "New tokenizer (%d -> %d tokens): the CTC decoder is re-initialised; the encoder is kept.",
            base.tokenizer.vocab_size, model.tokenizer.vocab_size,
        )  # fmt: skip
    if defer:
        model.init_from_pretrained_when_built(base, include=include, exclude=exclude)
        return model
    report = model.init_from_pretrained(base, include=include, exclude=exclude)
    logger.info("Initialised from the pretrained model: %s", report)
    return model


@dataclass
class FinetuneExtras:
    """``lm``: the beam-search LM of the fine-tuned model when the job names new training data
    (:class:`~speechtrain.asr.jobs.FinetuneLMConfig`)."""

    lm: FinetuneLMConfig = field(default_factory=FinetuneLMConfig)


# The model node holds overrides of the pretrained model's config: each key is checked against the Conformer
# config of CTC and transducer models (a typo fails at start; a transducer key on a CTC model fails when the model
# is built) and can be set without '+', but nothing is filled in from defaults.
FINETUNE_SCHEMA = train_job_schema(dict[str, Any], "asr_finetune", model_overrides_of=ConformerTransducerConfig,
                                   extras=FinetuneExtras)  # fmt: skip


def bound_run(trainer_cfg) -> None:
    """``DEFAULT_EPOCHS`` when no ``max_epochs``, ``max_steps`` or ``max_time`` is given. A default ``max_epochs``
    beside a ``max_time`` would stop a run asked for 8 minutes after a minute on a small set."""
    if (
        trainer_cfg.get("max_epochs") is None
        and trainer_cfg.get("max_time") is None
        and (trainer_cfg.get("max_steps") is None or trainer_cfg.max_steps < 0)
    ):
        trainer_cfg.max_epochs = DEFAULT_EPOCHS
        logger.info("No trainer.max_epochs, max_steps or max_time given: training %d epochs.", DEFAULT_EPOCHS)


@hydra_runner(config_path="conf", config_name="asr_finetune", schema=FINETUNE_SCHEMA)
def main(cfg):
    start = time.perf_counter()
    pl.seed_everything(cfg.seed, verbose=False)
    base = restore_for_finetuning(cfg.init_from.path)  # kept alive: its extracted artifacts back the new model
    lm = FinetuneLMConfig(**OmegaConf.to_container(cfg.lm)) if cfg.get("lm") is not None else None
    model = finetune_model(base, OmegaConf.to_container(cfg.model), cfg.init_from.include, cfg.init_from.exclude,
                           defer=True, lm=lm)  # fmt: skip
    bound_run(cfg.trainer)
    trainer = Trainer.from_job_config(cfg.trainer)
    log_dir = exp_manager(trainer, cfg.exp_manager, name=cfg.name, job_config=cfg)
    fit_and_report(trainer, model, log_dir, start)
    teardown(trainer, model)
    return model


if __name__ == "__main__":
    main()
