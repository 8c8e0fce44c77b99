"""Transducer losses (RNN-T and TDT) in plain PyTorch, from per-cell log-probabilities.

Both losses sum over all alignments of a transcript ``y`` (length U) with T encoder frames. A path walks the lattice
of cells ``(t, u)`` (frame t, u labels emitted) from ``(0, 0)``; in cell ``(t, u)`` it either

- emits the blank and moves to ``(t + d, u)``, or
- emits the label ``y[u]`` and moves to ``(t + d, u + 1)``,

and ends with a blank that lands exactly on frame T after all U labels. RNN-T is the case "blank: d = 1, label:
d = 0"; TDT (token-and-duration transducer, Xu et al. 2023) lets a duration head pick d from ``durations``
(d >= 1 for the blank), each with its own log-probability.

So both losses are one recursion over the forward variable ``alpha(t, u)``, given per cell

- ``blank_terms[b, t, u, k]``: log P(blank) + log P(duration ``durations[k]``) at ``(t, u)``;
- ``label_terms[b, t, u, k]``: log P(y[u]) + log P(duration ``durations[k]``) at ``(t, u)``.

Every transition goes from anti-diagonal ``n = t + u`` to a later one (blank: ``n + d`` with d >= 1; label:
``n + d + 1``), so the recursion runs over the T + U anti-diagonals, each computed at once for all cells and
utterances (no Python loop over T x U cells). The lattice is stored skewed: ``A[n, u] = alpha(n - u, u)``.

The gradient is not left to autograd: :class:`_TransducerLoss` computes the backward variable ``beta(t, u)`` with
the same recursion run backwards, and each move's gradient in closed form, ``-exp(alpha(source) + term +
beta(target) - log P(y))`` (its posterior probability), for all cells at once. Autograd through the loop recorded
every diagonal's operators and replayed two to three times as many in backward; by hand, the loss dispatches about
a third of the operators. That matters most on a GPU, where the loop's small kernels make the step wait on the host
(``benchmarks/gpu_profile.py``), and on the CPU the demo trains more steps in its time budget.

The inputs are the gathered log-probabilities only (B x T x (U+1) x D values), never the full vocabulary: the
joint network that produces them can be run in sub-batches (:mod:`speechtrain.asr.transducer`).
"""

import torch
import torch.nn.functional as F

# A finite "minus infinity": sums of a few stay finite in fp32, and exp() of it is 0, so cells that no path reaches
# have zero (never NaN) gradients.
NEG = -1.0e30


def transducer_loss_from_terms(
    blank_terms: torch.Tensor,
    label_terms: torch.Tensor,
    durations: list[int],
    frame_lens: torch.Tensor,
    label_lens: torch.Tensor,
) -> torch.Tensor:
    """Negative log-likelihood of each utterance's transcript.

    Args:
        blank_terms: (B, T, U+1, D) log P(blank) + log P(duration k) per cell (computed in fp32 or wider). Entries
            of ``d = 0`` are ignored (a blank always advances).
        label_terms: (B, T, U+1, D) log P(y[u]) + log P(duration k) per cell; row ``u = U`` is ignored.
        durations: the D durations (frames), e.g. ``[0, 1]`` for RNN-T or ``[0, 1, 2, 3, 4]`` for TDT.
        frame_lens: (B,) valid frames T_b (>= 1).
        label_lens: (B,) transcript lengths U_b (<= U).

    Returns:
        (B,) losses, fp32 (or the inputs' wider type). Padded frames and labels beyond each utterance's lengths never
        contribute and get zero gradients. An utterance with no alignment gets a huge finite loss (about 1e30) and
        zero gradients (callers mask it: see :func:`feasible`).
    """
    return _TransducerLoss.apply(blank_terms, label_terms, frame_lens, label_lens, tuple(durations))


