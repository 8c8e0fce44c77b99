"""The transducer loss's batched recursion (alpha and beta together, TDT and the omega RNN-T as one batch) against a
straightforward cell-by-cell reference with autograd, and its budget: no host synchronisation, a few operators per
anti-diagonal."""

import pytest
import torch

from speechtrain.asr.transducer_loss import NEG, feasible, rnnt_loss, tdt_loss
from speechtrain.testing.step_budget import StepBudget, _HostCalls, _Operators, _Step


def _reference_log_z(blank, label, dur, durations, frames, labels, rnnt):
    """log P(y) of one utterance, alpha(t, u) cell by cell in the lattice's order (autograd for the gradients).
    ``blank``/``label``: (T, U+1) log-probabilities; ``dur``: (T, U+1, D) (ignored for RNN-T: blank d = 1, label
    d = 0)."""
    moves = [(1, 0.0)] if rnnt else [(d, dur[..., k]) for k, d in enumerate(durations)]
    label_moves = [(0, 0.0)] if rnnt else moves
    incoming = {(0, 0): [torch.zeros((), dtype=blank.dtype)]}
    alpha, ends = {}, []
    for t in range(frames):
        for u in range(labels + 1):
            if (t, u) not in incoming:
                continue
            alpha[t, u] = torch.logsumexp(torch.stack(incoming[t, u]), 0)
            for d, lp_d in moves:  # blanks advance
                if d == 0:
                    continue
                term = alpha[t, u] + blank[t, u] + (lp_d if rnnt else lp_d[t, u])
                if u == labels and t + d == frames:
                    ends.append(term)
                elif t + d < frames:
                    incoming.setdefault((t + d, u), []).append(term)
            if u < labels:
                for d, lp_d in label_moves:
                    if t + d < frames:
                        term = alpha[t, u] + label[t, u] + (lp_d if rnnt else lp_d[t, u])
                        incoming.setdefault((t + d, u + 1), []).append(term)
    return torch.logsumexp(torch.stack(ends), 0) if ends else None


def _reference_losses(blank, label, dur, durations, frame_lens, label_lens, sigma=0.0, omega=0.0, rnnt=False):
    out = []
    for b in range(blank.shape[0]):
        t, u = int(frame_lens[b]), int(label_lens[b])
        log_z = _reference_log_z(blank[b] - sigma, label[b] - sigma, dur[b], durations, t, u, rnnt)
        if omega > 0:
            log_z = (1 - omega) * log_z + omega * _reference_log_z(blank[b], label[b], None, [0, 1], t, u, True)
        out.append(-log_z)
    return torch.stack(out)


def _lattices(seed, batch, frames, labels, durations, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    token = torch.randn(batch, frames, labels + 1, 6, generator=g, dtype=dtype).log_softmax(-1)
    blank, label = token[..., 0].clone().requires_grad_(), token[..., 1].clone().requires_grad_()
    dur = torch.randn(batch, frames, labels + 1, len(durations), generator=g, dtype=dtype).log_softmax(-1)
    return blank, label, dur.requires_grad_()


SHAPES = [  # (frame_lens, label_lens): uneven lengths, U = 0, T = 1, one utterance as long as the padding
    ([5, 3, 1, 4], [3, 0, 0, 2]),
    ([1, 1], [0, 0]),
    ([7, 2, 6], [0, 2, 5]),
    ([9, 8, 3, 6, 2], [4, 1, 2, 0, 1]),
]


@pytest.mark.parametrize("durations", [[0, 1, 2, 3, 4], [0, 1, 3], [1, 2]])
@pytest.mark.parametrize("sigma, omega", [(0.0, 0.0), (0.02, 0.1), (0.5, 0.3)])
@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_tdt_losses_and_gradients_equal_the_cell_by_cell_reference(durations, sigma, omega, case):
    frame_lens, label_lens = (torch.tensor(x) for x in SHAPES[case])
    ok = feasible(frame_lens, label_lens, durations)
    frame_lens, label_lens = frame_lens[ok], label_lens[ok]  # (an infeasible one: its own test)
    blank, label, dur = _lattices(case, len(frame_lens), int(frame_lens.max()), int(label_lens.max()), durations)
    losses = tdt_loss(blank, label, dur, durations, frame_lens, label_lens, sigma=sigma, omega=omega)
    weights = torch.linspace(0.5, 1.5, len(losses), dtype=losses.dtype)  # a different upstream gradient each
    grads = torch.autograd.grad((losses * weights).sum(), [blank, label, dur])
    ref = _reference_losses(blank, label, dur, durations, frame_lens, label_lens, sigma, omega)
    ref_grads = torch.autograd.grad((ref * weights).sum(), [blank, label, dur], allow_unused=True)
    torch.testing.assert_close(losses, ref, atol=1e-6, rtol=0)
    for grad, ref_grad in zip(grads, ref_grads):
        ref_grad = torch.zeros_like(grad) if ref_grad is None else ref_grad
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)
    with torch.no_grad():  # alpha alone (no beta recursion) gives the same losses
        torch.testing.assert_close(tdt_loss(blank, label, dur, durations, frame_lens, label_lens, sigma=sigma,
                                            omega=omega), losses, atol=1e-12, rtol=0)  # fmt: skip


