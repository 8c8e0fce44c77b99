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
        blank_terms: (B, T, U+1, D) log P(blank) + log P(duration k) per cell (fp32). Entries of ``d = 0`` are
            ignored (a blank always advances).
        label_terms: (B, T, U+1, D) log P(y[u]) + log P(duration k) per cell; row ``u = U`` is ignored.
        durations: the D durations (frames), e.g. ``[0, 1]`` for RNN-T or ``[0, 1, 2, 3, 4]`` for TDT.
        frame_lens: (B,) valid frames T_b (>= 1).
        label_lens: (B,) transcript lengths U_b (<= U).

    Returns:
        (B,) losses, fp32. Padded frames and labels beyond each utterance's lengths never contribute.
    """
    batch, frames, labels1, num_d = blank_terms.shape
    device = blank_terms.device
    diagonals = frames + labels1 - 1
    u_index = torch.arange(labels1, device=device)
    # Skew (B, T, U+1, D) -> (B, N, U+1, D): entry [n, u] is cell (t = n - u, u); cells outside [0, T) are NEG.
    t_index = torch.arange(diagonals, device=device)[:, None] - u_index[None, :]  # (N, U+1)
    inside = (t_index >= 0) & (t_index < frames)
    gather = t_index.clamp(0, frames - 1)[None, :, :, None].expand(batch, -1, -1, num_d)

    def skew(terms: torch.Tensor) -> torch.Tensor:
        skewed = torch.gather(terms.to(torch.promote_types(terms.dtype, torch.float32)), 1, gather)
        return torch.where(inside[None, :, :, None], skewed, NEG)

    # Blank terms of duration 0 and label terms of the last row are never read: a blank always advances, and
    # nothing follows the last label.
    blank_skewed = skew(blank_terms)
    label_skewed = skew(label_terms)

    dtype = blank_skewed.dtype
    # Per diagonal n, the terms of every move that lands on it, stacked: blanks of duration d come from diagonal
    # n - d (same u), labels from n - d - 1 and u - 1. Shifted once here, then split into one piece per diagonal
    # (the backward pass of unbind stacks the pieces' gradients once; slicing in the loop would allocate a
    # full-size gradient per slice).
    blank_moves = [(k, d) for k, d in enumerate(durations) if d >= 1]

    def shifted(terms: torch.Tensor, k: int, shift: int, u_shift: int) -> torch.Tensor:
        piece = F.pad(terms[..., k], (u_shift, 0, shift, 0), value=NEG)  # (B, N + shift, U+1 + u_shift)
        return piece[:, :diagonals, :labels1]

    blank_in = torch.stack([shifted(blank_skewed, k, d, 0) for k, d in blank_moves])  # (Kb, B, N, U+1)
    label_in = torch.stack([shifted(label_skewed, k, d + 1, 1) for k, d in enumerate(durations)])  # (D, B, N, U+1)
    blank_in, label_in = blank_in.unbind(2), label_in.unbind(2)  # N x (Kb, B, U+1), N x (D, B, U+1)

    first = torch.full((batch, labels1), NEG, device=device, dtype=dtype)
    alpha = [torch.where(u_index == 0, 0.0, first)]  # alpha[n]: (B, U+1)
    unreached = first  # alpha of diagonals before the first
    for n in range(1, diagonals):
        from_blank = torch.stack([alpha[n - d] if n >= d else unreached for _, d in blank_moves]) + blank_in[n]
        from_label = torch.stack([alpha[n - d - 1] if n > d else unreached for d in durations])
        from_label = F.pad(from_label[..., :-1], (1, 0), value=NEG) + label_in[n]  # u - 1 -> u
        value = torch.logsumexp(torch.cat([from_blank, from_label]), dim=0)
        alpha.append(torch.where(inside[n], value, NEG))
    alpha_all = torch.stack(alpha, dim=1)  # (B, N, U+1)

    # The closing blank: from (T_b - d, U_b) with duration d >= 1 onto frame T_b.
    rows = torch.arange(batch, device=device)
    ends = []
    for k, d in enumerate(durations):
        if d < 1:
            continue
        n_end = frame_lens - d + label_lens
        valid = frame_lens - d >= 0
        n_safe = torch.where(valid, n_end, 0).clamp(max=diagonals - 1)
        value = alpha_all[rows, n_safe, label_lens] + blank_skewed[rows, n_safe, label_lens, k]
        ends.append(torch.where(valid, value, NEG))
    return -torch.logsumexp(torch.stack(ends), dim=0)


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