def _logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.logsumexp`` over ``dim`` for the lattice, whose entries are mostly NEG: exp() takes a slow path on the
    CPU for arguments below about -87 (results under fp32's normal range are many times slower per element). Terms
    more than 80 below the largest (under 2e-35 of it, nothing at fp32's or fp64's precision) count as exp(-80)
    instead."""
    top = x.amax(dim, keepdim=True)
    return (x - top).clamp_(min=-80.0).exp_().sum(dim).log_().add_(top.squeeze(dim))


def _posterior(log_p: torch.Tensor) -> torch.Tensor:
    """exp() of log-posteriors (<= 0 up to rounding; NEG off the lattice), exactly 0 below exp(-80), kept out of
    exp()'s slow path (see :func:`_logsumexp`)."""
    log_p = log_p.clamp_(max=0.0)
    return log_p.masked_fill_(log_p < -80.0, float("-inf")).exp_()


def _masked_skewed_terms(blank_terms, label_terms, frame_lens, label_lens, durations):
    """The terms skewed to (B, N, U+1, D) (entry [n, u] is cell (t = n - u, u)), each kept only where its move stays
    on the utterance's lattice and NEG elsewhere: blanks and labels that land before frame T_b, and the closing
    blanks (from u = U_b onto frame T_b exactly), which are split off as their own terms."""
    batch, frames, labels1, num_d = blank_terms.shape
    device = blank_terms.device
    dtype = torch.promote_types(blank_terms.dtype, torch.float32)
    diagonals = frames + labels1 - 1
    u_index = torch.arange(labels1, device=device)
    t_index = torch.arange(diagonals, device=device)[:, None] - u_index[None, :]  # (N, U+1)
    gather = t_index.clamp(0, frames - 1)[None, :, :, None].expand(batch, -1, -1, num_d)
    skewed_blank = torch.gather(blank_terms.to(dtype), 1, gather)
    skewed_label = torch.gather(label_terms.to(dtype), 1, gather)

    t = t_index[None, :, :, None]  # (1, N, U+1, 1)
    u = u_index[None, None, :, None]
    # The frame each move lands on, from the Python durations (no host-to-device copy of them in the step).
    land = torch.stack([t_index + d for d in durations], dim=-1)[None]  # (1, N, U+1, D)
    advances = land > t  # d >= 1
    t_end, u_end = frame_lens[:, None, None, None], label_lens[:, None, None, None]
    cell = (t >= 0) & (t < t_end) & (u <= u_end)
    blank_ok = cell & advances & (land < t_end)
    label_ok = cell & (u < u_end) & (land < t_end)
    end_ok = cell & advances & (u == u_end) & (land == t_end)
    return (torch.where(blank_ok, skewed_blank, NEG), torch.where(label_ok, skewed_label, NEG),
            torch.where(end_ok, skewed_blank, NEG))  # fmt: skip


def _offset_terms(terms: torch.Tensor, durations: tuple[int, ...], extra: int, incoming: bool) -> torch.Tensor:
    """(N, J, B, U+1): for the offsets j = 1 .. max(d) + ``extra`` (descending if ``incoming``), the terms of the
    moves of duration ``j - extra`` (NEG where there is none; a blank of duration 0 is none). ``incoming``: the term
    of the move that lands on cell (n, u) from diagonal n - j (and from u - 1 for a label, ``extra`` = 1: read there,
    in the forward pass); else the term of the move that leaves diagonal n (in the backward pass)."""
    batch, diagonals, labels1, _ = terms.shape
    top = max(durations) + extra
    pieces = []
    for j in range(top, 0, -1) if incoming else range(1, top + 1):
        d = j - extra
        if d in durations and (extra or d >= 1):
            piece = terms[..., durations.index(d)]
            if incoming:  # read at n - j (and u - 1 for a label)
                piece = F.pad(piece, (extra, 0, j, 0), value=NEG)[:, :diagonals, :labels1]
        else:
            piece = terms.new_full((batch, diagonals, labels1), NEG)
        pieces.append(piece)
    return torch.stack(pieces).permute(2, 0, 1, 3).contiguous()  # (J, B, N, U+1) -> (N, J, B, U+1)


class _TransducerLoss(torch.autograd.Function):
    """The transducer loss with a hand-written backward pass (see the module's docstring)."""

    @staticmethod
    def forward(ctx, blank_terms, label_terms, frame_lens, label_lens, durations):
        blank, label, end = _masked_skewed_terms(blank_terms, label_terms, frame_lens, label_lens, durations)
        batch, diagonals, labels1, _ = blank.shape
        top = max(durations)
        # alpha[P + n, b, 1 + u]: P rows "before the lattice" and a column for u = -1, all NEG, so that a diagonal
        # reads its sources as two slices: blanks from n - top .. n - 1 (same u), labels from n - top - 1 .. n - 1
        # (u - 1); incoming[n] holds the moves' terms in the same order.
        incoming = torch.cat([_offset_terms(blank, durations, 0, True), _offset_terms(label, durations, 1, True)], 1)
        pad = top + 1
        alpha = blank.new_full((pad + diagonals, batch, labels1 + 1), NEG)
        alpha[pad, :, 1] = 0.0  # cell (0, 0)
        for n in range(1, diagonals):
            row = pad + n
            sources = torch.cat([alpha[row - top : row, :, 1:], alpha[row - top - 1 : row, :, :-1]])
            alpha[row, :, 1:] = _logsumexp(sources.add_(incoming[n]), dim=0)
        alpha = alpha[pad:, :, 1:].permute(1, 0, 2)  # (B, N, U+1)
        log_z = _logsumexp((alpha[..., None] + end).flatten(1), dim=1)
        ctx.save_for_backward(blank, label, end, alpha, log_z)
        ctx.durations = durations
        ctx.input_info = (blank_terms.shape, blank_terms.dtype, label_terms.dtype)
        return -log_z

    @staticmethod
    def backward(ctx, grad_loss):
        blank, label, end, alpha, log_z = ctx.saved_tensors
        durations = ctx.durations
        batch, diagonals, labels1, _ = blank.shape
        top = max(durations)
        # beta[n, b, u]: rows past the last diagonal and a column for u = U + 1, all NEG. A diagonal reads its
        # targets as two slices (blanks: n + 1 .. n + top, same u; labels: n + 1 .. n + top + 1, u + 1), and the
        # closing blanks' terms with a zero target (the end of the lattice).
        closing = _logsumexp(end, dim=3)[None].permute(2, 0, 1, 3)  # (N, 1, B, U+1)
        outgoing = torch.cat([_offset_terms(blank, durations, 0, False), _offset_terms(label, durations, 1, False),
                              closing], dim=1)  # fmt: skip
        beta = blank.new_full((diagonals + top + 1, batch, labels1 + 1), NEG)
        zero = blank.new_zeros((1, batch, labels1))
        for n in range(diagonals - 1, -1, -1):
            targets = torch.cat([beta[n + 1 : n + top + 1, :, :-1], beta[n + 1 : n + top + 2, :, 1:], zero])
            beta[n, :, :-1] = _logsumexp(targets.add_(outgoing[n]), dim=0)
        # Each move's gradient is minus its posterior, exp(alpha(source) + term + beta(target) - log P(y)). Only an
        # utterance with no alignment (log P(y) ~ NEG) can give an exponent above 0; its gradient is zero.
        scale = torch.where(log_z > NEG / 2, grad_loss, 0.0).to(alpha.dtype)[:, None, None, None]
        base = (alpha - log_z[:, None, None])[..., None]  # (B, N, U+1, 1)
        beta = beta.permute(1, 0, 2)  # (B, N + top + 1, U+2)
        blank_next = torch.stack([beta[:, d : d + diagonals, :-1] for d in durations], dim=3)
        label_next = torch.stack([beta[:, d + 1 : d + 1 + diagonals, 1:] for d in durations], dim=3)
        grad_blank = _posterior(base + blank + blank_next).add_(_posterior(base + end))
        grad_label = _posterior(base + label + label_next)
        # Unskew: cell (t, u) is entry [t + u, u].
        shape, blank_dtype, label_dtype = ctx.input_info
        frames = shape[1]
        index = torch.arange(frames, device=blank.device)[:, None] + torch.arange(labels1, device=blank.device)
        index = index[None, :, :, None].expand(shape)
        grad_blank = torch.gather(grad_blank.mul_(-scale), 1, index).to(blank_dtype)
        grad_label = torch.gather(grad_label.mul_(-scale), 1, index).to(label_dtype)
        return grad_blank, grad_label, None, None, None


def rnnt_terms(log_probs_blank: torch.Tensor, log_probs_label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RNN-T's per-cell terms for :func:`transducer_loss_from_terms` with ``durations=[0, 1]``.

    Args:
        log_probs_blank: (B, T, U+1) log P(blank) per cell.
        log_probs_label: (B, T, U+1) log P(y[u]) per cell.
    """
    blank = torch.stack([torch.full_like(log_probs_blank, NEG), log_probs_blank], dim=-1)  # blank: d = 1
    label = torch.stack([log_probs_label, torch.full_like(log_probs_label, NEG)], dim=-1)  # label: d = 0
    return blank, label


def rnnt_loss(log_probs_blank: torch.Tensor, log_probs_label: torch.Tensor, frame_lens: torch.Tensor,
              label_lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """(B,) RNN-T losses from (B, T, U+1) blank and label log-probabilities (see :func:`rnnt_terms`)."""
    return transducer_loss_from_terms(*rnnt_terms(log_probs_blank, log_probs_label), [0, 1], frame_lens, label_lens)


def tdt_terms(
    log_probs_blank: torch.Tensor, log_probs_label: torch.Tensor, duration_log_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """TDT's per-cell terms: token and duration log-probabilities add (the two heads are independent).

    Args:
        log_probs_blank, log_probs_label: (B, T, U+1).
        duration_log_probs: (B, T, U+1, D) log P(duration k).
    """
    return log_probs_blank[..., None] + duration_log_probs, log_probs_label[..., None] + duration_log_probs


def tdt_loss(
    log_probs_blank: torch.Tensor,
    log_probs_label: torch.Tensor,
    duration_log_probs: torch.Tensor,
    durations: list[int],
    frame_lens: torch.Tensor,
    label_lens: torch.Tensor,
) -> torch.Tensor:
    """(B,) TDT losses (see :func:`tdt_terms`)."""
    blank, label = tdt_terms(log_probs_blank, log_probs_label, duration_log_probs)
    return transducer_loss_from_terms(blank, label, durations, frame_lens, label_lens)


def feasible(frame_lens: torch.Tensor, label_lens: torch.Tensor, durations: list[int]) -> torch.Tensor:
    """(B,) bool: whether any alignment exists. Every transcript fits in one frame when a label may take duration 0
    (RNN-T, and TDT with 0 among its durations); otherwise each label and the closing blank take a frame each."""
    if 0 in durations:
        return frame_lens >= 1
    return frame_lens >= label_lens + 1
