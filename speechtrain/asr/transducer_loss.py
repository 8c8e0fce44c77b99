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

The gradient is not left to autograd: :class:`_TransducerLoss` computes the backward variable ``beta(t, u)`` and
each move's gradient in closed form, ``-exp(alpha(source) + term + beta(target) - log P(y))`` (its posterior
probability), for all cells at once. Beta is the same recursion on the lattice reversed in t and u, so it runs in the
same loop as alpha, as B more lattices; and :func:`tdt_loss` runs the TDT lattices and the RNN-T ones that its
``omega`` mixes in as one batch too: one loop over the T + U diagonals per training step. Each diagonal reads every
source cell through one strided view of the lattice and is eleven dispatched operators (eight kernels). The loss of
the demo's hybrid TDT-CTC model at a 600 s batch (15 x 129 frames x 76 labels) dispatches about 3,200 operators for
forward and backward together, where the earlier loop (one per loss, autograd-free backward loop) dispatched 31,600.
That matters most on a GPU, where the loop's small kernels make the step wait on the host
(``benchmarks/gpu_profile.py``).

The inputs are the gathered log-probabilities only (B x T x (U+1) x D values), never the full vocabulary: the
joint network that produces them can be run in sub-batches (:mod:`speechtrain.asr.transducer`).
"""

import torch

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
    with_beta = torch.is_grad_enabled() and (blank_terms.requires_grad or label_terms.requires_grad)
    return _TransducerLoss.apply(blank_terms, label_terms, frame_lens, label_lens, tuple(durations), with_beta)


def _logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.logsumexp`` over ``dim`` for the lattice, whose entries are mostly NEG: exp() takes a slow path on the
    CPU for arguments below about -87 (results under fp32's normal range are many times slower per element). Terms
    more than 80 below the largest (under 2e-35 of it, nothing at fp32's or fp64's precision) count as exp(-80)
    instead."""
    top = x.amax(dim, keepdim=True)
    return (x - top).clamp_min_(-80.0).exp_().sum(dim).log_().add_(top.squeeze(dim))


def _posterior(log_p: torch.Tensor) -> torch.Tensor:
    """exp() of log-posteriors (<= 0 up to rounding; NEG off the lattice), exactly 0 below exp(-80), kept out of
    exp()'s slow path (see :func:`_logsumexp`)."""
    log_p = log_p.clamp_max_(0.0)
    return log_p.masked_fill_(log_p < -80.0, float("-inf")).exp_()


def _all_durations(terms: torch.Tensor, durations: tuple[int, ...], count: int = 0) -> torch.Tensor:
    """(B, T, U+1, J): the terms of durations 0, 1, ..., J - 1 (J: ``count``, or max(d) + 1), NEG for those not in
    ``durations``."""
    count = count or max(durations) + 1
    if durations == tuple(range(count)):
        return terms
    neg = terms.new_full((), NEG).expand(terms.shape[:-1])
    return torch.stack([terms[..., durations.index(d)] if d in durations else neg for d in range(count)], dim=-1)


def _masked_skewed_terms(blank_terms, label_terms, frame_lens, label_lens):
    """The terms (of durations 0 .. J - 1) skewed to (B, N, U+1, J) (entry [n, u] is cell (t = n - u, u)), each kept
    only where its move stays on the utterance's lattice and NEG elsewhere: blanks and labels that land before frame
    T_b (the closing blanks, onto frame T_b exactly: :func:`_closing`)."""
    batch, frames, labels1, rows = blank_terms.shape
    device = blank_terms.device
    dtype = torch.promote_types(blank_terms.dtype, torch.float32)
    diagonals = frames + labels1 - 1
    u = torch.arange(labels1, device=device)
    t = torch.arange(diagonals, device=device)[:, None] - u  # (N, U+1)
    gather = t.clamp(0, frames - 1)[None, :, :, None].expand(batch, -1, -1, rows)
    skewed_blank = torch.gather(blank_terms if blank_terms.dtype == dtype else blank_terms.to(dtype), 1, gather)
    skewed_label = torch.gather(label_terms if label_terms.dtype == dtype else label_terms.to(dtype), 1, gather)
    # The frame each move lands on (durations 0 .. J - 1: an arange, no host-to-device copy in the step).
    d = torch.arange(rows, device=device)
    before_end = t[..., None] + d < frame_lens[:, None, None, None]  # (B, N, U+1, J); t < T_b follows (d >= 0)
    u = u[:, None] - label_lens[:, None, None, None]  # u - U_b: (B, 1, U+1, 1)
    on = (t >= 0)[..., None]
    blank_ok = before_end & (on & (d >= 1)) & (u <= 0)
    label_ok = before_end & on & (u < 0)
    return torch.where(blank_ok, skewed_blank, NEG), torch.where(label_ok, skewed_label, NEG)


