"""CFG distillation: a student TTS model, run once without guidance, learns its teacher's guided distribution.

The teacher is a trained :class:`~speechtrain.tts.model.TTSModel` restored from an archive, frozen, in eval mode, and
held outside the student's module tree, so it is in neither the student's checkpoints nor its archive. The student
starts from the teacher's weights. Each step, on teacher-forced frames of the batch, the teacher runs with and
without the text; the student runs once with the text and learns
``kl_weight * T^2 * KL(guided teacher || student) + ce_weight * CE(student, codes)``
(:func:`~speechtrain.tts.guidance.cfg_distillation_loss`). The result is saved as an ordinary ``TTSModel`` archive
whose inference default is no guidance: half the decoder compute per frame of its guided teacher.
"""

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from speechtrain.common.config import to_plain
from speechtrain.tts.guidance import cfg_distillation_loss
from speechtrain.tts.model import TTSConfig, TTSModel

logger = logging.getLogger(__name__)


@dataclass
class DistillationConfig:
    """``model.distillation``: the ``teacher_path`` archive, the teacher's ``guidance_scale``, the ``temperature``
    of both distributions and the weights of the KL and cross-entropy terms."""

    teacher_path: str | None = None
    guidance_scale: float = 1.5
    temperature: float = 1.0
    kl_weight: float = 1.0
    ce_weight: float = 0.1


@dataclass
class TTSDistillationConfig(TTSConfig):
    """A TTS model config plus its ``distillation`` settings."""

    distillation: DistillationConfig = field(default_factory=DistillationConfig)


class CFGDistillationModel(TTSModel):
    """The student being distilled (see the module docstring). ``teacher`` may be given directly (tests); else it
    is restored from ``distillation.teacher_path`` when the layers are built."""

    Config = TTSDistillationConfig

    def __init__(self, cfg: Any, teacher: TTSModel | None = None) -> None:
        super().__init__(cfg)
        self._set_teacher(teacher)

    def _set_teacher(self, teacher: TTSModel | None) -> None:
        if teacher is not None:
            teacher.eval()
            teacher.requires_grad_(False)
        object.__setattr__(self, "_teacher", teacher)  # not a submodule: never saved, never optimised

    @property
    def teacher(self) -> TTSModel:
        if self._teacher is None:
            path = self.cfg.distillation.teacher_path
            if not path:
                raise ValueError("model.distillation.teacher_path is not set: there is no teacher to distil.")
            self._set_teacher(TTSModel.restore_from(path, map_location=self.device))
        if self._teacher.device != self.device:
            self._teacher.to(self.device)
        return self._teacher

    def forward_step(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Student logits (one pass, with the text, no prior), the targets, and the teacher's conditional and
        unconditional logits stacked (2, B, T, S, K, V)."""
        teacher = self.teacher
        with torch.no_grad():
            everyone = torch.ones(len(batch["ids"]), dtype=torch.bool, device=batch["text_tokens"].device)
            cond, tf, _ = teacher.teacher_forced_logits(batch)
            uncond, _, _ = teacher.teacher_forced_logits(batch, dropped=everyone)
        student, _, _ = self.teacher_forced_logits(batch)
        return student, tf, torch.stack([cond, uncond])

    def loss_step(self, batch: dict[str, Any], output: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss x count, count) with the distillation loss averaged over valid (frame, codebook) slots."""
        student, tf, teacher = output
        d = self.cfg.distillation

        def frames(t: torch.Tensor) -> torch.Tensor:  # (B, T, S, ...) -> (B, T*S, ...)
            return t.flatten(1, 2)

        loss, parts = cfg_distillation_loss(
            frames(student), frames(teacher[0]), frames(teacher[1]), frames(tf["targets"]), frames(tf["mask"]),
            d.guidance_scale, d.temperature, d.kl_weight, d.ce_weight,
        )  # fmt: skip
        self._parts = {k: v.detach() for k, v in parts.items()}
        count = tf["mask"].sum() * self.num_codebooks
        return loss * count, count

    def training_step(self, batch: dict[str, Any] | None, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        if loss is not None:
            self.log("train_kl", self._parts["kl"], batch_size=len(batch["ids"]))
            self.log("train_ce", self._parts["ce"], batch_size=len(batch["ids"]))
        return loss

    def archive_identity(self) -> tuple[str, dict[str, Any]]:
        """Saved as a plain :class:`TTSModel` (no distillation settings) that synthesises without guidance."""
        config = {k: v for k, v in to_plain(self.cfg).items() if k != "distillation"}
        config["inference"] = {**config["inference"], "guidance_scale": 1.0}
        return f"{TTSModel.__module__}.{TTSModel.__qualname__}", config
