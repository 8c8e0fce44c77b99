"""Train a speech recogniser.

python examples/asr_train.py                                   # built-in corpus, CPU, a few minutes
python examples/asr_train.py trainer.max_epochs=20 model.optim.lr=3e-3
python examples/asr_train.py init_from.path=model.stm exp_manager.resume_if_exists=true
"""

import lightning.pytorch as pl
from omegaconf import OmegaConf

from speechtrain.asr.conv_ctc import ConvCTCConfig, ConvCTCModel
from speechtrain.core.exp_manager import exp_manager
from speechtrain.core.hydra_runner import hydra_runner
from speechtrain.core.job import train_job_schema
from speechtrain.data.manifest import read_nemo_manifest
from speechtrain.data.synthetic import resolve_manifest
from speechtrain.lightning import Trainer, teardown


@hydra_runner(config_path="conf", config_name="asr_train", schema=train_job_schema(ConvCTCConfig))
def main(cfg):
    pl.seed_everything(cfg.seed, verbose=False)
    trainer = Trainer(**OmegaConf.to_container(cfg.trainer, resolve=True))
    log_dir = exp_manager(trainer, cfg.exp_manager, name=cfg.name, job_config=cfg)
    model = ConvCTCModel(cfg.model)
    if cfg.init_from.path:
        model.init_from_pretrained(cfg.init_from.path, cfg.init_from.include, cfg.init_from.exclude)
    trainer.fit(model)
    if trainer.is_global_zero:
        metrics = {k: f"{float(v):.4f}" for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
        print(f"\n{metrics} | run folder {log_dir}")
        records = read_nemo_manifest(resolve_manifest(cfg.model.validation_ds.manifest_filepath))[:5]
        for record, hyp in zip(records, model.transcribe([r["audio_filepath"] for r in records])):
            print(f"  ref: {record['text']:<20} hyp: {hyp}")
    teardown(trainer, model)


if __name__ == "__main__":
    main()