def _closing(blank_terms: torch.Tensor, frame_lens: torch.Tensor, label_lens: torch.Tensor):
    """The closing blanks, from cell (T_b - d, U_b) onto frame T_b exactly (d >= 1; J per utterance at most), apart
    from the lattice: (B, J) their terms (NEG for no such move) in fp32 or wider, the (B, J) frames they leave from
    and whether each exists."""
    batch, frames, labels1, rows = blank_terms.shape
    d = torch.arange(rows, device=blank_terms.device)
    t = frame_lens[:, None] - d  # (B, J)
    ok = (t >= 0) & (d >= 1)
    t = t.clamp(0, frames - 1)  # (where there is no such move: any frame)
    at_end = blank_terms.gather(2, label_lens[:, None, None, None].expand(batch, frames, 1, rows))  # (B, T, 1, J)
    terms = at_end.gather(1, t[:, None, None, :])[:, 0, 0]
    terms = torch.where(ok, terms.to(torch.promote_types(terms.dtype, torch.float32)), NEG)
    return terms, t, ok


def _reversed(x: torch.Tensor, *dims: int) -> torch.Tensor:
    """The skewed lattice reversed in n and u (``dims``: those two, then any other to flip with them): cell (t, u) of
    a (T, U+1) lattice goes to (T - 1 - t, U - u), again a skewed lattice (entry [n, u] to [N - 1 - n, U - u])."""
    return x.flip(dims)


def _slot_terms(blank: torch.Tensor, label: torch.Tensor, with_beta: bool) -> torch.Tensor:
    """(N, J + 1, 2, B', U+1) terms of the recursion's slots (see :func:`_recursion`) from the (B, N, U+1, J) masked
    skewed terms, B' = B (alpha) or 2B (alpha's lattices, then beta's).

    Slot ``[r, k]`` of cell (n, u) is the move between it and the cell ``j = J - r`` diagonals back, ``k = 1``: same
    u (a blank of duration j), ``k = 0``: u - 1 (a label of duration j - 1); slot ``[J, 1]`` adds the value stored in
    the cell itself before its turn (its term is 0), and slots with no such move are NEG. Alpha's term is that of the
    move that lands on (n, u), read at its source; beta's recursion runs on the lattice reversed in n and u
    (:func:`_reversed`), with the term of the move that leaves (n, u)."""
    batch, diagonals, labels1, rows = blank.shape
    edge = blank.new_full((), NEG).expand(batch, diagonals, labels1, 2)
    # flipped: [..., k, r] = label of duration J - 1 - r (r < J), NEG (r = J); then NEG (r = 0), blank of duration
    # J - r (0 < r < J), 0 (r = J)
    ordered = torch.cat([torch.zeros_like(edge[..., :1]), blank[..., 1:], edge, label], dim=-1)
    by_slot = ordered.flip(-1).unflatten(-1, (2, rows + 1))  # (B, N, U+1, 2, J+1)
    # Alpha reads slot (r, k)'s term at its source, diagonal n - J + r and label u - 1 + k: one strided view of the
    # terms after J diagonals and a label of NEG.
    padded = blank.new_full((batch, rows + diagonals, labels1 + 1, 2, rows + 1), NEG)
    padded[:, rows:, 1:] = by_slot
    b, n, u, k, r = padded.stride()
    slots = padded.as_strided((diagonals, rows + 1, 2, batch, labels1), (n, n + r, u + k, b, u))
    if not with_beta:
        return slots.contiguous()
    back = _reversed(ordered, 1, 2, 3).unflatten(-1, (2, rows + 1)).permute(1, 4, 3, 0, 2)
    return torch.cat([slots, back], dim=3)


