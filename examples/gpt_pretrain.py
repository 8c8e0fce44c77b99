"""Pretrain a small GPT (Megatron Core, Llama-style) on text and write it as a Hugging Face checkpoint folder.

python examples/gpt_pretrain.py                         # the SALM demo's LLM: corpus sentences, CPU budget
python examples/gpt_pretrain.py model.data.text_file=my_text.txt model.llm.num_layers=8 trainer.max_time=null \\
    trainer.max_steps=20000

Without ``model.tokenizer``, a byte-level BPE of ``tokenizer_vocab_size`` tokens is trained on the text first,
with the chat template's special tokens and the audio placeholder reserved. The run folder gets ``hf/``
(``config.json``, ``model.safetensors``, tokenizer files) for ``examples/salm_train.py model.llm.hf_path=...``.
"""

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
from omegaconf import OmegaConf

from speechtrain.core.exp_manager import exp_manager, print_final
from speechtrain.core.hydra_runner import hydra_runner
from speechtrain.core.job import train_job_schema
from speechtrain.lightning import Trainer, teardown
from speechtrain.speechlm.backbone import GPTConfig
from speechtrain.speechlm.lm import GPTPretrainConfig, GPTPretrainModel, corpus_sentences
from speechtrain.speechlm.tokenizer import train_bpe_tokenizer

logger = logging.getLogger("gpt_pretrain")


@dataclass
class PretrainExtras:
    """The tokenizer to train when ``model.tokenizer`` is null: its size, how many texts it is fitted on, and
    the chat template whose special tokens it reserves."""

    tokenizer_vocab_size: int = 1024
    tokenizer_texts: int = 50_000
    prompt_format: str = "llama3"


SCHEMA = train_job_schema(GPTPretrainConfig, "gpt_pretrain", extras=PretrainExtras)


def prepare_tokenizer(cfg, folder: Path) -> None:
    """Train the BPE tokenizer into ``folder`` and point ``cfg.model.tokenizer`` at it (when none is given)."""
    from speechtrain.speechlm.prompts import get_template

    if cfg.model.tokenizer:
        return
    data = cfg.model.data
    if data.text_file:
        with open(data.text_file, encoding="utf-8") as f:
            texts = [line.strip() for line in f if line.strip()][: cfg.tokenizer_texts]
    else:
        texts = corpus_sentences(cfg.tokenizer_texts, data.corpus_seed, data.generator_seed)
    template = get_template(cfg.prompt_format)
    tokenizer = train_bpe_tokenizer(texts, cfg.tokenizer_vocab_size, template.special_tokens)
    tokenizer.save(folder)
    cfg.model.tokenizer = str(folder / "tokenizer.json")
    logger.info("Trained a %d-token BPE tokenizer on %d texts: %s", tokenizer.vocab_size, len(texts), folder)


@hydra_runner(config_path="conf", config_name="gpt_pretrain", schema=SCHEMA)
def main(cfg):
    from speechtrain.speechlm.hf import export_hf

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    pl.seed_everything(cfg.seed, verbose=False)
    trainer = Trainer.from_job_config(cfg.trainer)
    log_dir = Path(exp_manager(trainer, cfg.exp_manager, name=cfg.name, job_config=cfg))
    prepare_tokenizer(cfg, log_dir / "tokenizer")
    model = GPTPretrainModel(cfg.model)
    if cfg.init_from.path:
        model.init_from_pretrained(cfg.init_from.path, cfg.init_from.include, cfg.init_from.exclude)
    trainer.fit(model)
    from speechtrain.lightning.fault_tolerance import exit_if_preempted

    exit_if_preempted(trainer)
    results = trainer.validate(model, verbose=False)
    hf_dir = log_dir / "hf"
    llm_cfg = GPTConfig(**OmegaConf.to_container(model.cfg.llm))
    export_hf(model.llm, llm_cfg, hf_dir, tokenizer_dir=Path(model.cfg.tokenizer).parent)  # every rank takes part
    if trainer.is_global_zero:
        val = results[0].get("val_loss") if results else None
        print_final(
            f"Final: val_loss={float(val):.4f} | {time.perf_counter() - start:.0f} s wall | HF checkpoint {hf_dir}"
        )
    teardown(trainer, model)
    return model


if __name__ == "__main__":
    main()
