"""Train a speech recogniser: Conformer / FastConformer CTC (the default), or a transducer (RNN-T, TDT, hybrid
TDT-CTC), with a BPE tokenizer.

python examples/asr_train.py                                   # built-in corpus, CPU demo (trainer.max_time budget)
python examples/asr_train.py --config-name asr_train_tdt       # the same with a TDT transducer (also _rnnt, _hybrid)
python examples/asr_train.py trainer.devices=2                 # two data-parallel processes
python examples/asr_train.py trainer.strategy.tensor_model_parallel_size=2 trainer.devices=2
python examples/asr_train.py --config-name fastconformer_ctc_large model.train_ds.manifest_filepath=train.json  # GPUs
python examples/asr_train.py exp_manager.resume_if_exists=true # continue the latest run
python examples/asr_train.py --config-name asr_train_hybrid prepare_only=true  # build data, tokenizer, LM; stop
"""

import time
from dataclasses import dataclass

import lightning.pytorch as pl

from speechtrain.asr.ctc import resolve_manifest
from speechtrain.asr.jobs import asr_model_class, asr_model_schema, ensure_lm, ensure_tokenizer, fit_and_report
from speechtrain.asr.nemo_config import translate_if_nemo
from speechtrain.core.exp_manager import exp_manager
from speechtrain.core.hydra_runner import hydra_runner
from speechtrain.core.job import train_job_schema
from speechtrain.lightning import Trainer, teardown


@dataclass
class ASRTrainExtras:
    """``prepare_only``: build what the config names (its built-in corpora, the tokenizer, the LM), print where
    they are, and stop before any training. `make demo` starts its training clock after it, so the data a recipe
    reads is named once, in the recipe."""

    prepare_only: bool = False


def job_schema(cfg) -> type:
    """The job's schema, picked from the composed config: a transducer's (asr_train_tdt, ...) or a CTC model's."""
    return train_job_schema(asr_model_schema(cfg), extras=ASRTrainExtras)


@hydra_runner(config_path="conf", config_name="asr_train", schema=job_schema, translate=translate_if_nemo)
def main(cfg):
    start = time.perf_counter()
    pl.seed_everything(cfg.seed, verbose=False)
    ensure_tokenizer(cfg.model.tokenizer, cfg.model.train_ds)  # from its manifests or cuts, when none is given
    ensure_lm(cfg.model.decoding, cfg.model.train_ds)
    if cfg.get("prepare_only"):  # a job composed with the bare train_job_schema (tests, other scripts) has no such key
        return prepare_report(cfg, start)
    trainer = Trainer.from_job_config(cfg.trainer)
    log_dir = exp_manager(trainer, cfg.exp_manager, name=cfg.name, job_config=cfg)
    model = asr_model_class(cfg.model)(cfg.model)
    if cfg.init_from.path:
        model.init_from_pretrained(cfg.init_from.path, cfg.init_from.include, cfg.init_from.exclude)
    fit_and_report(trainer, model, log_dir, start)
    teardown(trainer, model)
    return model


def prepare_report(cfg, start: float) -> None:
    """Resolve the validation manifests too (built-in ones are built here), then print where everything is."""
    paths = cfg.model.validation_ds.manifest_filepath
    for path in [paths] if isinstance(paths, str) else list(paths or []):
        print(f"validation: {resolve_manifest(path)}")
    print(f"tokenizer: {cfg.model.tokenizer.path or 'characters from the config'}")
    if cfg.model.decoding.lm_path:
        print(f"lm: {cfg.model.decoding.lm_path}")
    print(f"prepared in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
