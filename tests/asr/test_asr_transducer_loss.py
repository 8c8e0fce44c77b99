import pytest
import torch
import torchaudio

from speechtrain.asr.transducer_loss import feasible, rnnt_loss, tdt_loss


def _brute_force(blank_lp, label_lp, dur_lp, durations, frames, labels, rnnt):
    """log P(y) of one utterance by listing every alignment (paths of (blank|label, duration) moves)."""
    paths = []

    def walk(t, u, score):
        if t == frames:
            return
        for k, d in enumerate(durations):
            if (rnnt and d != 1) or d == 0:
                continue
            blank = blank_lp[t, u] + (0 if rnnt else dur_lp[t, u, k])
            if u == labels and t + d == frames:
                paths.append(score + blank)
            elif t + d < frames:
                walk(t + d, u, score + blank)
        if u < labels:
            for k, d in enumerate(durations):
                if rnnt and d != 0:
                    continue
                if t + d < frames:
                    walk(t + d, u + 1, score + label_lp[t, u] + (0 if rnnt else dur_lp[t, u, k]))

    walk(0, 0, torch.zeros((), dtype=blank_lp.dtype))
    return torch.logsumexp(torch.stack(paths), 0), len(paths)


def _random_case(seed, batch=3, frames=5, labels=3, vocab=4, num_d=5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, frames, labels + 1, vocab + 1, generator=g, dtype=torch.float64).requires_grad_()
    dur_logits = torch.randn(batch, frames, labels + 1, num_d, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, vocab, (batch, labels), generator=g)
    frame_lens = torch.tensor([frames, frames - 1, 2])[:batch]
    label_lens = torch.tensor([labels, 1, labels - 1])[:batch]
    return logits, dur_logits, targets, frame_lens, label_lens


def _gathered(logits, targets):
    lp = logits.log_softmax(-1)
    blank = lp[..., -1]
    padded = torch.cat([targets, targets[:, :1]], 1)  # (B, U+1): row U is never used
    label = torch.gather(lp, 3, padded[:, None, :, None].expand(-1, lp.shape[1], -1, 1))[..., 0]
    return blank, label


