"""Train SALM: a speech-augmented LLM (Conformer perception + modality adapter + a Megatron GPT backbone).

python examples/salm_train.py model.llm.hf_path=<hf folder> model.perception.asr_model=<asr archive .stm>
python examples/salm_train.py ... model.lora='{rank: 16, alpha: 32}' 'model.freeze_exceptions=[lora_]' \\
    'model.freeze=["^perception\\.(encoder|ctc_head)\\.", "^llm\\."]'  # replaces the YAML's list
python examples/salm_train.py ... trainer.devices=2 trainer.strategy.tensor_model_parallel_size=2
python examples/salm_train.py ... model.train_ds.conversations_path=conversations.jsonl

``make salm-demo`` runs the whole self-contained recipe (ASR encoder, tiny GPT pretrained on text, SALM). After
training, the archive is written and, with ``eval_manifest``, every task of ``model.tasks`` is evaluated on it
(generated answers: WER for transcription, exact-match accuracy for the others).
"""

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl

from speechtrain.core.exp_manager import exp_manager, print_final
from speechtrain.core.hydra_runner import hydra_runner
from speechtrain.core.job import train_job_schema
from speechtrain.lightning import Trainer, parallel_state, teardown
from speechtrain.speechlm.model import SALMConfig, SALMModel, prepare_salm_config

logger = logging.getLogger("salm_train")


@dataclass
class SalmExtras:
    """The closing evaluation: a manifest (or null: none) and how many of its utterances."""

    eval_manifest: str | None = "builtin:espeak/test"
    eval_utterances: int | None = None


SCHEMA = train_job_schema(SALMConfig, "salm", extras=SalmExtras)


@hydra_runner(config_path="conf", config_name="salm_train", schema=SCHEMA)
def main(cfg):
    from speechtrain.lightning.fault_tolerance import exit_if_preempted
    from speechtrain.speechlm.generate import evaluate

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    pl.seed_everything(cfg.seed, verbose=False)
    trainer = Trainer.from_job_config(cfg.trainer)
    log_dir = Path(exp_manager(trainer, cfg.exp_manager, name=cfg.name, job_config=cfg))
    prepare_salm_config(cfg.model)
    model = SALMModel(cfg.model)
    if cfg.init_from.path:
        model.init_from_pretrained(cfg.init_from.path, cfg.init_from.include, cfg.init_from.exclude)
    trainer.fit(model)
    exit_if_preempted(trainer)
    trained = time.perf_counter() - start
    if cfg.eval_manifest and parallel_state.in_first_replica():  # TP peers generate together
        report = evaluate(model.eval(), cfg.eval_manifest, cfg.eval_utterances)
        if trainer.is_global_zero:
            print_final("Final: " + json.dumps({"eval_manifest": cfg.eval_manifest, **report}))
    if trainer.is_global_zero:
        print(
            f"{time.perf_counter() - start:.0f} s wall ({trained:.0f} s to the end of training) | run folder {log_dir}"
        )
    teardown(trainer, model)
    return model


if __name__ == "__main__":
    main()
