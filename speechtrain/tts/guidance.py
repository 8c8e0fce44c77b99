"""Classifier-free guidance (CFG) for codec-token TTS, and the loss that distils it into a one-pass student.

* Training drops the text condition of a random subset of utterances (:func:`condition_dropout_mask`); the model
  then learns both ``p(codes | text)`` and ``p(codes)``.
* Inference runs the conditional and unconditional passes and combines their logits,
  ``guided = uncond + scale * (cond - uncond)`` (:func:`guide_logits`; ``scale = 1`` is plain conditional
  decoding), then samples each codebook with temperature and top-k (:func:`sample_codes`).
* CFG distillation trains a student, run once without guidance, towards the teacher's guided distribution:
  ``kl_weight * T^2 * KL(softmax(guided / T) || softmax(student / T)) + ce_weight * CE(student, targets)``
  averaged over valid (frame, codebook) positions (:func:`cfg_distillation_loss`).

Logits are ``(B, F, K, V)``: batch, frames, codebooks, codebook entries (with any special tokens).
"""

import torch
import torch.nn.functional as F


def condition_dropout_mask(batch_size: int, probability: float, generator: torch.Generator | None = None,
                           device: torch.device | str = "cpu") -> torch.Tensor:  # fmt: skip
    """(B,) bool: True where the text condition is dropped (replaced by the model's "no text" input).

    Raises:
        ValueError: if ``probability`` is outside [0, 1].
    """
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"condition dropout probability must be in [0, 1], got {probability}.")
    return torch.rand(batch_size, generator=generator, device=device) < probability


def guide_logits(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """CFG combination ``uncond + scale * (cond - uncond)`` of two logit tensors of the same shape."""
    if cond.shape != uncond.shape:
        raise ValueError(f"guide_logits: shapes differ, {tuple(cond.shape)} vs {tuple(uncond.shape)}.")
    return uncond + scale * (cond - uncond)


def sample_codes(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:  # fmt: skip
    """One index per distribution in ``logits`` (..., V): greedy when ``temperature`` is 0, else sampled from the
    temperature-scaled softmax restricted to the ``top_k`` largest logits (None: all)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")
    if temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        threshold = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = scaled.softmax(dim=-1).reshape(-1, scaled.shape[-1])
    return torch.multinomial(probs, 1, generator=generator).reshape(scaled.shape[:-1])


def cfg_distillation_loss(
    student: torch.Tensor,
    teacher_cond: torch.Tensor,
    teacher_uncond: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    temperature: float = 1.0,
    kl_weight: float = 1.0,
    ce_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The student's loss against the teacher's guided distribution (see the module docstring).

    Args:
        student: (B, F, K, V) student logits (one unguided pass).
        teacher_cond, teacher_uncond: (B, F, K, V) teacher logits with and without the text (no gradient needed).
        targets: (B, F, K) the codes the frames were teacher-forced with (for the cross-entropy term).
        mask: (B, F) True on valid frames.
        scale: the teacher's guidance scale.
        temperature: softens both distributions; the KL term is multiplied by ``temperature**2`` so that its
            gradients keep their size (Hinton et al.).
        kl_weight, ce_weight: weights of the two terms.

    Returns:
        The loss (a scalar) and its parts (``kl``, ``ce``), each averaged over valid (frame, codebook) positions.
    """
    guided = guide_logits(teacher_cond.detach().float(), teacher_uncond.detach().float(), scale)
    log_student = F.log_softmax(student.float() / temperature, dim=-1)
    log_teacher = F.log_softmax(guided / temperature, dim=-1)
    kl = (log_teacher.exp() * (log_teacher - log_student)).sum(dim=-1)  # (B, F, K)
    ce = F.cross_entropy(student.float().flatten(0, 2), targets.flatten(), reduction="none").view_as(kl)
    weights = mask[:, :, None].expand_as(kl).float()
    count = weights.sum().clamp(min=1.0)
    parts = {"kl": (kl * weights).sum() / count, "ce": (ce * weights).sum() / count}
    loss = kl_weight * temperature**2 * parts["kl"] + ce_weight * parts["ce"]
    return loss, parts
