import math

import pytest
import torch

from speechtrain.tts.guidance import cfg_distillation_loss, condition_dropout_mask, guide_logits, sample_codes


def test_guidance_combines_logits_as_hand_computed():
    cond = torch.tensor([[2.0, 0.0, -1.0]])
    uncond = torch.tensor([[1.0, 1.0, 0.0]])
    # uncond + 3 * (cond - uncond) = [1 + 3, 1 - 3, 0 - 3]
    assert guide_logits(cond, uncond, 3.0).tolist() == [[4.0, -2.0, -3.0]]
    assert torch.equal(guide_logits(cond, uncond, 1.0), cond) and torch.equal(guide_logits(cond, uncond, 0.0), uncond)
    with pytest.raises(ValueError, match="shapes differ"):
        guide_logits(cond, uncond[:, :2], 2.0)


def test_condition_dropout_rate():
    mask = condition_dropout_mask(100_000, 0.1, torch.Generator().manual_seed(0))
    assert mask.dtype == torch.bool and abs(mask.float().mean().item() - 0.1) < 0.005
    assert not condition_dropout_mask(1000, 0.0).any() and condition_dropout_mask(1000, 1.0).all()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        condition_dropout_mask(4, 1.5)


def test_sampling_greedy_top_k_and_temperature():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).expand(20_000, 4)
    assert sample_codes(logits, temperature=0).unique().tolist() == [1]
    picks = sample_codes(logits, temperature=1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(picks.unique().tolist()) == {1, 3}  # only the two largest logits
    share = (picks == 1).float().mean().item()
    assert abs(share - math.e / (math.e + 1)) < 0.01  # softmax over {3, 2}
    hot = sample_codes(logits, temperature=100.0, generator=torch.Generator().manual_seed(0))
    assert abs((hot == 0).float().mean().item() - 0.25) < 0.02  # a high temperature flattens the distribution


def test_distillation_loss_matches_a_reference_computation():
    generator = torch.Generator().manual_seed(0)
    shape = (2, 3, 2, 5)  # B, F, K, V
    student, cond, uncond = (torch.randn(shape, generator=generator) for _ in range(3))
    targets = torch.randint(5, shape[:3], generator=generator)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    scale, temperature = 2.5, 2.0
    loss, parts = cfg_distillation_loss(student, cond, uncond, targets, mask, scale, temperature, 0.7, 0.3)
    kls, ces = [], []
    for b in range(2):
        for f in range(3):
            if not mask[b, f]:
                continue
            for k in range(2):
                guided = uncond[b, f, k] + scale * (cond[b, f, k] - uncond[b, f, k])
                p = torch.softmax(guided / temperature, 0)
                q = torch.softmax(student[b, f, k] / temperature, 0)
                kls.append(sum(p[v] * math.log(p[v] / q[v]) for v in range(5)))
                ces.append(-torch.log_softmax(student[b, f, k], 0)[targets[b, f, k]])
    kl, ce = sum(kls) / len(kls), sum(ces) / len(ces)
    torch.testing.assert_close(parts["kl"], torch.as_tensor(kl, dtype=torch.float32))
    torch.testing.assert_close(parts["ce"], torch.as_tensor(ce, dtype=torch.float32))
    torch.testing.assert_close(loss, torch.as_tensor(0.7 * 4.0 * kl + 0.3 * ce, dtype=torch.float32))
    # The student that equals the guided teacher has zero KL.
    guided = guide_logits(cond, uncond, scale)
    _, same = cfg_distillation_loss(guided, cond, uncond, targets, mask, scale)
    assert same["kl"].abs() < 1e-6