def _recursion(slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Runs ``X[n, :, u] = logsumexp over slots [r, k] of X[n - (J - r), :, u - 1 + k] + slots[n, r, k, :, u]`` over
    the N diagonals, X starting as ``values`` (N, B, U+1) (the constant each cell adds through slot [J, 1]), NEG
    before the lattice and at u = -1; returns X (N, B, U+1).

    One strided view reads every slot's source for all cells of a diagonal at once, so a diagonal is eleven operators
    (three views, the sum with the slots' terms, the log-sum-exp's seven, written in place), eight kernels."""
    diagonals, rows1, _, batch, labels1 = slots.shape
    rows = rows1 - 1
    x = values.new_full((rows + diagonals, batch, labels1 + 1), NEG)
    x[rows:, :, 1:] = values
    row, column = x.stride(0), x.stride(1)
    # Each diagonal's views as one as_strided call each (indexing a view would be two operators): its sources
    # [r, k, b, u] = x[n + r, b, u + k] (row n + r holds diagonal n + r - J, column u + k holds u - 1 + k), its slots'
    # terms, and where its result goes, x[J + n, b, 1 + u] as (1, 1, B, U+1).
    source_shape, source_stride = (rows + 1, 2, batch, labels1), (row, 1, column, 1)
    slot_shape, slot_stride, slot_start = slots.shape[1:], slots.stride()[1:], slots.storage_offset()
    out_shape, out_stride = (1, 1, batch, labels1), (0, 0, column, 1)
    for n in range(diagonals):
        terms = x.as_strided(source_shape, source_stride, n * row)
        terms = terms + slots.as_strided(slot_shape, slot_stride, slot_start + n * slots.stride(0))
        top = terms.amax((0, 1), keepdim=True)
        cell = x.as_strided(out_shape, out_stride, (rows + n) * row + 1)
        torch.sum(terms.sub_(top).clamp_min_(-80.0).exp_(), (0, 1), keepdim=True, out=cell)
        cell.log_().add_(top)
    return x[rows:, :, 1:]


class _TransducerLoss(torch.autograd.Function):
    """The transducer loss with a hand-written backward pass (see the module's docstring)."""

    @staticmethod
    def forward(ctx, blank_terms, label_terms, frame_lens, label_lens, durations, with_beta):
        blank_terms, label_terms = (_all_durations(x, durations) for x in (blank_terms, label_terms))
        if label_lens.dtype != torch.int64:  # (an index below)
            label_lens = label_lens.long()
        blank, label = _masked_skewed_terms(blank_terms, label_terms, frame_lens, label_lens)
        closing, frame, ok = _closing(blank_terms, frame_lens, label_lens)
        batch, diagonals, labels1, _ = blank.shape
        # where each closing blank leaves from, flattened (B, N x (U+1)): diagonal T_b - d + U_b, label U_b
        end_cell = (frame + label_lens[:, None]) * labels1 + label_lens[:, None]  # (B, J)
        # alpha's recursion starts with 0 stored in cell (0, 0); beta's, on the reversed lattice, with the closing
        # blanks' terms stored in the cells they leave from (target value 0; the others NEG). Run together as one
        # batch of 2B.
        start = blank.new_full((diagonals, batch, labels1), NEG)
        start[0, :, 0] = 0.0
        if with_beta:
            last = diagonals * labels1  # the moves that do not exist go to a column past the lattice
            cells = torch.where(ok, last - 1 - end_cell, last)  # reversed: entry [n, u] to [N - 1 - n, U - u]
            stored = blank.new_full((batch, last + 1), NEG).scatter_(1, cells, closing)
            start = torch.cat([start, stored[:, :last].view(batch, diagonals, labels1).transpose(0, 1)], dim=1)
        both = _recursion(_slot_terms(blank, label, with_beta), start)
        alpha = both[:, :batch].transpose(0, 1)  # (B, N, U+1)
        closed = alpha.flatten(1).gather(1, end_cell) + closing  # (B, J): alpha + the closing blank's term
        log_z = _logsumexp(closed, dim=1)
        if with_beta:
            beta = _reversed(both[:, batch:], 0, 2).transpose(0, 1)  # (B, N, U+1)
            ctx.save_for_backward(blank, label, alpha, beta, log_z, closed, frame, label_lens)
            ctx.durations = durations
            ctx.input_info = (blank_terms.shape, blank_terms.dtype, label_terms.dtype)
        return -log_z

    @staticmethod
    def backward(ctx, grad_loss):
        blank, label, alpha, beta, log_z, closed, frame, label_lens = ctx.saved_tensors
        batch, diagonals, labels1, rows = blank.shape
        # Each move's gradient is minus its posterior, exp(alpha(source) + term + beta(target) - log P(y)). Only an
        # utterance with no alignment (log P(y) ~ NEG) can give an exponent above 0; its gradient is zero.
        scale = -torch.where(log_z > NEG / 2, grad_loss, 0.0).to(alpha.dtype)[:, None]
        base = (alpha - log_z[:, None, None])[..., None]  # (B, N, U+1, 1)
        # the targets as views of beta after NEG past the last diagonal and at u = U + 1: a blank of duration d lands
        # on [n + d, u], a label on [n + d + 1, u + 1]
        padded = beta.new_full((batch, diagonals + rows + 1, labels1 + 1), NEG)
        padded[:, :diagonals, :labels1] = beta
        b, n, _ = padded.stride()
        blank_next = padded.as_strided(blank.shape, (b, n, 1, n))
        label_next = padded.as_strided(blank.shape, (b, n, 1, n), n + 1)
        grad_blank = _posterior(base + blank + blank_next)
        grad_label = _posterior(base + label + label_next)
        # Unskew: cell (t, u) is entry [t + u, u]; the closing blanks' gradients; then the given durations' columns.
        shape, blank_dtype, label_dtype = ctx.input_info
        frames = shape[1]
        index = torch.arange(frames, device=blank.device)[:, None] + torch.arange(labels1, device=blank.device)
        index = index[None, :, :, None].expand(batch, frames, labels1, rows)
        scale4 = scale[..., None, None]
        grad_blank = torch.gather(grad_blank.mul_(scale4), 1, index)
        grad_label = torch.gather(grad_label.mul_(scale4), 1, index)
        closing = (frame * labels1 + label_lens[:, None]) * rows + torch.arange(rows, device=blank.device)
        grad_blank.view(batch, -1).scatter_add_(1, closing, _posterior(closed - log_z[:, None]).mul_(scale))
        grads = []
        for grad, dtype in ((grad_blank, blank_dtype), (grad_label, label_dtype)):
            if ctx.durations != tuple(range(rows)):
                grad = torch.stack([grad[..., d] for d in ctx.durations], dim=-1)
            grads.append(grad if grad.dtype == dtype else grad.to(dtype))
        return grads[0], grads[1], None, None, None, None


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
    sigma: float = 0.0,
    omega: float = 0.0,
) -> torch.Tensor:
    """(B,) TDT losses (see :func:`tdt_terms`), NeMo's: of the token log-probabilities less ``sigma`` (the logit
    under-normalisation), and with ``omega`` > 0 (<= 0: off), ``(1 - omega) x that + omega x`` the plain RNN-T loss of
    the token log-probabilities. The two lattices run as one batch of 2B through one recursion (over ``durations`` and
    0 and 1, the RNN-T's), not one after the other: half the operators."""
    token_blank, token_label = log_probs_blank, log_probs_label
    if sigma:
        token_blank, token_label = log_probs_blank - sigma, log_probs_label - sigma
    blank, label = tdt_terms(token_blank, token_label, duration_log_probs)
    if omega <= 0:
        return transducer_loss_from_terms(blank, label, durations, frame_lens, label_lens)
    # Both lattices over durations 0 .. max(d): a move the loss does not have gets NEG.
    union = tuple(range(max(*durations, 1) + 1))
    neg = log_probs_blank.new_full((), NEG).expand(log_probs_blank.shape)
    rnnt_blank = torch.stack([log_probs_blank if d == 1 else neg for d in union], dim=-1)  # RNN-T: blank d = 1,
    rnnt_label = torch.stack([log_probs_label if d == 0 else neg for d in union], dim=-1)  # label d = 0
    blank = torch.cat([_all_durations(blank, tuple(durations), len(union)), rnnt_blank])
    label = torch.cat([_all_durations(label, tuple(durations), len(union)), rnnt_label])
    losses = transducer_loss_from_terms(blank, label, union, torch.cat([frame_lens, frame_lens]),
                                        torch.cat([label_lens, label_lens]))  # fmt: skip
    batch = frame_lens.shape[0]
    return (1 - omega) * losses[:batch] + omega * losses[batch:]


def feasible(frame_lens: torch.Tensor, label_lens: torch.Tensor, durations: list[int]) -> torch.Tensor:
    """(B,) bool: whether any alignment exists. Every transcript fits in one frame when a label may take duration 0
    (RNN-T, and TDT with 0 among its durations); otherwise each label and the closing blank take a frame each."""
    if 0 in durations:
        return frame_lens >= 1
    return frame_lens >= label_lens + 1
