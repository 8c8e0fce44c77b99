"""Distil a CFG-guided TTS teacher into a student that speaks as well without guidance (half the decoder compute).

python examples/tts_cfg_distill.py model.distillation.teacher_path=speechtrain_experiments/tts_demo/<v>/tts_demo.stm
python examples/tts_cfg_distill.py model.distillation.teacher_path=tts.stm model.distillation.guidance_scale=3 \
    model.distillation.ce_weight=0.0 trainer.max_time=00:00:30:00 asr_model=asr_demo.stm

The student starts from the teacher's weights; the teacher is frozen and never saved with it. ``model`` holds
overrides of the teacher's config (data, optimiser, ``distillation``). The run writes an ordinary TTS archive
whose synthesis default is no guidance; with ``asr_model`` it then reports the student's CER / WER without guidance
and the teacher's with it, with both real-time factors.
"""

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from omegaconf import OmegaConf

from speechtrain.common.config import to_plain
from speechtrain.core.exp_manager import exp_manager, print_final
from speechtrain.core.hydra_runner import hydra_runner
from speechtrain.core.job import train_job_schema
from speechtrain.core.model import SpeechModel
from speechtrain.lightning import Trainer, parallel_state, teardown
from speechtrain.tts.codec import manifest_rows
from speechtrain.tts.distill import CFGDistillationModel, TTSDistillationConfig
from speechtrain.tts.jobs import report_intelligibility
from speechtrain.tts.model import TTSModel
from speechtrain.tts.synthesize import intelligibility

logger = logging.getLogger("tts_cfg_distill")


def student_from_teacher(teacher: TTSModel, overrides: dict[str, Any]) -> CFGDistillationModel:
    """A student with the teacher's config (``overrides`` merged over it) and weights, holding the teacher."""
    cfg = OmegaConf.merge(OmegaConf.create(to_plain(teacher.cfg)), OmegaConf.create(overrides))
    student = CFGDistillationModel(cfg, teacher=teacher)
    report = student.init_from_pretrained(teacher)
    if report.missing or report.mismatched:
        raise ValueError(f"The student does not match its teacher: {report}")
    return student


@dataclass
class DistillExtras:
    """The ASR archive for the closing report, and the test sentences it uses."""

    asr_model: str | None = None
    eval_manifest: str = "builtin:espeak-tts/test"
    eval_utterances: int = 50


# The model node holds overrides of the teacher's config, checked against the distillation config.
SCHEMA = train_job_schema(dict[str, Any], "tts_cfg_distill", model_overrides_of=TTSDistillationConfig,
                          extras=DistillExtras)  # fmt: skip


@hydra_runner(config_path="conf", config_name="tts_cfg_distill", schema=SCHEMA)
def main(cfg):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    pl.seed_everything(cfg.seed, verbose=False)
    overrides = OmegaConf.to_container(cfg.model)
    teacher_path = (overrides.get("distillation") or {}).get("teacher_path")
    if not teacher_path:
        raise SystemExit("error: set model.distillation.teacher_path=<TTS archive> (the guided teacher).")
    trainer = Trainer.from_job_config(cfg.trainer)
    log_dir = exp_manager(trainer, cfg.exp_manager, name=cfg.name, job_config=cfg)
    teacher = TTSModel.restore_from(teacher_path)
    student = student_from_teacher(teacher, overrides)
    trainer.fit(student)
    from speechtrain.lightning.fault_tolerance import exit_if_preempted

    exit_if_preempted(trainer)
    if cfg.asr_model and parallel_state.in_first_replica():  # TP peers synthesise and judge together
        asr = SpeechModel.restore_from(cfg.asr_model).eval()
        report = {"teacher": report_intelligibility(teacher, asr, cfg.eval_manifest, cfg.eval_utterances)}
        sentences = [row["text"] for row in manifest_rows(cfg.eval_manifest, cfg.eval_utterances)]
        _, report["student_no_cfg"] = intelligibility(student, sentences, asr, guidance_scale=1.0)
        if trainer.is_global_zero:
            print_final("Final: " + json.dumps(report, default=float))
    if trainer.is_global_zero:
        print(f"{time.perf_counter() - start:.0f} s wall | run folder {log_dir}")
    teardown(trainer, student)
    return student


if __name__ == "__main__":
    main()