@pytest.mark.parametrize("durations", [[0, 1, 2, 3, 4], [1, 2], [0, 1, 3]])
def test_tdt_loss_equals_brute_force_enumeration_values_and_gradients(durations):
    logits, dur_logits, targets, frame_lens, label_lens = _random_case(0, num_d=len(durations))
    blank, label = _gathered(logits, targets)
    dur = dur_logits.log_softmax(-1)
    losses = tdt_loss(blank, label, dur, durations, frame_lens, label_lens)
    grads = torch.autograd.grad(losses.sum(), [logits, dur_logits])
    for b in range(3):
        lg, dl = logits[b].detach().requires_grad_(), dur_logits[b].detach().requires_grad_()
        bl, la = _gathered(lg[None], targets[b : b + 1])
        ok = bool(feasible(frame_lens[b : b + 1], label_lens[b : b + 1], durations))
        if not ok:
            continue
        ref, count = _brute_force(bl[0], la[0], dl.log_softmax(-1), durations, int(frame_lens[b]),
                                  int(label_lens[b]), rnnt=False)  # fmt: skip
        assert count > 1
        torch.testing.assert_close(losses[b], -ref, atol=1e-5, rtol=0)
        ref_grads = torch.autograd.grad(-ref, [lg, dl])
        torch.testing.assert_close(grads[0][b], ref_grads[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(grads[1][b], ref_grads[1], atol=1e-5, rtol=0)


def test_rnnt_loss_equals_brute_force_and_torchaudio_with_padding():
    logits, _, targets, frame_lens, label_lens = _random_case(1)
    blank, label = _gathered(logits, targets)
    losses = rnnt_loss(blank, label, frame_lens, label_lens)
    (grad,) = torch.autograd.grad(losses.sum(), [logits])
    for b in range(3):
        lg = logits[b].detach().requires_grad_()
        bl, la = _gathered(lg[None], targets[b : b + 1])
        ref, _ = _brute_force(bl[0], la[0], None, [0, 1], int(frame_lens[b]), int(label_lens[b]), rnnt=True)
        torch.testing.assert_close(losses[b], -ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(grad[b], torch.autograd.grad(-ref, [lg])[0], atol=1e-5, rtol=0)
    # torchaudio (fp32, logits in, blank last), on the same padded batch
    ta_logits = logits.detach().float().requires_grad_()
    ta = torchaudio.functional.rnnt_loss(ta_logits, targets.int(), frame_lens.int(), label_lens.int(), blank=4,
                                         reduction="none")  # fmt: skip
    ta.sum().backward()
    torch.testing.assert_close(losses.float(), ta, atol=1e-5, rtol=0)
    mask = torch.zeros_like(grad, dtype=torch.bool)
    for b in range(3):
        mask[b, : frame_lens[b], : label_lens[b] + 1] = True
    torch.testing.assert_close(grad.float()[mask], ta_logits.grad[mask], atol=1e-5, rtol=0)


def test_fp32_batched_equals_per_utterance_and_padding_is_inert():
    logits, dur_logits, targets, frame_lens, label_lens = _random_case(2, batch=3, frames=7, labels=4)
    logits, dur_logits = logits.float().detach().requires_grad_(), dur_logits.float().detach().requires_grad_()
    blank, label = _gathered(logits, targets)
    losses = tdt_loss(blank, label, dur_logits.log_softmax(-1), [0, 1, 2, 3, 4], frame_lens, label_lens)
    grads = torch.autograd.grad(losses.sum(), [logits, dur_logits])
    for b in range(3):
        t, u = int(frame_lens[b]), int(label_lens[b])
        lg = logits[b : b + 1, :t, : u + 1].detach().requires_grad_()
        dl = dur_logits[b : b + 1, :t, : u + 1].detach().requires_grad_()
        bl, la = _gathered(lg, targets[b : b + 1, :u])
        alone = tdt_loss(bl, la, dl.log_softmax(-1), [0, 1, 2, 3, 4], frame_lens[b : b + 1], label_lens[b : b + 1])
        torch.testing.assert_close(losses[b : b + 1], alone, atol=1e-5, rtol=0)
        g = torch.autograd.grad(alone.sum(), [lg, dl])
        torch.testing.assert_close(grads[0][b : b + 1, :t, : u + 1], g[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(grads[1][b : b + 1, :t, : u + 1], g[1], atol=1e-5, rtol=0)
        assert grads[0][b, t:].abs().sum() == 0 and grads[0][b, :, u + 1 :].abs().sum() == 0


def test_an_utterance_with_no_alignment_gets_zero_finite_gradients_and_leaves_the_others_alone():
    logits, dur_logits, targets, frame_lens, label_lens = _random_case(3, num_d=2)
    frame_lens, label_lens = torch.tensor([5, 2, 4]), torch.tensor([3, 3, 2])  # [1, 2]: 3 labels need 4 frames
    blank, label = _gathered(logits, targets)
    losses = tdt_loss(blank, label, dur_logits.log_softmax(-1), [1, 2], frame_lens, label_lens)
    assert not feasible(frame_lens, label_lens, [1, 2])[1] and losses[1] > 1e29
    grads = torch.autograd.grad(torch.where(torch.tensor([True, False, True]), losses, 0.0).sum(), [logits])[0]
    assert torch.isfinite(grads).all() and grads[1].abs().sum() == 0
    alone = tdt_loss(blank[::2], label[::2], dur_logits.log_softmax(-1)[::2], [1, 2], frame_lens[::2],
                     label_lens[::2])  # fmt: skip
    torch.testing.assert_close(losses[::2], alone, atol=1e-9, rtol=0)