@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_rnnt_losses_and_gradients_equal_the_cell_by_cell_reference(case):
    frame_lens, label_lens = (torch.tensor(x) for x in SHAPES[case])
    blank, label, dur = _lattices(10 + case, len(frame_lens), int(frame_lens.max()), int(label_lens.max()), [0])
    losses = rnnt_loss(blank, label, frame_lens, label_lens)
    grads = torch.autograd.grad(losses.sum(), [blank, label])
    ref = _reference_losses(blank, label, dur, [0, 1], frame_lens, label_lens, rnnt=True)
    torch.testing.assert_close(losses, ref, atol=1e-6, rtol=0)
    for grad, ref_grad in zip(grads, torch.autograd.grad(ref.sum(), [blank, label], allow_unused=True)):
        torch.testing.assert_close(grad, torch.zeros_like(grad) if ref_grad is None else ref_grad, atol=1e-6, rtol=0)


def test_fp32_losses_follow_the_fp64_reference_and_padding_is_inert():
    durations = [0, 1, 2, 3, 4]
    frame_lens, label_lens = torch.tensor([12, 5, 9, 1]), torch.tensor([6, 2, 0, 0])
    blank, label, dur = _lattices(7, 4, 12, 6, durations)
    args = [x.detach().float().requires_grad_() for x in (blank, label, dur)]
    losses = tdt_loss(*args, durations, frame_lens, label_lens, sigma=0.02, omega=0.1)
    grads = torch.autograd.grad(losses.sum(), args)
    ref = _reference_losses(blank, label, dur, durations, frame_lens, label_lens, 0.02, 0.1)
    torch.testing.assert_close(losses.double(), ref, atol=0, rtol=1e-6)
    ref_grads = torch.autograd.grad(ref.sum(), [blank, label, dur])
    for grad, ref_grad in zip(grads, ref_grads):
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad.double(), ref_grad, atol=1e-5, rtol=0)
    for b, (t, u) in enumerate(zip(frame_lens.tolist(), label_lens.tolist())):
        assert grads[0][b, t:].abs().sum() == 0 and grads[0][b, :, u + 1 :].abs().sum() == 0


def test_an_infeasible_utterance_beside_feasible_ones_gets_a_huge_loss_and_zero_gradients():
    durations = [1, 2]
    frame_lens = torch.tensor([6, 2, 5], dtype=torch.int32)  # (int32 lengths, as some collators give)
    label_lens = torch.tensor([2, 3, 0], dtype=torch.int32)  # [1, 2]: 3 labels need 4 frames
    blank, label, dur = _lattices(3, 3, 6, 3, durations)
    losses = tdt_loss(blank, label, dur, durations, frame_lens, label_lens, sigma=0.02, omega=0.1)
    assert losses[1] > 1e28
    mask = torch.tensor([1.0, 0.0, 1.0], dtype=losses.dtype)
    grads = torch.autograd.grad((losses * mask).sum(), [blank, label, dur])
    assert all(torch.isfinite(g).all() and g[1].abs().sum() == 0 for g in grads)
    keep = torch.tensor([0, 2])
    ref = _reference_losses(blank[keep], label[keep], dur[keep], durations, frame_lens[keep], label_lens[keep],
                            0.02, 0.1)  # fmt: skip
    torch.testing.assert_close(losses[keep], ref, atol=1e-6, rtol=0)


def _budget(function) -> _Step:
    owner = StepBudget()
    owner.current = _Step()
    with _HostCalls(owner), _Operators(owner):
        function()
    return owner.current


def test_the_loss_makes_no_host_sync_and_a_few_operators_per_diagonal():
    durations = [0, 1, 2, 3, 4]
    counts = {}
    for frames, labels in [(20, 10), (40, 10), (40, 30)]:
        blank, label, dur = (x.detach().float().requires_grad_() for x in _lattices(0, 3, frames, labels, durations))
        frame_lens, label_lens = torch.tensor([frames, frames - 3, 5]), torch.tensor([labels, 2, 0])

        def step(blank=blank, label=label, dur=dur, frame_lens=frame_lens, label_lens=label_lens):
            losses = tdt_loss(blank, label, dur, durations, frame_lens, label_lens, sigma=0.02, omega=0.1)
            losses.sum().backward()

        recorded = _budget(step)
        assert recorded.syncs == []
        counts[frames + labels] = recorded.ops
    # one recursion for TDT and RNN-T, alpha and beta: the operators grow by about a dozen per anti-diagonal
    per_diagonal = (counts[70] - counts[30]) / 40
    assert per_diagonal <= 14, counts
    assert counts[50] - counts[30] == pytest.approx(20 * per_diagonal, abs=2)
    assert counts[30] - 30 * per_diagonal < 400, counts  # the fixed part: terms, masks, gradients


def test_a_padded_entry_of_minus_infinity_leaves_the_losses_finite():
    """Padding may hold -inf (a masked joint): such entries are never read into the recursion's sums."""
    durations = [0, 1, 2]
    blank, label, dur = _lattices(5, 2, 6, 3, durations)
    frame_lens, label_lens = torch.tensor([6, 4]), torch.tensor([3, 1])
    padded = [x.detach().clone() for x in (blank, label, dur)]
    for x in padded:
        x[1, 4:] = float("-inf")
        x[1, :, 2:] = float("-inf")
    losses = tdt_loss(*[x.requires_grad_() for x in padded], durations, frame_lens, label_lens, omega=0.1)
    grads = torch.autograd.grad(losses.sum(), padded)
    assert torch.isfinite(losses).all() and all(torch.isfinite(g).all() for g in grads)
    assert losses.max() < -NEG / 2
    ref = _reference_losses(blank, label, dur, durations, frame_lens, label_lens, omega=0.1)
    torch.testing.assert_close(losses, ref, atol=1e-6, rtol=0)
